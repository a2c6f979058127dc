"""The event-stream writer on a fake clock and a fake transport: what reaches the socket."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from firsttoken.core import sender as writer_module
from firsttoken.core.mirror import Mirror
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.schedule import Schedule
from firsttoken.core.sender import End, EventSender
from firsttoken.core.stream import BaseStream, Outcome, Renderer, Stream
from firsttoken.engines import GenerationRequest, SyntheticEngine
from firsttoken.formats.render import ChatRenderer, NativeRenderer
from firsttoken.formats.sse import EventDecoder
from firsttoken.resume import StreamRecord
from firsttoken.telemetry.metrics import Metrics
from firsttoken.wire.exchange import ChunkedBody
from tests.unit.clock import FakeClock


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


def setup(
    monkeypatch: pytest.MonkeyPatch,
    *,
    grace_s: float = 0.0,
    window: int = 4,
    renderer: Renderer | None = None,
    format: str = "native",
) -> tuple[FakeClock, Stream, StreamRegistry, Transport, EventSender]:
    clock = FakeClock()
    monkeypatch.setattr(writer_module, "_clock", clock)
    registry = StreamRegistry(SyntheticEngine(), Metrics(), ttl_s=10)
    registry.schedule = Schedule(clock=clock, call_at=clock.call_at)
    stream = Stream(
        GenerationRequest(request_id="s1", prompt="hi", model="synthetic"),
        renderer or NativeRenderer(),
        format=format,
        trace_id="t",
        grace_s=grace_s,
        prompt_tokens=1,
        max_events=100,
        accepted_at=clock.now,
        window=window,
    )
    transport = Transport()
    return clock, stream, registry, transport, sender(stream, registry, transport)


def sender(stream: BaseStream, registry: StreamRegistry, transport: Transport) -> EventSender:
    return EventSender(
        stream,
        registry,
        registry.metrics,
        ChunkedBody(transport),
        after=0,
        heartbeat_s=5.0,
        send_timeout_s=30.0,
        timestamps=False,
        compressor=None,
    )


def body_of(writes: list[bytes]) -> bytes:
    """Undo the HTTP chunk framing (a write may end with the terminating chunk)."""
    out = b""
    for w in writes:
        w = w.removesuffix(b"0\r\n\r\n") if w.endswith(b"\n\r\n0\r\n\r\n") else w
        size, _, rest = w.partition(b"\r\n")
        assert int(size, 16) == len(rest) - 2 and rest.endswith(b"\r\n")
        out += rest[:-2]
    return out


def test_a_caught_up_writer_writes_each_token_as_it_is_pushed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body() -> None:
        _, stream, _, transport, writer = setup(monkeypatch)
        writer.open(b"retry: 1000\n\n")
        stream.begin()
        stream.push("Hello")
        stream.push(" world")
        assert body_of(transport.writes) == (
            b'retry: 1000\n\nid: 1\ndata: {"token":"Hello"}\n\nid: 2\ndata: {"token":" world"}\n\n'
        )
        assert len(transport.writes) == 3  # one write per token
        stream.push("!", "stop")  # the last token, the closing events, the last chunk: one write
        assert len(transport.writes) == 4
        assert body_of(transport.writes[-1:]).endswith(b"data: [DONE]\n\n")
        assert transport.writes[-1].endswith(b"\r\n0\r\n\r\n") and writer.terminated
        assert writer.done.result() is End.FINISHED

    run(body)


def test_a_reader_of_a_mirror_taken_over_before_it_opened_reads_the_stream_continued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its connection was opening while this instance took the stream over (`Takeovers`):
    it reads the stream continued here from its cursor to [DONE], never the mirror's
    closed log (which had nothing more for it: it waited for ever)."""

    async def body() -> None:
        _, stream, registry, transport, _ = setup(monkeypatch)
        mirror = Mirror(StreamRecord("s1", "native", "d", "t", "synthetic"), max_events=100)
        mirror.successor = stream
        mirror.log.close()
        writer = sender(mirror, registry, transport)
        writer.open(b"")
        assert writer.stream is stream and stream.readers == 1 and mirror.readers == 0
        stream.begin()
        stream.push("Hello", "stop")
        assert body_of(transport.writes).endswith(b"data: [DONE]\n\n")
        assert writer.done.result() is End.FINISHED

    run(body)


