"""Takeovers (`core/takeovers.py`): a stream whose owner is gone is continued here and its
readers read it from where they were; one taken from this instance is let go; each owner
bills its part."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

import anyio
import pytest

from firsttoken.core.mirror import Mirror
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.stream import Outcome, Stream, Usage
from firsttoken.generation import GenerationRequest
from firsttoken.resume import Claim, EventLog, Orphan, Resumed, StreamRecord
from firsttoken.telemetry.metrics import Metrics
from tests.unit.test_registry import _Recording, _Store, _stream, _Ticket


class _Reader:
    """A connection's writer, as far as the registry sees it."""

    def __init__(self, log: EventLog, registry: StreamRegistry, stream: Stream) -> None:
        self.cursor = log.last_seq
        self.log = log
        self.stream = stream
        registry.attach(stream)
        log.attach(self)

    def deliver(self, seq: int, wire: bytes, tokens: int) -> None:
        self.cursor = seq

    def log_closed(self) -> None:
        pass

    def catch_up(self) -> None:
        for event in self.log.after(self.cursor):
            self.cursor = event.seq

    def move_to(self, stream: Stream) -> None:
        self.stream, self.log = stream, stream.log
        stream.readers += 1
        stream.log.attach(self)
        self.catch_up()


class _Claims(_Store):
    """A store whose claims answer as told; what is adopted and let go is written down."""

    instance = "b"

    def __init__(self, answer: Claim | str) -> None:
        super().__init__()
        self.answer = answer
        self.adopted: list[tuple[str, int, int]] = []
        self.let_go_of: list[tuple[str, bool]] = []
        self.handed_over: list[str] = []
        self.billed: list[bytes] = []
        self.fenced: set[str] = set()  # taken over already: not replicated here any more

    async def claim(self, stream_id: str, owner: str, after: int) -> Claim | str:
        return self.answer

    def adopt(self, record: StreamRecord, ttl_s: float, log: EventLog, fence: int) -> None:
        self.adopted.append((record.id, log.last_seq, fence))

    def let_go(self, stream_id: str, *, flush: bool, billed: bytes = b"") -> bool:
        self.let_go_of.append((stream_id, flush))
        self.billed.append(billed)
        return stream_id not in self.fenced

    async def hand_over(self, stream_ids: Collection[str]) -> None:
        self.handed_over += stream_ids


def _mirror(after: int) -> Mirror:
    mirror = Mirror(StreamRecord("s1", "native", "d", "t", "synthetic"), max_events=100)
    mirror.log.begin_at(after)
    return mirror


async def _reopen(claim: Claim, mirror: Mirror) -> tuple[Stream, GenerationRequest | None, int]:
    stream = _stream(mirror.id)
    for _, wire, tokens in claim.events:
        stream.log.append(wire, tokens)
    stream.ticket = _Ticket()
    following = GenerationRequest(request_id="s1", prompt="hi", model="synthetic", max_tokens=7)
    return stream, following, 3


def _claim() -> Claim:
    wires = [b'id: %d\ndata: {"token":"t%d"}\n\n' % (i, i) for i in range(1, 4)]
    return Claim(2, "a", b"{}", [(i + 1, w, 1) for i, w in enumerate(wires)])


def test_a_claimed_stream_goes_on_here_and_its_reader_reads_it_from_where_it_was() -> None:
    async def body() -> None:
        engine, store, metrics = _Recording(), _Claims(_claim()), Metrics()
        registry = StreamRegistry(engine, metrics, ttl_s=10, store=store)  # type: ignore[arg-type]
        registry.reopen = _reopen
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            mirror = _mirror(after=2)
            reader = _Reader(mirror.log, registry, mirror)
            assert await registry.takeovers.take_over(mirror, Orphan("a"))
            local = await registry.find("s1")
            assert local is not None and local is not mirror and reader.stream is local
            assert mirror.readers == 0 and local.readers == 1
            # The events Redis held, then the takeover's news for native readers.
            assert reader.cursor == 4 and store.adopted == [("s1", 3, 2)]
            meta = local.log.after(3)[0].wire
            assert b"event: meta" in meta
            assert b'"takeover":{"from":"a","to":"b","at_token":3}' in meta
            assert [r.max_tokens for r in engine.opened] == [7]
            assert metrics.takeovers == {"continued": 1, "lost": 0, "refused": 0}
            assert metrics.active_streams == 1
            tg.cancel_scope.cancel()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("answer", "handled", "outcome"),
    [("moved", False, None), ("ended", False, None), ("gone", False, None),
     ("lost", True, "lost"), ("refused", True, "refused")],
)  # fmt: skip
def test_a_claim_that_fails_follows_the_stream_again_or_tells_its_reader(
    answer: str, handled: bool, outcome: str | None
) -> None:
    async def body() -> None:
        metrics = Metrics()
        registry = StreamRegistry(_Recording(), metrics, ttl_s=10, store=_Claims(answer))  # type: ignore[arg-type]
        registry.reopen = _reopen
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            mirror = _mirror(after=2)
            assert await registry.takeovers.take_over(mirror, Orphan("a")) is handled
            assert await registry.find("s1") is None  # nothing continued here
            if outcome is not None:
                assert metrics.takeovers[outcome] == 1 and mirror.log.closed
                assert b"stream_lost" in mirror.log.after(2)[0].wire
            else:
                assert not mirror.log.closed
            tg.cancel_scope.cancel()

    asyncio.run(body())


