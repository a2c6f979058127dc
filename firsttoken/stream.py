"""One `Stream` per answer, and the registry whose task group runs their producers.

A stream's producer (engine → renderer → event log) runs in the registry's task group, under
its own cancel scope, so it can outlive a dropped connection for the resume grace window and
stops the moment that scope is cancelled: by the cancel endpoint, or when the last reader
leaves and the grace runs out.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections import deque
from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from firsttoken.engines import Engine, EngineError, GenerationRequest
from firsttoken.observability import Metrics, log_event
from firsttoken.resume import EventLog
from firsttoken.sse import encode_event

__all__ = ["Outcome", "Renderer", "Stream", "StreamRegistry"]


class Outcome(StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    DISCONNECTED = "disconnected"
    ERROR = "error"


class Renderer(Protocol):
    """Turns engine output into framed wire events for one API's format.

    Each method returns the data payloads (bytes) and the event name (None for `data:` only);
    the registry frames them with their sequence id and appends them to the log.
    """

    def opening(self) -> Sequence[tuple[str | None, bytes]]: ...

    def token(self, text: str) -> bytes: ...

    def closing(
        self, finish_reason: str, usage: dict[str, int]
    ) -> Sequence[tuple[str | None, bytes]]: ...

    def error(self, code: str, message: str) -> bytes: ...


class Stream:
    def __init__(
        self,
        request: GenerationRequest,
        renderer: Renderer,
        *,
        trace_id: str,
        grace_s: float,
        prompt_tokens: int,
        max_events: int,
        accepted_at: float,
    ) -> None:
        self.id = request.request_id
        self.request = request
        self.renderer = renderer
        self.trace_id = trace_id
        self.grace_s = grace_s
        self.prompt_tokens = prompt_tokens
        self.resume_token = secrets.token_urlsafe(24)
        self.log = EventLog(max_events)
        self.accepted_at = accepted_at
        self.first_token_at: float | None = None
        self.last_content_at = 0.0
        self.delivered_seq = 0  # highest seq written to any reader: later writes are replays
        self.tokens_generated = 0
        self.tokens_sent = 0
        self.readers = 0
        self.outcome: Outcome | None = None
        self.error_code: str | None = None
        self.logged_finish = False
        self.done = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self._stop_reason: Outcome | None = None
        self._abandon_epoch = 0

    def check_token(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.resume_token.encode())

    def stop(self, reason: Outcome) -> None:
        """Stop generation now (no-op once the producer has finished)."""
        if self._scope is not None and not self.done.is_set():
            self._stop_reason = self._stop_reason or reason
            self._scope.cancel()


class StreamRegistry:
    """Live and recently finished streams by id; runs each stream's producer."""

    def __init__(self, engine: Engine, metrics: Metrics, *, ttl_s: float) -> None:
        self.engine = engine
        self.metrics = metrics
        self.ttl_s = ttl_s
        self._streams: dict[str, Stream] = {}
        self._expiry: deque[tuple[float, str]] = deque()
        self._tg: TaskGroup | None = None

    async def run(self, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own the producers' task group until cancelled (the app's lifespan)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._sweep)
            task_status.started()
            await anyio.sleep_forever()

    def get(self, stream_id: str) -> Stream | None:
        return self._streams.get(stream_id)

    def __len__(self) -> int:
        return len(self._streams)

    async def start(self, stream: Stream) -> None:
        assert self._tg is not None, "registry is not running"
        self._streams[stream.id] = stream
        await self._tg.start(self._produce, stream)
        log_event(
            "stream.accepted",
            stream=stream.id,
            trace_id=stream.trace_id,
            model=stream.request.model,
            max_tokens=stream.request.max_tokens,
        )
        if stream.readers == 0:
            self._schedule_abandon(stream)

    def attach(self, stream: Stream) -> None:
        stream.readers += 1
        stream._abandon_epoch += 1

    def detach(self, stream: Stream) -> None:
        stream.readers -= 1
        if stream.readers == 0:
            if stream.done.is_set():
                self._log_finished(stream)
            else:
                self._schedule_abandon(stream)

    def _schedule_abandon(self, stream: Stream) -> None:
        if stream.grace_s <= 0:
            stream.stop(Outcome.DISCONNECTED)
            return
        stream._abandon_epoch += 1
        assert self._tg is not None
        self._tg.start_soon(self._abandon_after_grace, stream, stream._abandon_epoch)

    async def _abandon_after_grace(self, stream: Stream, epoch: int) -> None:
        with anyio.move_on_after(stream.grace_s):
            await stream.done.wait()
        if stream.readers == 0 and stream._abandon_epoch == epoch:
            stream.stop(Outcome.DISCONNECTED)

    async def _produce(self, stream: Stream, task_status: TaskStatus[None]) -> None:
        self.metrics.active_streams += 1
        outcome = Outcome.COMPLETED
        error: EngineError | None = None
        with anyio.CancelScope() as scope:
            stream._scope = scope
            task_status.started()
            try:
                await self._generate(stream)
            except EngineError as exc:
                outcome, error = Outcome.ERROR, exc
            except Exception as exc:  # a bug must still end the stream with an error event
                log_event("stream.crashed", logging.ERROR, stream=stream.id, error=repr(exc))
                outcome, error = Outcome.ERROR, EngineError("internal_error", "internal error")
        if scope.cancelled_caught:
            outcome = stream._stop_reason or Outcome.CANCELLED
        if outcome in (Outcome.CANCELLED, Outcome.DISCONNECTED):
            with anyio.CancelScope(shield=True):
                await self.engine.abort(stream.id)
            # A reader still attached, or one resuming later, learns why the stream ended.
            error = EngineError(*_STOPPED[outcome])
        if error is not None:
            stream.log.append(
                _frame(stream, "error", stream.renderer.error(error.code, error.message))
            )
        self._finish(stream, outcome, error)

    async def _generate(self, stream: Stream) -> None:
        log, renderer = stream.log, stream.renderer
        for name, data in renderer.opening():
            log.append(_frame(stream, name, data))
        finish = "stop"
        async for delta in self.engine.generate(stream.request):
            if delta.text:
                stream.tokens_generated += 1
                log.append(_frame(stream, None, renderer.token(delta.text)), 1)
            if delta.finish_reason:
                finish = delta.finish_reason
        usage = {
            "prompt_tokens": stream.prompt_tokens,
            "completion_tokens": stream.tokens_generated,
            "total_tokens": stream.prompt_tokens + stream.tokens_generated,
        }
        for name, data in renderer.closing(finish, usage):
            log.append(_frame(stream, name, data))

    def _finish(self, stream: Stream, outcome: Outcome, error: EngineError | None) -> None:
        stream.outcome = outcome
        stream.error_code = error.code if error else None
        stream.log.close()
        stream.done.set()
        self.metrics.active_streams -= 1
        self.metrics.streams[outcome.value] += 1
        self._expiry.append((time.monotonic() + self.ttl_s, stream.id))
        if stream.readers == 0:
            self._log_finished(stream)

    def _log_finished(self, stream: Stream) -> None:
        # Logged once generation is over and no reader is writing, so `tokens_sent` is final.
        if stream.logged_finish or stream.outcome is None:
            return
        stream.logged_finish = True
        ttft = stream.first_token_at
        log_event(
            "stream.finished",
            stream=stream.id,
            trace_id=stream.trace_id,
            outcome=stream.outcome.value,
            tokens_generated=stream.tokens_generated,
            tokens_sent=stream.tokens_sent,
            ttft_ms=None if ttft is None else round((ttft - stream.accepted_at) * 1000, 3),
            error_code=stream.error_code,
        )

    async def _sweep(self) -> None:
        while True:
            await anyio.sleep(min(1.0, max(self.ttl_s, 0.05)))
            now = time.monotonic()
            while self._expiry and self._expiry[0][0] <= now:
                _, stream_id = self._expiry.popleft()
                self._streams.pop(stream_id, None)


_STOPPED = {
    Outcome.CANCELLED: ("cancelled", "the stream was cancelled"),
    Outcome.DISCONNECTED: ("stream_abandoned", "no reader came back within the grace window"),
}


def _frame(stream: Stream, name: str | None, data: bytes) -> bytes:
    return encode_event(stream.log.next_seq, data, name)