def test_set_up_writes_leave_with_the_held_head_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body() -> None:
        _, stream, _, transport, writer = setup(monkeypatch)
        writer.hold(b"HTTP/1.1 200 OK\r\n\r\n")
        writer.open(b"retry: 1000\n\n")
        stream.begin()
        stream.push("Hello")
        assert transport.writes == []
        writer.release()
        assert len(transport.writes) == 1
        head, _, rest = transport.writes[0].partition(b"\r\n\r\n")
        assert head == b"HTTP/1.1 200 OK"
        assert body_of(_chunks(rest)) == (b'retry: 1000\n\nid: 1\ndata: {"token":"Hello"}\n\n')
        stream.push(" world")  # released: straight to the socket again
        assert len(transport.writes) == 2

    run(body)


def _chunks(data: bytes) -> list[bytes]:
    """Split concatenated HTTP chunks back into one write each."""
    out = []
    while data:
        size = data.partition(b"\r\n")[0]
        end = len(size) + 2 + int(size, 16) + 2
        out.append(data[:end])
        data = data[end:]
    return out


def test_a_paused_socket_falls_behind_and_catches_up_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body() -> None:
        _, stream, _, transport, writer = setup(monkeypatch, window=3)
        writer.open(b"")
        stream.begin()
        writer.pause_writing()
        assert stream.push("a") and stream.push("b")
        assert not stream.push("c")  # three behind: the engine is told to pause
        assert transport.writes == []
        writer.resume_writing()
        assert body_of(transport.writes).count(b"id: ") == 3 and len(transport.writes) == 1

    run(body)


def test_heartbeat_after_idle_and_cut_after_send_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body() -> None:
        clock, stream, _, transport, writer = setup(monkeypatch)
        writer.open(b"")
        clock.advance(4.9)
        assert transport.writes == []
        clock.advance(0.2)
        assert body_of(transport.writes) == b": ping\n\n"
        writer.pause_writing()
        clock.advance(29.0)
        assert not writer.done.done()
        clock.advance(2.0)
        assert writer.done.result() is End.STALLED
        assert stream.outcome is Outcome.DISCONNECTED  # grace 0: its engine stopped

    run(body)


def test_a_lost_connection_stops_a_stream_without_grace_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body() -> None:
        _, stream, _registry, _, writer = setup(monkeypatch)
        writer.open(b"")
        stream.begin()
        stream.push("a")
        writer.connection_lost()
        assert writer.done.result() is End.DISCONNECTED
        assert stream.outcome is Outcome.DISCONNECTED
        assert not stream.push("b")  # generation is over: nothing more is taken

    run(body)


def test_a_replay_is_not_counted_as_sent_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        _, stream, registry, _transport, writer = setup(monkeypatch, grace_s=10)
        writer.open(b"")
        stream.begin()
        for t in "abc":
            stream.push(t)
        writer.close(End.DISCONNECTED)
        again = EventSender(
            stream,
            registry,
            registry.metrics,
            ChunkedBody(Transport()),
            after=1,
            heartbeat_s=5,
            send_timeout_s=30,
            timestamps=False,
            compressor=None,
        )
        again.open(b"")
        assert body_of(again.body.real.writes).count(b"id: ") == 2
        assert stream.tokens_sent == 3 and registry.metrics.tokens_sent == 3

    run(body)


class _Unread(Transport):
    """A transport whose reader stopped: `unsent` bytes wait in it, never taken."""

    def __init__(self) -> None:
        super().__init__()
        self.unsent = 0

    def get_write_buffer_size(self) -> int:
        return self.unsent


