"""One target: an engine, its settings from the routes file, its health and its slots."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Mapping
from dataclasses import replace

from firsttoken.engines.steps import pull
from firsttoken.generation import (
    DEFAULT_ANSWER_TOKENS,
    Delta,
    Engine,
    EngineError,
    GenerationRequest,
)
from firsttoken.routing.config import TargetConfig
from firsttoken.routing.health import TargetHealth
from firsttoken.routing.queue import FairQueue, Waiter
from firsttoken.telemetry.log import log_event
from firsttoken.telemetry.metrics import TTFT_BUCKETS, Histogram

__all__ = ["HEDGE_MIN_S", "QUEUE_WAIT_BUCKETS", "SILENT_S", "Target"]

QUEUE_WAIT_BUCKETS = TTFT_BUCKETS  # fine to 0.5 s, coarse to 60 s
# A target with streams running and no chunk from any of them for this long is taken for
# stalled when choosing where to splice (engines write tokens every few ms while they work).
SILENT_S = 0.5
HEDGE_MIN_S = 0.2


class Target:
    """An engine behind a route, as the router sees it."""

    __slots__ = (
        "config",
        "engine",
        "first_token_s",
        "handoff_s",
        "health",
        "last_chunk_at",
        "name",
        "outstanding",
        "prefill_s",
        "queue",
        "queue_wait",
        "steps",
    )

    def __init__(self, config: TargetConfig, engine: Engine) -> None:
        self.config = config
        self.name = config.name
        self.engine = engine
        self.health = TargetHealth(eject_after=config.eject_after, eject_s=config.eject_s)
        self.outstanding = 0  # streams there now
        self.last_chunk_at = 0.0  # loop time of the last chunk from any of them
        self.first_token_s: float | None = None  # its usual wait for a first token (EWMA)
        self.prefill_s: float | None = None  # its usual time to answer a hand-off's prefill
        self.handoff_s: float | None = None  # its usual delay on a hand-off once it is ready
        self.steps = engine.as_step_engine()  # pulled by a task of ours when it steps
        self.queue = FairQueue()
        self.queue_wait = Histogram(QUEUE_WAIT_BUCKETS)

    @property
    def continues(self) -> bool:
        return self.config.continuation != "none"

    @property
    def queued(self) -> int:
        return len(self.queue)

    def first_token(self, seconds: float) -> None:
        usual = self.first_token_s
        self.first_token_s = seconds if usual is None else usual + 0.2 * (seconds - usual)

    def prefilled(self, seconds: float) -> None:
        self.prefill_s = _ewma(self.prefill_s, seconds)

    def took_over(self, seconds: float) -> None:
        """A hand-off's first token came `seconds` after the later of its asking and the
        center's readiness (its prefill's answer)."""
        self.handoff_s = _ewma(self.handoff_s, seconds)

    def hedge_after(self) -> float:
        """How long a continuation may take to its first token before the next target is
        asked too: three times this target's usual, and never less than HEDGE_MIN_S."""
        usual = self.first_token_s
        return HEDGE_MIN_S if usual is None else max(HEDGE_MIN_S, 3 * usual)

    def silent(self, now: float) -> bool:
        """Streams there, and none has had a chunk for a while: likely stalled."""
        return self.outstanding > 0 and now - self.last_chunk_at > SILENT_S

    def has_room(self) -> bool:
        limit = self.config.max_concurrency
        return limit is None or self.outstanding < limit

    async def take_slot(self, request: GenerationRequest | None = None) -> None:
        """A slot under `max_concurrency`, waiting in the fair queue up to `queue_timeout_s`;
        raises `queue_timeout` (503) after that. The client's heartbeats flow meanwhile."""
        if self.has_room() and not self.queue:
            self.outstanding += 1
            if request is not None and self.config.max_concurrency is not None:
                self.queue.charge(
                    request.tenant,
                    request.priority,
                    max(request.weight, 0.001),
                    self._cost(request),
                )
            return
        loop = asyncio.get_running_loop()
        waiter = Waiter(loop.create_future(), since=loop.time())
        if request is not None:
            waiter.key = request.tenant
            waiter.priority = request.priority
            waiter.weight = max(request.weight, 0.001)
            waiter.cost = self._cost(request)
        self.queue.push(waiter)
        self._pass_slot()  # room may have come with nobody to hand it to
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                await waiter.future
        except BaseException as exc:
            future = waiter.future
            if future.done() and not future.cancelled():
                self.give_slot()  # handed a slot as it gave up: pass it on
            else:
                self.queue.remove(waiter)  # a client that leaves leaves the line
            if isinstance(exc, TimeoutError):
                raise EngineError(
                    "queue_timeout",
                    f"target {self.name!r} stayed full for {self.config.queue_timeout_s:g} s",
                    retryable=True,
                    status=503,
                    retry_after_s=1.0,
                ) from None
            raise
        self.queue_wait.observe(loop.time() - waiter.since)
        # the slot was handed over with `outstanding` already counted

    def give_slot(self) -> None:
        self.outstanding -= 1
        self._pass_slot()

    def _pass_slot(self) -> None:
        while self.has_room():
            waiter = self.queue.pop()
            if waiter is None:
                return
            if not waiter.future.done():
                self.outstanding += 1
                waiter.future.set_result(None)

    def _cost(self, request: GenerationRequest) -> int:
        """What a request may take of the engine, in tokens: its prompt (as admission counted
        it: a large prompt is not counted twice) and its answer."""
        prompt = request.prompt_tokens
        if prompt is None:
            prompt = self.engine.prompt_tokens(request.prompt) if request.prompt else 0
        answer = request.max_tokens if request.max_tokens is not None else DEFAULT_ANSWER_TOKENS
        return max(1, prompt + answer)

    def generate(self, request: GenerationRequest, model: str) -> AsyncGenerator[Delta, None]:
        """The engine's deltas for `request`, sent under the name this target knows."""
        if request.model != model:
            request = replace(request, model=model)
        if self.steps is not None:
            return pull(self.steps, request)
        return self.engine.generate(request)

    async def check(self) -> bool:
        """Active health: does the upstream answer GET /models? (An engine without one
        answers at once.)"""
        try:
            return await self.engine.fetch_models() is not None
        except Exception as exc:  # a check must never take the router down
            log_event("route.check_failed", logging.WARNING, target=self.name, error=repr(exc))
            return False

    def describe(self) -> Mapping[str, object]:
        return {"target": self.name, "kind": self.config.kind, "url": self.config.url}


def _ewma(usual: float | None, seconds: float) -> float:
    return seconds if usual is None else usual + 0.2 * (seconds - usual)
