"""The streaming ASGI response: one reader of a stream's event log, writing to one socket.

Siblings in one task group: the pump (log → socket, the only task that writes), the idle
watcher (tells the pump a ping is due; cuts a reader that takes no bytes) and the disconnect
watcher (cancels the group when the client goes). Whatever ends the group detaches the
reader, which is what lets the registry stop an abandoned stream's engine.
"""

from __future__ import annotations

import asyncio
import time

import anyio
import anyio.lowlevel
from starlette.types import Receive, Scope, Send

from firsttoken.compression import StreamCompressor
from firsttoken.errors import error_body
from firsttoken.observability import Metrics, log_event
from firsttoken.resume import Event, ResumeExpired
from firsttoken.sse import PING, encode_event
from firsttoken.stream import Stream, StreamRegistry

__all__ = ["ABORT_KEY", "RAW_SEND_KEY", "SSE_HEADERS", "EventStreamResponse", "sse_headers"]

# The scope key under which the app's outermost layer leaves the server's own `send`.
RAW_SEND_KEY = "firsttoken.raw_send"
# The scope key of a callable that resets the connection (set by our uvicorn protocol).
ABORT_KEY = "firsttoken.abort"

SSE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache, no-transform"),
    (b"x-accel-buffering", b"no"),
)


def sse_headers(stream: Stream, extra: dict[str, str] | None = None) -> list[tuple[bytes, bytes]]:
    headers = [
        *SSE_HEADERS,
        (b"x-stream-id", stream.id.encode()),
        (b"x-request-id", stream.trace_id.encode()),
    ]
    for name, value in (extra or {}).items():
        headers.append((name.lower().encode(), value.encode()))
    return headers


class EventStreamResponse:
    def __init__(
        self,
        stream: Stream,
        registry: StreamRegistry,
        metrics: Metrics,
        *,
        after: int = 0,
        heartbeat_s: float = 15.0,
        preamble: bytes = b"",
        headers: dict[str, str] | None = None,
        start: bool = False,
        send_timeout_s: float = 30.0,
        timestamps: bool = False,
        compressor: StreamCompressor | None = None,
    ) -> None:
        self.stream = stream
        self.registry = registry
        self.metrics = metrics
        self.after = after
        self.heartbeat_s = heartbeat_s
        self.preamble = preamble
        self.headers = sse_headers(stream, headers)
        self.start = start  # this reader starts the stream (OpenAI path: one request, one answer)
        self.send_timeout_s = send_timeout_s
        self.timestamps = timestamps  # `: t=<unix time>` before each event, for diagnosis
        self.compressor = compressor
        if compressor is not None:
            self.headers += [
                (b"content-encoding", compressor.encoding.encode()),
                (b"vary", b"accept-encoding"),
            ]
        self.stalled = False
        self._last_write = 0.0
        self._sending_since = 0.0
        self._ping_due = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        # Body writes skip the middleware's send wrappers (GZip, error handlers): they only
        # act on the start message, and each wrapper is a coroutine call per token.
        body_send: Send = scope.get(RAW_SEND_KEY, send)
        stream, log = self.stream, self.stream.log
        self.registry.attach(stream)
        log.track(self, self.after)
        finished = False
        try:
            if self.start:
                await self.registry.start(stream)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
                tg.start_soon(self._watch_idle, tg.cancel_scope)
                await self._pump(body_send)
                finished = True
                tg.cancel_scope.cancel()
        finally:
            log.untrack(self)
            self.registry.detach(stream)
        if finished:
            tail = self.compressor.finish() if self.compressor is not None else b""
            await body_send({"type": "http.response.body", "body": tail, "more_body": False})
        elif self.stalled:
            # The reader takes no bytes: a graceful close would wait on it forever.
            log_event(
                "stream.reader_stalled",
                stream=stream.id,
                trace_id=stream.trace_id,
                send_timeout_s=self.send_timeout_s,
            )
            abort = scope.get(ABORT_KEY)
            if abort is not None:
                abort()
                # Let the server see the connection go before we return.
                await anyio.lowlevel.checkpoint()

    async def _pump(self, send: Send) -> None:
        stream, log = self.stream, self.stream.log
        # perf_counter, not the loop's clock: uvloop's has 1 ms resolution, too coarse for
        # inter-chunk histograms with 0.5 ms buckets.
        clock = time.perf_counter
        seq = self.after
        self._last_write = clock()
        if self.preamble:
            await self._write(send, self.preamble)
        while True:
            try:
                events = log.after(seq)
            except ResumeExpired as exc:
                await self._write(
                    send,
                    encode_event(
                        log.next_seq,
                        error_body("resume_expired", str(exc), "invalid_request_error"),
                        "error",
                    ),
                )
                return
            if events:
                # Everything that piled up while the socket was busy leaves in one write.
                if self.timestamps:
                    stamp = b": t=%.6f\n" % time.time()
                    body = b"".join(stamp + e.wire for e in events)
                elif len(events) == 1:
                    body = events[0].wire
                else:
                    body = b"".join(e.wire for e in events)
                self._sending_since = clock()
                await self._write(send, body)
                now = clock()
                self._last_write = now
                self._sending_since = 0.0
                seq = events[-1].seq
                log.advance(self, seq)
                if seq > stream.delivered_seq and not stream.mirror:
                    self._account(events, now)
                continue
            if log.closed:
                return
            if self._ping_due:
                self._ping_due = False
                await self._write(send, PING)
                self._last_write = clock()
            await log.wait(seq)

    async def _write(self, send: Send, body: bytes) -> None:
        if self.compressor is not None:
            body = self.compressor.compress(body)
        await send({"type": "http.response.body", "body": body, "more_body": True})

    def _account(self, events: list[Event], now: float) -> None:
        """Metrics for first deliveries only: a replay to a resuming reader is not new."""
        stream, metrics = self.stream, self.metrics
        fresh = 0
        for event in events:
            if event.seq <= stream.delivered_seq or not event.tokens:
                continue
            fresh += event.tokens
            if stream.first_token_at is None:
                stream.first_token_at = now
                metrics.ttft.observe(now - stream.accepted_at)
                if stream.ticket is not None:
                    stream.ticket.first_token(now - stream.accepted_at)
                log_event(
                    "stream.first_token",
                    stream=stream.id,
                    trace_id=stream.trace_id,
                    ttft_ms=round((now - stream.accepted_at) * 1000, 3),
                )
            else:
                metrics.inter_chunk.observe(now - stream.last_content_at)
            stream.last_content_at = now
        stream.delivered_seq = events[-1].seq
        stream.tokens_sent += fresh
        metrics.tokens_sent += fresh

    async def _watch_idle(self, scope: anyio.CancelScope) -> None:
        """One timer for two jobs, so an idle stream wakes rarely: mark a ping due after
        `heartbeat_s` without a write (the pump writes it), and cut a reader whose socket has
        taken nothing for `send_timeout_s`. Checked every heartbeat or half send timeout."""
        clock = time.perf_counter
        tick = min(self.heartbeat_s, self.send_timeout_s / 2)
        while True:
            now = clock()
            since = self._sending_since
            if since and now - since > self.send_timeout_s:
                self.stalled = True
                scope.cancel()
                return
            idle = now - self._last_write
            if idle >= self.heartbeat_s and not since:
                self._ping_due = True
                self.stream.log.nudge()
                idle = 0.0
            await asyncio.sleep(min(tick, self.heartbeat_s - idle))

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return
