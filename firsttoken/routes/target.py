"""One target: an engine, its settings from the routes file, its health and its slots."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace

from firsttoken.engines.base import Delta, Engine, EngineError, GenerationRequest, delivers_steps
from firsttoken.engines.steps import pull
from firsttoken.observability import log_event
from firsttoken.routes.config import TargetConfig
from firsttoken.routes.health import TargetHealth

__all__ = ["Target"]


class Target:
    """An engine behind a route, as the router sees it."""

    __slots__ = (
        "_waiters",
        "config",
        "engine",
        "health",
        "name",
        "outstanding",
        "queue_waits",
        "steps",
    )

    def __init__(self, config: TargetConfig, engine: Engine) -> None:
        self.config = config
        self.name = config.name
        self.engine = engine
        self.health = TargetHealth(eject_after=config.eject_after, eject_s=config.eject_s)
        self.outstanding = 0  # streams there now
        self.steps = delivers_steps(engine)
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.queue_waits: list[float] = []  # seconds, drained by the metrics scrape

    @property
    def continues(self) -> bool:
        return self.config.continuation != "none"

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def has_room(self) -> bool:
        limit = self.config.max_concurrency
        return limit is None or self.outstanding < limit

    async def take_slot(self) -> None:
        """A slot under `max_concurrency`, waiting in line up to `queue_timeout_s`; raises
        `queue_timeout` (503) after that. First come, first served (fairness between keys is
        the fair queue's, a later step)."""
        if self.has_room() and not self._waiters:
            self.outstanding += 1
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        started = loop.time()
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.give_slot()  # handed a slot as it gave up: pass it on
            if isinstance(exc, TimeoutError):
                raise EngineError(
                    "queue_timeout",
                    f"target {self.name!r} stayed full for {self.config.queue_timeout_s:g} s",
                    retryable=True,
                    status=503,
                    retry_after_s=1.0,
                ) from None
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        self.queue_waits.append(loop.time() - started)
        # the slot was handed over with `outstanding` already counted

    def give_slot(self) -> None:
        self.outstanding -= 1
        self._pass_slot()

    def _pass_slot(self) -> None:
        while self._waiters and self.has_room():
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.outstanding += 1
                waiter.set_result(None)

    def generate(self, request: GenerationRequest, model: str) -> AsyncIterator[Delta]:
        """The engine's deltas for `request`, sent under the name this target knows."""
        if request.model != model:
            request = replace(request, model=model)
        if self.steps:
            return pull(self.engine, request)  # type: ignore[arg-type]
        return self.engine.generate(request)

    async def check(self) -> bool:
        """Active health: does the upstream answer GET /models? (Engines without a URL are
        not checked.)"""
        fetch = getattr(self.engine, "fetch_models", None)
        if fetch is None:
            return True
        try:
            return await fetch() is not None
        except Exception as exc:  # a check must never take the router down
            log_event("route.check_failed", logging.WARNING, target=self.name, error=repr(exc))
            return False

    def describe(self) -> Mapping[str, object]:
        return {"target": self.name, "kind": self.config.kind, "url": self.config.url}
