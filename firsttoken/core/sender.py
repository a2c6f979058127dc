"""The event sender: one reader of a stream's event log, writing to one socket, and the
streaming ASGI response that hands it the connection. It is the reader side of the log (as
`collect.Collector` is for whole answers); `wire/` below it knows only bytes and formats.

The response opens its exchange (`wire.exchange`: the head, and a `Body` that frames and
writes to the connection; the core never sees the server's internals), hands it to an
`EventSender` and waits for one future. From then on the writer is driven by callbacks, never
by a task:

- the log's `deliver` (a new event, inside the engine's step): written at once to the body
  when the reader is caught up and the socket takes bytes;
- the protocol's `pause_writing` / `resume_writing`: a paused reader stops writing and falls
  behind (the stream's window then pauses the engine); on resume it writes what piled up;
- the protocol's `connection_lost`: the reader detaches at once, so an abandoned stream's
  engine stops before its next step;
- the server's shared `Schedule`: heartbeats after `heartbeat_s` without a write, and a cut
  after `send_timeout_s` of a socket that takes nothing.

The last body message goes back through the exchange (`Exchange.end`: ASGI), so the server's
own bookkeeping of the response (keep-alive, completion) stays right.

Writes are system calls, and a short stream made five: the head, the opening event, its
tokens, the closing events, the terminating chunk. The head waits for the opening events
(`EventSender.hold`), and the terminating chunk rides with the closing events (uvicorn's
bookkeeping is then told the response ended, and writes nothing): three.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from enum import Enum

import anyio
import anyio.lowlevel
from starlette.types import Receive, Scope, Send

from firsttoken.core.mirror import Mirror
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.schedule import Schedule, ScheduledCall
from firsttoken.core.stream import SELF_RESUMING, BaseStream, Outcome
from firsttoken.eventlog import Event, ResumeExpired
from firsttoken.formats.errors import error_body
from firsttoken.formats.sse import PING, ServerSentEvent, encode_event, response_headers, stamp
from firsttoken.telemetry.log import log_event
from firsttoken.telemetry.metrics import Metrics, key_label
from firsttoken.wire.compression import StreamCompressor
from firsttoken.wire.exchange import Body, Exchange, open_exchange

__all__ = ["End", "EventSender", "EventStreamResponse"]

# perf_counter, not the loop's clock: uvloop's has 1 ms resolution, too coarse for
# inter-chunk histograms with 0.5 ms buckets.
_clock = time.perf_counter
_REPLAY_BATCH = 256  # events per write while catching up (a resume replay)
# Set-up's writes are held back for one system call (see `EventSender.hold`), but only this
# many bytes of them: past it a long replay goes to the transport, whose high-water mark
# pauses the writer, so a reader that never reads holds that mark plus the kernel's buffer.
_HOLD_MAX_BYTES = 65536
# What a reader that does not resume by itself is told when its stream moves on (`write_moved`).
MOVED_CODE = "stream_moved"
MOVED_MESSAGE = (
    "this server instance let the stream go before its end (it is shutting down, or another "
    "instance took the stream over); retry the request"
)
_MIN_TICK_S = 0.005  # the shortest heartbeat / timeout check interval


class End(Enum):
    FINISHED = "finished"  # the log closed and everything was written
    DISCONNECTED = "disconnected"
    STALLED = "stalled"  # the socket took nothing for send_timeout_s


class EventSender:
    """Sends one stream's events to one connection: a reader of the stream's log."""

    __slots__ = (
        "_call",
        "_paused_since",
        "_stuck_since",
        "_unsent_low",
        "body",
        "compressor",
        "cursor",
        "done",
        "heartbeat_s",
        "last_write",
        "log",
        "metrics",
        "pacer",
        "paused",
        "plain",
        "registry",
        "schedule",
        "send_timeout_s",
        "stream",
        "terminated",
        "throttled",
        "timestamps",
    )

    def __init__(
        self,
        stream: BaseStream,
        registry: StreamRegistry,
        metrics: Metrics,
        body: Body,
        *,
        after: int,
        heartbeat_s: float,
        send_timeout_s: float,
        timestamps: bool,
        compressor: StreamCompressor | None,
    ) -> None:
        self.stream = stream
        self.log = stream.log
        self.registry = registry
        self.metrics = metrics
        self.body = body  # the connection's, framed by wire/ (`wire.exchange`)
        self.schedule: Schedule = registry.schedule
        self.cursor = after
        self.heartbeat_s = heartbeat_s
        self.send_timeout_s = send_timeout_s
        self.timestamps = timestamps  # `: t=<unix time>` before each event, for diagnosis
        self.compressor = compressor
        self.pacer = registry.pacer  # --max-stream-bytes-per-s, or None
        self.throttled = False  # waiting for its turn in the pacer's line
        # Nothing between the event and the socket but the body's framing: the hot path.
        self.plain = compressor is None and not timestamps and self.pacer is None
        self.paused = False
        self.terminated = False  # the terminating chunk went out with the last events
        self._paused_since = 0.0
        self._stuck_since = 0.0  # bytes have waited in the transport, unread, since then
        self._unsent_low = 0
        self.last_write = 0.0
        self.done: asyncio.Future[End] = asyncio.get_running_loop().create_future()
        self._call: ScheduledCall | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def open(self, preamble: bytes) -> None:
        """Attach to the stream and its log, write the preamble and any backlog."""
        stream = self.stream
        if self.log.closed and isinstance(stream, Mirror) and stream.successor is not None:
            # Taken over here since this reader found the mirror: it reads the stream itself.
            self.stream = stream = stream.successor
            self.log = stream.log
        self.registry.attach(stream)
        self.log.attach(self)
        self.last_write = _clock()
        if preamble:
            self._write(preamble)
        self._arm(self.heartbeat_s)
        self.catch_up()

    def move_to(self, stream: BaseStream) -> None:
        """Read `stream` from here on, from this reader's cursor: the stream another
        instance generated, now continued by this one (a takeover)."""
        self.stream = stream
        self.log = stream.log
        self.registry.attach(stream)
        stream.log.attach(self)
        self.catch_up()

    def hold(self, head: bytes) -> None:
        """Keep writes back, after the response head, until `release`: set-up's writes (the
        head, the preamble, the opening events) leave in one system call. A replay longer than
        `_HOLD_MAX_BYTES` is released as it goes (`catch_up`), so the transport's flow
        control bounds it as it bounds every later write."""
        self.body.hold(head)

    def release(self) -> None:
        try:
            self.body.release()  # may pause us, right here
        except RuntimeError:
            self.close(End.DISCONNECTED)

    def close(self, end: End) -> None:
        """Detach (once): the registry may stop an abandoned stream's engine right here."""
        if self.done.done():
            return
        self.done.set_result(end)
        if self.paused:
            self.metrics.readers_paused -= 1
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self.pacer is not None:
            self.pacer.forget(self)
        self.log.detach(self)
        self.registry.detach(self.stream)

    # -- the log's reader (hot path) -------------------------------------------------------

    def deliver(self, seq: int, wire: bytes, tokens: int) -> None:
        if self.paused or seq != self.cursor + 1:
            if not self.paused and seq > self.cursor + 1:
                self.catch_up()
            return  # behind: catch_up() writes it when the socket takes bytes again
        if self.plain:
            body = self.body
            chunk = body.chunk
            try:
                if chunk is not None:  # `body.write(wire)`, inline: once per token
                    body.transport.write(chunk % (len(wire), wire))
                else:
                    body.write(wire)
            except RuntimeError:  # the transport closed under us; connection_lost follows
                self.close(End.DISCONNECTED)
                return
        else:
            data = wire if not self.timestamps else _stamped((Event(seq, wire, tokens),))
            if not self._paced(len(data)):
                return  # behind until its turn: resume_paced() catches up
            self._write(data)
        self.cursor = seq
        stream = self.stream
        now = _clock()
        self.last_write = now
        if seq > stream.delivered_seq:
            stream.delivered_seq = seq
            if tokens:  # first delivery of content (a replay is not counted again)
                if stream.last_content_at:
                    self.metrics.inter_chunk.observe(now - stream.last_content_at)
                stream.last_content_at = now
                stream.tokens_sent += tokens
                self.metrics.tokens_sent += tokens

    def log_closed(self) -> None:
        if not self.paused and self.cursor >= self.log.last_seq:
            self.close(End.FINISHED)

    def _write(self, data: bytes) -> None:
        if self.compressor is not None:
            data = self.compressor.compress(data)
        try:
            self.body.write(data)
        except RuntimeError:  # the transport closed under us; connection_lost is on its way
            self.close(End.DISCONNECTED)

    def write_moved(self) -> None:
        """The stream moved to another instance under a reader that does not resume by itself
        (an SDK's): the format's error event, so that it raises rather than take what it got
        for the whole answer. No `id:`, so a client that does resume still can."""
        events = self.stream.error_events(MOVED_CODE, MOVED_MESSAGE)
        self._write(b"".join(ServerSentEvent(d.decode(), name).encode() for name, d in events))

    def _write_last(self, data: bytes) -> None:
        """The closing events with the end of the body, in one write."""
        try:
            self.body.write_last(data)
            self.terminated = True
        except RuntimeError:
            self.close(End.DISCONNECTED)

    def _account_tokens(self, stream: BaseStream, tokens: int, now: float) -> None:
        """Metrics for a first delivery (a replay to a resuming reader is not new). `deliver`
        does the same inline: it runs once per token."""
        metrics = self.metrics
        if stream.last_content_at:
            metrics.inter_chunk.observe(now - stream.last_content_at)
        stream.last_content_at = now
        stream.tokens_sent += tokens
        metrics.tokens_sent += tokens

    # -- behind: replays and paused sockets ------------------------------------------------

    def catch_up(self) -> None:
        """Write what the reader has not seen, in batches, until caught up or paused."""
        log = self.log
        while not self.paused and not self.throttled and not self.done.done():
            try:
                events = log.after(self.cursor, _REPLAY_BATCH)
            except ResumeExpired as exc:
                self._write(
                    encode_event(
                        log.next_seq,
                        error_body("resume_expired", str(exc), "invalid_request_error"),
                        "error",
                    )
                )
                self.close(End.FINISHED)
                return
            if not events:
                if log.shown_all() and self.cursor >= log.last_seq:
                    self.close(End.FINISHED)
                return
            if self.timestamps:
                data = _stamped(events)
            elif len(events) == 1:
                data = events[0].wire
            else:
                data = b"".join(e.wire for e in events)
            if not self._paced(len(data)):
                return
            if (
                log.closed
                and self.plain
                and self.body.ends_body
                and events[-1].seq == log.last_seq
                and self.stream.outcome is not Outcome.MOVED  # its end is not the answer's
            ):
                self._write_last(data)
            else:
                self._write(data)
            self.cursor = events[-1].seq
            self.last_write = _clock()
            self._account(events)
            if self.body.held() > _HOLD_MAX_BYTES:
                self.release()  # from here the transport's flow control bounds the replay
            log.advanced()

    def _account(self, events: list[Event]) -> None:
        stream = self.stream
        if events[-1].seq <= stream.delivered_seq:
            return
        now = _clock()
        for event in events:
            if event.seq > stream.delivered_seq and event.tokens:
                self._account_tokens(stream, event.tokens, now)
        stream.delivered_seq = events[-1].seq

    # -- pacing (--max-stream-bytes-per-s) -------------------------------------------------

    def _paced(self, size: int) -> bool:
        pacer = self.pacer
        if pacer is None or pacer.take(size):
            return True
        self.throttled = True
        pacer.wait(self)
        return False

    def resume_paced(self) -> None:
        self.throttled = False
        self.catch_up()
        self.log.advanced()

    # -- the connection's callbacks --------------------------------------------------------

    def pause_writing(self) -> None:
        if not self.paused and not self.done.done():
            self.paused = True
            self.metrics.readers_paused += 1
            self._paused_since = _clock()
            self._arm(min(self.send_timeout_s, self.heartbeat_s))

    def resume_writing(self) -> None:
        if self.paused:
            self.paused = False
            self.metrics.readers_paused -= 1
            self.catch_up()
            # Caught up: the producer may be waiting for room.
            self.log.advanced()

    def connection_lost(self) -> None:
        self.close(End.DISCONNECTED)

    # -- heartbeats and the send timeout, from the shared schedule -------------------------

    def _arm(self, delay: float) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = self.schedule.call_later(max(delay, _MIN_TICK_S), self._tick)

    def _tick(self) -> None:
        self._call = None
        if self.done.done():
            return
        now = _clock()
        if self.paused:
            waited = now - self._paused_since
            if waited >= self.send_timeout_s:
                self.close(End.STALLED)
                return
            self._arm(self.send_timeout_s - waited)
            return
        # Not paused, yet bytes wait in the transport: a reader that stopped reading below
        # the high-water mark (a live stream's window keeps it there) is as stalled as a
        # paused one, once they have not gone down for a send timeout.
        unsent = self.body.unsent()
        if not unsent:
            self._stuck_since = 0.0
        elif not self._stuck_since or unsent < self._unsent_low:
            self._stuck_since, self._unsent_low = now, unsent
        elif now - self._stuck_since >= self.send_timeout_s:
            self.close(End.STALLED)
            return
        idle = now - self.last_write
        if idle >= self.heartbeat_s:
            self._write(PING)
            self.last_write = now
            idle = 0.0
        delay = self.heartbeat_s - idle
        self._arm(min(delay, self.send_timeout_s) if unsent else delay)