def test_a_fenced_stream_stops_here_and_releases_what_it_held() -> None:
    async def body() -> None:
        store, metrics = _Claims("moved"), Metrics()
        registry = StreamRegistry(_Recording(), metrics, ttl_s=10, store=store)  # type: ignore[arg-type]
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            taken, kept = _stream("s1"), _stream("s2")
            taken.movable = kept.movable = True
            for stream in (taken, kept):
                stream.ticket = _Ticket()
                await registry.start(stream)
            store.on_fenced("s1", taken.log.last_seq, False)
            assert taken.outcome is Outcome.MOVED and taken.generation is None
            assert await registry.find("s1") is None  # a reader back here follows the store
            assert store.let_go_of == [("s1", True)] and store.finished == []
            await taken.ticket.released.wait()  # type: ignore[union-attr]
            assert taken.ticket.releases == [Outcome.MOVED]  # type: ignore[union-attr]
            assert metrics.active_streams == 1 and metrics.streams_moved == 1
            assert sum(metrics.streams.values()) == 0  # not an end of the answer
            # A shutdown hands over every stream another instance can continue.
            plain = _stream("s3")
            plain.ticket = _Ticket()
            await registry.start(plain)
            assert await registry.hand_over() == 1 and kept.outcome is Outcome.MOVED
            assert plain.outcome is None
            assert store.handed_over == ["s2"]  # its liveness goes once Redis has them
            tg.cancel_scope.cancel()

    asyncio.run(body())


def test_each_owner_of_a_stream_bills_what_the_owners_before_did_not() -> None:
    """Handed over, an owner bills its part and leaves the answer's billed total with its last
    events; the next bills beyond it, all of it after a SIGKILL (nothing left); fenced, it
    bills nothing (its new owner read no total from it and bills all the store holds)."""

    async def body() -> None:
        store, metrics = _Claims("moved"), Metrics()
        registry = StreamRegistry(_Recording(), metrics, ttl_s=10, store=store)  # type: ignore[arg-type]
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)

            async def owned(stream_id: str, carried: int, billed: Usage | None) -> Stream:
                stream = _stream(stream_id)
                stream.movable = True
                stream.ticket = _Ticket()
                await registry.start(stream)
                for i in range(carried + 2):  # `carried` from before, two made here
                    stream.push(f"t{i}")
                if billed is not None:  # taken over: what came before, what of it was billed
                    stream.carried = Usage(1, carried, 0)
                    stream.billed_before = billed
                return stream

            first = await owned("a", 0, None)
            second = await owned("b", 2, Usage(1, 2, 0))  # the owner before handed it over
            killed = await owned("c", 2, Usage())  # the owner before was SIGKILLed
            fenced = await owned("d", 2, Usage())
            store.fenced.add("d")
            assert await registry.hand_over() == 4
            tickets = [s.ticket for s in (first, second, killed, fenced)]
            for ticket in tickets:
                await ticket.released.wait()  # type: ignore[union-attr]
            usages = [t.usages for t in tickets]  # type: ignore[union-attr]
            assert usages == [[Usage(1, 2, 0)], [Usage(0, 2, 0)], [Usage(1, 4, 0)], [None]]
            assert store.billed == [b"1 2 0", b"1 4 0", b"1 4 0", b"1 4 0"]
            tg.cancel_scope.cancel()

    asyncio.run(body())


def test_two_readers_here_of_one_orphan_read_the_one_stream_continued_here() -> None:
    """Both claim: the first wins and continues it; the second finds the owner changed to
    this instance, and its reader reads the local stream, not Redis."""

    async def body() -> None:
        store = _Claims(_claim())
        registry = StreamRegistry(_Recording(), Metrics(), ttl_s=10, store=store)  # type: ignore[arg-type]
        registry.reopen = _reopen
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            first, second = _mirror(after=2), _mirror(after=1)
            r1 = _Reader(first.log, registry, first)
            r2 = _Reader(second.log, registry, second)
            assert await registry.takeovers.take_over(first, Orphan("a"))
            store.answer = "moved"
            assert await registry.takeovers.take_over(second, Orphan("a"))
            local = await registry.find("s1")
            assert r1.stream is local and r2.stream is local and local.readers == 2
            assert len(store.adopted) == 1
            tg.cancel_scope.cancel()

    asyncio.run(body())