def test_a_reader_stuck_below_the_high_water_mark_is_cut_after_the_send_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never paused (a live stream's window holds it under the mark), yet taking nothing."""

    async def body() -> None:
        clock, stream, _, _, writer = setup(monkeypatch)
        transport = _Unread()
        writer.body = ChunkedBody(transport)
        writer.open(b"")
        stream.begin()
        stream.push("Hello")
        transport.unsent = 5000
        clock.advance(5.0)  # the first check: bytes wait, the clock starts
        assert not writer.done.done()
        transport.unsent = 4000  # the reader took some: progress, the clock starts again
        clock.advance(29.0)
        assert not writer.done.done()
        clock.advance(31.0)  # nothing taken for the send timeout
        assert writer.done.result() is End.STALLED
        assert not writer.paused

    run(body)


def test_a_long_replay_is_released_to_the_transport_past_the_hold_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replay used to go whole into the held set-up write, where flow control never saw it."""

    async def body() -> None:
        _, stream, _, transport, writer = setup(monkeypatch)
        stream.log.capacity = stream.log.window = 5000
        stream.begin()
        for _ in range(3000):
            stream.push("x" * 50)
        writer.hold(b"HTTP/1.1 200 OK\r\n\r\n")
        writer.open(b"")
        assert transport.writes  # released mid-replay, not held to the end
        writer.release()
        assert sum(map(len, transport.writes)) > 3000 * 50

    run(body)


def test_a_started_stream_lets_its_engine_run_before_its_first_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relay's upstream request leaves before the client's head and opening events (and in
    a burst, the other new streams reach their engines first): the first token is a TTFT
    away, the head is not what the client waits for."""
    import anyio

    from firsttoken.core.sender import EventStreamResponse
    from firsttoken.delta import Delta
    from firsttoken.generation import BaseEngine

    order: list[str] = []

    class Upstream(BaseEngine):  # an iterator engine: the registry pulls it from a task
        models = ("synthetic",)
        tokens_generated = 0

        def generate(self, request: GenerationRequest) -> Any:
            return self._deltas()

        async def _deltas(self) -> Any:
            order.append("upstream request")
            yield Delta("hi", "stop")

        async def abort(self, request_id: str) -> None:
            pass

    class Recording(Transport):
        def write(self, data: bytes) -> None:
            order.append("first write" if not self.writes else "write")
            super().write(data)

    async def body() -> None:
        _, stream, _, _, _ = setup(monkeypatch)
        registry = StreamRegistry(Upstream(), Metrics(), ttl_s=10)  # type: ignore[arg-type]
        response = EventStreamResponse(stream, registry, registry.metrics, start=True)
        transport = Recording()
        writer = response._writer(ChunkedBody(transport))
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            writer.hold(b"HTTP/1.1 200 OK\r\n\r\n")
            await response._run(writer)
            writer.release()
            await writer.done
            tg.cancel_scope.cancel()

    run(body)
    assert order[:2] == ["upstream request", "first write"]


def test_a_durable_stream_reaches_its_reader_as_the_store_confirms_it_to_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--durable: events wait for the store; a stream that ended before the store confirmed
    its last events still writes them all (it ended short here once: 14 of 20 tokens)."""

    async def body() -> None:
        _, stream, _, transport, writer = setup(monkeypatch)
        stream.log.hold(0)
        writer.open(b"")
        stream.begin()
        stream.push("a")
        stream.push("b")
        assert transport.writes == []
        stream.log.hold(1)
        assert body_of(transport.writes) == b'id: 1\ndata: {"token":"a"}\n\n'
        stream.push("c", "stop")  # ended: the last events are not confirmed yet
        assert not writer.done.done()
        stream.log.hold(stream.log.last_seq)
        assert body_of(transport.writes).endswith(b"data: [DONE]\n\n")
        assert b'"token":"c"' in body_of(transport.writes)
        assert writer.done.result() is End.FINISHED

    run(body)


def test_a_moved_stream_ends_an_sdk_reader_with_its_formats_error_never_clean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An SDK takes a clean end for the whole answer: a chat stream that moves to another
    instance under its reader leaves it the format's error event, without an `id:` (a client
    that resumes still can), and never the body's end before it."""

    async def body() -> None:
        chat = ChatRenderer("chatcmpl-s1", "synthetic", 0, False)
        _, stream, _, transport, writer = setup(monkeypatch, renderer=chat, format="openai")
        writer.open(b"")
        stream.begin()
        writer.pause_writing()  # behind when the stream moves: catch_up writes its end
        stream.push("Hello")
        stream.move()
        writer.resume_writing()
        assert writer.done.result() is End.FINISHED and not writer.terminated
        writer.write_moved()
        events = EventDecoder().feed(body_of(transport.writes))
        assert [e.event for e in events] == [None, None, "error"]
        assert "stream_moved" in (events[-1].data or "") and events[-1].id == events[-2].id
        assert b"[DONE]" not in body_of(transport.writes)

    run(body)


def test_a_moved_native_stream_ends_without_an_event_for_its_reader_to_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def body() -> None:
        _, stream, _, transport, writer = setup(monkeypatch)
        writer.open(b"")
        stream.begin()
        writer.pause_writing()
        stream.push("Hello")
        stream.move()
        writer.resume_writing()
        assert writer.done.result() is End.FINISHED and not writer.terminated
        events = EventDecoder().feed(body_of(transport.writes))
        assert [e.data for e in events] == ['{"token":"Hello"}']

    run(body)