_SENT: list[tuple[bytes, bytes]] = []  # a sent response's headers: shared, never changed


class EventStreamResponse:
    # One per waiting stream, for its whole life: slots, not a dict of 11 fields (~0.2 KiB).
    __slots__ = (
        "after",
        "compressor",
        "headers",
        "heartbeat_s",
        "metrics",
        "preamble",
        "registry",
        "send_timeout_s",
        "start",
        "stream",
        "timestamps",
    )

    def __init__(
        self,
        stream: BaseStream,
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
        self.headers = response_headers(stream.id, stream.trace_id, headers)
        self.start = start  # this reader starts the stream (OpenAI path: one request, one answer)
        self.send_timeout_s = send_timeout_s
        self.timestamps = timestamps
        self.compressor = compressor
        if compressor is not None:
            self.headers += [
                (b"content-encoding", compressor.encoding.encode()),
                (b"vary", b"accept-encoding"),
            ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = await open_exchange(scope, receive, send, self.headers)
        self.headers = _SENT  # sent: a waiting stream need not keep them (nor a list of its own)
        body = exchange.body
        writer = self._writer(body)
        # `async with`, spelled out: it would keep a bound `__aexit__` (64 bytes) in every
        # waiting stream's frame.
        attached = exchange.attached(writer)
        try:
            await attached.__aenter__()
            try:
                try:
                    if body.is_closing():
                        writer.close(End.DISCONNECTED)
                    else:
                        try:
                            await self._run(writer)
                        finally:
                            writer.release()
                    end = await writer.done
                finally:
                    writer.close(End.DISCONNECTED)  # no-op unless cancelled (server shutdown)
            except BaseException as exc:
                if not await attached.__aexit__(type(exc), exc, exc.__traceback__):
                    raise
            else:
                await attached.__aexit__(None, None, None)
        finally:
            if self.start:  # never started: give back its ticket
                self.registry.discard(self.stream)  # type: ignore[arg-type]  # `_run`'s
        await self._finish(end, writer, exchange)

    def _writer(self, body: Body) -> EventSender:
        return EventSender(
            self.stream,
            self.registry,
            self.metrics,
            body,
            after=self.after,
            heartbeat_s=self.heartbeat_s,
            send_timeout_s=self.send_timeout_s,
            timestamps=self.timestamps,
            compressor=self.compressor,
        )

    async def _run(self, writer: EventSender) -> None:
        # Attached before the stream starts, so it never runs without a reader.
        writer.open(self.preamble)
        if self.start:
            # The pipeline's new stream, generated here (a mirror is only ever read): typed
            # `BaseStream` for the responses that read one, not cast (a call a stream).
            await self.registry.start(self.stream)  # type: ignore[arg-type]
            # The engine has its request, and the first token is a TTFT away: let what is ready
            # run before this stream's first write (other new streams up to their engines, a
            # relay's upstream request), so a burst's streams start one set-up apart, not two.
            await asyncio.sleep(0)

    async def _finish(self, end: End, writer: EventSender, exchange: Exchange) -> None:
        if end is End.FINISHED:
            stream = writer.stream
            if stream.outcome is Outcome.MOVED and stream.format not in SELF_RESUMING:
                writer.write_moved()
            tail = self.compressor.finish() if self.compressor is not None else b""
            if await exchange.end(tail, self.send_timeout_s, writer.terminated):
                if writer.stream.outcome is Outcome.MOVED:
                    # Another instance goes on with it: the reader comes back with
                    # Last-Event-ID on a new connection, not this one (this instance may
                    # be on its way out).
                    writer.body.close()
                    return
                if writer.body.unsent():  # else no closure to build: most streams
                    cut = self._stalled_after(exchange)
                    _cut_if_unread(writer.body, self.registry.schedule, self.send_timeout_s, cut)
                return
        elif end is not End.STALLED:
            return
        # The reader takes no bytes: a graceful close would wait on it forever.
        self._stalled_after(exchange)()
        await anyio.lowlevel.checkpoint()  # let the server see the connection go

    def _stalled_after(self, exchange: Exchange) -> Callable[[], None]:
        """What cuts this response's reader for taking no bytes for `send_timeout_s`: reset
        the connection (a graceful close would wait for it to read, forever), log, count."""
        stream, metrics, timeout = self.stream, self.metrics, self.send_timeout_s

        def cut() -> None:
            metrics.readers_stalled += 1
            log_event(
                "stream.reader_stalled",
                stream=stream.id,
                trace_id=stream.trace_id,
                key=key_label(stream.request.tenant),
                send_timeout_s=timeout,
            )
            exchange.abort()

        return cut


def _cut_if_unread(
    body: Body, schedule: Schedule, timeout_s: float, cut: Callable[[], None]
) -> None:
    """After the response's last byte was handed over: if the transport still holds bytes the
    reader has not taken, cut it once `timeout_s` passes without progress. The transport is
    under its high-water mark, so nothing else waits on it, and uvicorn's keep-alive close
    would wait for those bytes to leave, forever."""
    left = body.unsent()
    if not left:
        return

    def check() -> None:
        nonlocal left
        now = body.unsent()
        if not now:
            return
        if now < left:  # a slow reader, not a stalled one
            left = now
            schedule.call_later(timeout_s, check)
            return
        cut()

    schedule.call_later(timeout_s, check)


def _stamped(events: Sequence[Event]) -> bytes:
    sent = stamp(time.time())
    return b"".join(sent + e.wire for e in events)
