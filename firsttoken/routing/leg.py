"""One leg of an answer: one target's deltas, read under its phase deadlines.

A leg is read by plain calls, not through a generator of its own: `next()` awaits the
target's next delta under the phase's deadline and does the leg's bookkeeping (the target's
first-token time, its last chunk, the observer's chunk), so a relayed chunk crosses no layer
here, only a call. Per chunk that is two loop-clock reads, moving the `Deadline`'s due time
(its one timer is armed once per leg, re-armed only when it fires early) and the await of the
target's own iterator.

The phases: the first token within `first_token_timeout_s`, each later chunk within
`idle_timeout_s`, all within `total_timeout_s`; the total counts time spent waiting on the
target, not time its client took to read (a slow reader slows the upstream through
backpressure; that is no fault).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping, MutableMapping
from typing import Any, Protocol

from firsttoken.generation import Delta, EngineError, GenerationRequest
from firsttoken.routing.config import TargetConfig
from firsttoken.routing.deadline import Deadline
from firsttoken.routing.target import Target

__all__ = ["Leg", "LegWatch", "RouteObserver"]


class LegWatch(Protocol):
    """One upstream leg, watched: told of each chunk (at the loop's time) and of its end
    (None: the upstream finished; else what ended it, a close by the router included)."""

    def chunk(self, now: float) -> None: ...

    def end(self, failure: BaseException | None) -> None: ...


class RouteObserver(Protocol):
    """What a tracer (`--otlp-endpoint`) hears of the routes: each leg (it may hand the leg
    a request with its own trace context for the upstream) and each route event."""

    def leg(
        self, request: GenerationRequest, target: TargetConfig, model: str, now: float
    ) -> tuple[GenerationRequest, LegWatch | None]: ...

    def event(self, event: str, fields: Mapping[str, Any]) -> None: ...


class Leg:
    """`open()` takes the target's slot and starts its deltas; `next()` is the next delta
    (None at their end); `close(failure)` always, once open: the target's iterator is closed
    (the upstream sees us leave), the slot given back. `current` maps request ids to the
    target serving them (the router's, for `serving` and `abort`)."""

    __slots__ = (
        "_deadline",
        "_deltas",
        "_ended",
        "_first",
        "_left",
        "_limit",
        "_loop",
        "_watch",
        "current",
        "request",
        "target",
    )

    def __init__(
        self,
        target: Target,
        request: GenerationRequest,
        current: MutableMapping[str, Target],
    ) -> None:
        self.target = target
        self.request = request
        self.current = current
        self._loop = asyncio.get_running_loop()
        cfg = target.config
        self._left = cfg.total_timeout_s
        self._limit = min(cfg.first_token_timeout_s, self._left)
        self._first = True
        self._ended = False
        self._watch: LegWatch | None = None
        self._deltas: AsyncGenerator[Delta, None] | None = None
        self._deadline: Deadline | None = None

    async def open(self, model: str, observer: RouteObserver | None) -> None:
        """Wait for a slot (a `queue_timeout` is raised with nothing to close), then ask."""
        target, request = self.target, self.request
        await target.take_slot(request)
        self.current[request.request_id] = target
        self._deadline = Deadline()
        try:
            if observer is not None:
                request, self._watch = observer.leg(
                    request, target.config, model, self._loop.time()
                )
            self._deltas = target.generate(request, model)
        except BaseException as exc:
            await self.close(exc)
            raise

    async def next(self) -> Delta | None:
        deltas, deadline, loop = self._deltas, self._deadline, self._loop
        assert deltas is not None and deadline is not None
        began = loop.time()
        deadline.wait_until(began + self._limit)
        try:
            delta = await deltas.__anext__()
        except StopAsyncIteration:
            self._ended = True
            return None
        except asyncio.CancelledError as exc:
            if not deadline.owns(exc):
                raise
            raise _silence(self.target, self._first, self._limit >= self._left) from None
        finally:
            deadline.done_waiting()
        now = loop.time()
        target = self.target
        if self._first:
            self._first = False
            target.first_token(now - began)
        target.last_chunk_at = now
        left = self._left = self._left - (now - began)
        self._limit = min(target.config.idle_timeout_s, left)
        if self._watch is not None:
            self._watch.chunk(now)
        return delta

    async def close(self, failure: BaseException | None = None) -> None:
        """`failure`: what ended the leg; none given before its end means the router closed
        it (a hand-off, a client that left), which the observer hears as `GeneratorExit`."""
        if self._deadline is None:
            return  # closed already
        deltas, self._deltas = self._deltas, None
        try:
            if deltas is not None:
                await deltas.aclose()
        finally:
            if self._watch is not None:
                if failure is None and not self._ended:
                    failure = GeneratorExit()
                self._watch.end(failure)
                self._watch = None
            failure = None  # it may hold this frame in its traceback: no cycle left behind
            self._deadline.close()
            self._deadline = None
            target, rid = self.target, self.request.request_id
            target.give_slot()
            if self.current.get(rid) is target:
                del self.current[rid]


def _silence(target: Target, first: bool, total: bool) -> EngineError:
    cfg = target.config
    if total:
        what = f"end within {cfg.total_timeout_s:g} s"
    elif first:
        what = f"first token within {cfg.first_token_timeout_s:g} s"
    else:
        what = f"chunk within {cfg.idle_timeout_s:g} s"
    return EngineError(
        "upstream_timeout",
        f"the upstream sent nothing for too long (target {target.name!r}: no {what})",
        retryable=True,
    )