def test_a_mirror_taken_over_before_its_reader_attached_sends_that_reader_on() -> None:
    """The reader found the mirror, and its connection was still opening when the owner
    was found gone and the stream continued here: the mirror's log closes (its waiter wakes)
    and names the stream continued, which `EventSender.open` reads instead. Before, nothing
    ever reached that reader: its mirror's tail had stopped, its log stayed open."""

    async def body() -> None:
        registry = StreamRegistry(_Recording(), Metrics(), ttl_s=10, store=_Claims(_claim()))  # type: ignore[arg-type]
        registry.reopen = _reopen
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            mirror = _mirror(after=0)
            assert await registry.takeovers.take_over(mirror, Orphan("a"))
            local = await registry.find("s1")
            assert local is not None and mirror.successor is local
            assert mirror.log.closed and not mirror.ended_there  # cut here, not its end
            tg.cancel_scope.cancel()

    asyncio.run(body())


class _Closing(_Reader):
    """A reader that writes down that its connection ended (the log closed under it)."""

    ended = False

    def log_closed(self) -> None:
        if self.cursor >= self.log.last_seq:
            self.ended = True

    def catch_up(self) -> None:
        super().catch_up()
        if self.log.shown_all():
            self.log_closed()


def test_a_fenced_streams_durable_readers_end_at_the_stores_last_event_of_it() -> None:
    """--durable: its readers were shown what Redis confirmed (3 events); the owner made
    more, which Redis refused (fenced). They end there, with nothing of what it made after,
    and follow the instance that took it over."""

    async def body() -> None:
        store = _Claims("moved")
        registry = StreamRegistry(_Recording(), Metrics(), ttl_s=10, store=store)  # type: ignore[arg-type]
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            stream = _stream("s1")
            stream.movable = True
            stream.ticket = _Ticket()
            await registry.start(stream)
            for token in ("a", "b", "c", "d"):
                stream.push(token)
            stream.log.hold(3)
            reader = _Closing(stream.log, registry, stream)
            reader.cursor = 0
            reader.catch_up()
            assert reader.cursor == 3 and not reader.ended
            store.on_fenced("s1", 3, False)
            assert stream.outcome is Outcome.MOVED and stream.log.last_seq == 3
            assert reader.ended and reader.cursor == 3
            tg.cancel_scope.cancel()

    asyncio.run(body())


def test_a_stream_fenced_after_it_finished_here_lets_its_waiting_readers_go() -> None:
    """It finished here, but Redis refused its last events: the other instance has its
    end. Its readers waiting for those events end, and a reader back here follows the
    store's stream, not this instance's."""

    async def body() -> None:
        store = _Claims("moved")
        registry = StreamRegistry(_Recording(), Metrics(), ttl_s=10, store=store)  # type: ignore[arg-type]
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            stream = _stream("s1")
            stream.ticket = _Ticket()
            await registry.start(stream)
            stream.push("a")
            stream.log.hold(2)
            stream.finish("stop")
            reader = _Closing(stream.log, registry, stream)
            reader.cursor = 0
            reader.catch_up()
            assert not reader.ended
            store.on_fenced("s1", 2, False)
            assert reader.ended and await registry.find("s1") is None
            assert stream.outcome is Outcome.MOVED  # an SDK's reader gets the format's error
            tg.cancel_scope.cancel()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("seq", "event_id", "lost"),
    [(3, 3, False), (5, 5, True), (5, 2 * 10**12 + 5, False), (4, 4, True)],
)
def test_a_reader_back_with_an_event_the_store_lacked_is_not_handed_the_new_owners(
    seq: int, event_id: int, lost: bool
) -> None:
    """Another reader here continued the stream from events 1-3 (what Redis held) as owner
    2; this one came back on this instance with the id of its last event, which the store
    did not have yet: handed the stream continued here only if that event is there (or will
    be) with that id; A's events 4 and 5 never were (B made its own 4 and 5)."""

    async def body() -> None:
        store = _Claims(_claim())
        registry = StreamRegistry(_Recording(), Metrics(), ttl_s=10, store=store)  # type: ignore[arg-type]
        registry.reopen = _reopen
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            first = _mirror(after=2)
            _Reader(first.log, registry, first)
            assert await registry.takeovers.take_over(first, Orphan("a"))
            second = _mirror(after=seq)
            second.resumed = Resumed(seq, event_id)
            reader = _Reader(second.log, registry, second)
            store.answer = "moved"
            assert await registry.takeovers.take_over(second, Orphan("a"))
            local = await registry.find("s1")
            assert (reader.stream is local) is not lost
            if lost:
                assert second.log.closed
                assert b"stream_lost" in second.log.after(seq)[0].wire
            tg.cancel_scope.cancel()

    asyncio.run(body())
