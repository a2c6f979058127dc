"""The registry: a stream whose engine fails to open releases everything, once; a stream
whose owner is gone is taken over, and one taken from this instance is let go."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection

import anyio
import anyio.lowlevel
import pytest

from firsttoken.config import Settings
from firsttoken.core.mirror import Mirror
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.stream import Outcome, Stream, Usage
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.engines.cache import CachedEngine
from firsttoken.generation import BaseEngine, Delta, Engine, Generation, Sink, StepEngine
from firsttoken.resume import (
    Claim,
    EventLog,
    MemoryStore,
    Orphan,
    Resumed,
    ResumeExpired,
    StreamRecord,
)
from firsttoken.resume.budget import ResumeBudget
from firsttoken.telemetry.metrics import Metrics
from firsttoken.wire.render import NativeRenderer
from tests.unit.clock import FakeClock


class _Ticket:
    def __init__(self) -> None:
        self.releases: list[Outcome] = []
        self.usages: list[object] = []
        self.client_fault = False
        self.released = anyio.Event()

    def first_token(self, ttft_s: float) -> None:
        pass

    def seam(self, meta: object) -> None:
        pass

    def prompt_read(self) -> None:
        pass

    async def release(self, outcome: Outcome, tokens: object = 0, **_: object) -> None:
        self.releases.append(outcome)
        self.usages.append(tokens)
        self.released.set()


class _Store(MemoryStore):
    """A store that replicates (as Redis does): streams opened and ended are written down."""

    replicates = True

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.finished: list[tuple[str, str]] = []

    def open(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        self.opened.append(record.id)

    def finish(self, stream_id: str, outcome: str, last_seq: int, ttl_s: float) -> None:
        self.finished.append((stream_id, outcome))


class _FailingSteps(BaseEngine):
    """A step engine whose `open` raises `error`."""

    models = ("synthetic",)
    tokens_generated = 0

    def __init__(self, error: Exception) -> None:
        self.error = error

    def open(self, request: GenerationRequest, sink: Sink) -> Generation:
        raise self.error

    def as_step_engine(self) -> StepEngine:
        return self  # type: ignore[return-value]  # a test's partial engine

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        from firsttoken.engines.steps import pull

        return pull(self, request)  # type: ignore[arg-type]

    async def abort(self, request_id: str) -> None:
        return None

    def prompt_tokens(self, prompt: str) -> int:
        return 1

    def counters(self) -> dict[str, int]:
        return {}


class _FailingPull(BaseEngine):
    """An iterator engine whose first pull raises (a relay that cannot connect)."""

    models = ("synthetic",)
    tokens_generated = 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        raise EngineError("upstream_unavailable", "no upstream answered")
        yield Delta("never")  # pragma: no cover

    async def abort(self, request_id: str) -> None:
        return None


def _relay() -> Engine:
    from firsttoken.engines.relay import RelayEngine

    # Port 9 on loopback refuses: its first pull cannot connect (started in the test).
    return RelayEngine("http://127.0.0.1:9/v1", connect_timeout_s=2)  # type: ignore[return-value]


def _llamacpp() -> Engine:
    # No skip: ./scripts/test installs llama-cpp-python and the model, and CI must fail
    # without them.
    from firsttoken.engines.llamacpp import LlamaCppEngine

    # Never started: its first pull finds no worker.
    return LlamaCppEngine(Settings(engine="llamacpp"))  # type: ignore[return-value]


def _cache() -> Engine:
    inner = _FailingSteps(ValueError("boom"))
    return CachedEngine(inner, Settings(cache_ttl_s=60))  # type: ignore[arg-type, return-value]


ENGINES: dict[str, Callable[[], Engine]] = {
    "step open raises EngineError": lambda: _FailingSteps(EngineError("bad", "bad")),  # type: ignore[dict-item]
    "step open raises a bug": lambda: _FailingSteps(RecursionError("nested too deep")),  # type: ignore[dict-item]
    "iterator first pull": lambda: _FailingPull(),  # type: ignore[dict-item]
    "relay first pull": _relay,
    "llama.cpp first pull": _llamacpp,
    "cache over a failing step engine": _cache,
}


def _stream(stream_id: str = "s1") -> Stream:
    return Stream(
        GenerationRequest(
            request_id=stream_id,
            prompt="hi",
            model="synthetic",
            max_tokens=10,
            seed=1,
            temperature=0,
        ),
        NativeRenderer(),
        kind="native",
        trace_id="t",
        grace_s=10.0,
        prompt_tokens=1,
        max_events=100,
        accepted_at=0.0,
    )


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_an_engine_that_fails_to_open_releases_everything_once(kind: str) -> None:
    engine = ENGINES[kind]()

    async def body() -> None:
        metrics, store, ticket = Metrics(), _Store(), _Ticket()
        registry = StreamRegistry(engine, metrics, ttl_s=10, store=store)
        if kind.startswith("relay"):
            await engine.start()
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            stream = _stream()
            stream.ticket = ticket
            await registry.start(stream)  # never raises for the engine's sake
            with anyio.fail_after(5):
                await ticket.released.wait()
            for _ in range(10):  # anything released twice would show by now
                await anyio.lowlevel.checkpoint()
            registry.discard(stream)  # a handler's `finally` after a failed start: no-op
            tg.cancel_scope.cancel()
        if kind.startswith("relay"):
            await engine.close()
        assert stream.outcome is Outcome.ERROR
        assert ticket.releases == [Outcome.ERROR]
        assert metrics.active_streams == 0
        assert metrics.streams["error"] == 1 and metrics.streams["disconnected"] == 0
        assert store.opened == ["s1"] and store.finished == [("s1", "error")]
        last = stream.log.after(0)[-1].wire
        assert b"event: error" in last

    asyncio.run(body())


def test_a_failed_open_answers_with_its_error_and_can_be_forgotten() -> None:
    async def body() -> None:
        error = EngineError("invalid_synthetic", "nested too deep", status=400)
        registry = StreamRegistry(_FailingSteps(error), Metrics(), ttl_s=10)  # type: ignore[arg-type]
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            stream = _stream()
            assert await registry.start(stream) is error
            assert await registry.find("s1") is stream
            registry.forget(stream)  # its id was never handed out
            assert await registry.find("s1") is None
            tg.cancel_scope.cancel()

    asyncio.run(body())


def test_five_failed_opens_leave_no_stream_active() -> None:
    """The issue's trigger, in the registry: each failure used to stay active forever."""

    async def body() -> None:
        metrics = Metrics()
        registry = StreamRegistry(_FailingSteps(ValueError("x")), metrics, ttl_s=10)  # type: ignore[arg-type]
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            tickets = []
            for i in range(5):
                stream = _stream(f"s{i}")
                stream.ticket = ticket = _Ticket()
                tickets.append(ticket)
                await registry.start(stream)
            for _ in range(10):
                await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        assert metrics.active_streams == 0
        assert [t.releases for t in tickets] == [[Outcome.ERROR]] * 5

    asyncio.run(body())


def _finished(registry: StreamRegistry, stream_id: str, tenant: str, tokens: int) -> Stream:
    """A stream that ran to its end, as `start` would register it, with `tokens` events."""
    stream = Stream(
        GenerationRequest(request_id=stream_id, prompt="", model="synthetic", tenant=tenant),
        NativeRenderer(),
        kind="native",
        trace_id="t",
        grace_s=0.0,
        prompt_tokens=1,
        max_events=10_000,
        accepted_at=0.0,
    )
    registry._streams[stream_id] = stream
    registry.metrics.active_streams += 1
    stream.on_end = registry._ended
    stream.begin()
    for _ in range(tokens):
        stream.push("0123456789")
    stream.finish("stop")
    return stream


def test_finished_buffers_past_the_resume_budget_drop_the_largest_keys_oldest_first() -> None:
    async def body() -> None:
        clock = FakeClock()
        registry = StreamRegistry(_FailingPull(), Metrics(), ttl_s=300)  # type: ignore[arg-type]
        registry.clock = clock
        registry.budget = budget = ResumeBudget(50_000, per_key={"mallory": 20_000})
        a = _finished(registry, "a", "alice", 100)
        size = a.log.nbytes()
        assert 6000 < size < 10_000 and budget.held == size
        clock.advance(1)
        m = [_finished(registry, f"m{i}", "mallory", 100) for i in range(3)]
        # mallory's own bound: its oldest went, alice's stayed.
        assert budget.held_by("mallory") <= 20_000 and budget.held_by("alice") == size
        with pytest.raises(ResumeExpired):
            m[0].log.after(0)
        assert m[2].log.after(0)[-1].wire.endswith(b"[DONE]\n\n")
        assert await registry.find("m0") is m[0]  # still known: a resume gets resume_expired
        clock.advance(1)
        b = [_finished(registry, f"b{i}", "bob", 100) for i in range(4)]
        # bob fills the server-wide bound: he holds the most, so his oldest goes, not alice's.
        assert budget.held <= 50_000
        with pytest.raises(ResumeExpired):
            b[0].log.after(0)
        assert a.log.after(0)[-1].wire.endswith(b"[DONE]\n\n")
        assert budget.dropped == 2  # m0 for its key, then b0 for the server
        # The TTL still applies: expired streams leave the budget.
        clock.advance(300)
        registry.expire()
        assert budget.held == 0 and await registry.find("b3") is None

    asyncio.run(body())


def test_the_store_is_told_of_a_dropped_buffer_while_the_log_still_holds_it() -> None:
    """Redis may still lack a finished stream's last events when the resume budget drops its
    buffer: the store keeps them only if it hears first."""

    class Keeping(_Store):
        def __init__(self) -> None:
            super().__init__()
            self.kept: dict[str, int] = {}

        def release(self, stream_id: str) -> None:
            self.kept[stream_id] = len(registry._streams[stream_id].log.after(0))

    registry = StreamRegistry(_FailingPull(), Metrics(), ttl_s=300)  # type: ignore[arg-type]
    registry.store = store = Keeping()
    registry.budget = ResumeBudget(10_000)
    first = _finished(registry, "first", "alice", 100)
    _finished(registry, "second", "alice", 100)
    assert store.kept == {"first": 102}  # 100 tokens and the closing events
    with pytest.raises(ResumeExpired):
        first.log.after(0)


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


class _Recording(BaseEngine):
    """A step engine that writes down what it was asked to generate."""

    models = ("synthetic",)
    tokens_generated = 0

    def __init__(self) -> None:
        self.opened: list[GenerationRequest] = []

    def open(self, request: GenerationRequest, sink: Sink) -> Generation:
        self.opened.append(request)
        return _Idle()

    def as_step_engine(self) -> StepEngine:
        return self  # type: ignore[return-value]  # a test's partial engine

    def prompt_tokens(self, prompt: str) -> int:
        return 1

    async def abort(self, request_id: str) -> None:
        pass


class _Idle:
    cancelled = False

    def resume(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True


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


async def _reopen(claim: Claim, mirror: Stream) -> tuple[Stream, GenerationRequest | None, int]:
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
            assert await registry._take_over(mirror, Orphan("a"))
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
            assert await registry._take_over(mirror, Orphan("a")) is handled
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
            assert await registry._take_over(first, Orphan("a"))
            store.answer = "moved"
            assert await registry._take_over(second, Orphan("a"))
            local = await registry.find("s1")
            assert r1.stream is local and r2.stream is local and local.readers == 2
            assert len(store.adopted) == 1
            tg.cancel_scope.cancel()

    asyncio.run(body())


def test_end_where_ends_only_the_live_streams_it_picks_with_their_error() -> None:
    registry = StreamRegistry(_FailingPull(), Metrics(), ttl_s=300)  # type: ignore[arg-type]
    streams = {}
    for stream_id, tenant in (("a1", "alice"), ("a2", "alice"), ("b1", "bob")):
        stream = Stream(
            GenerationRequest(request_id=stream_id, prompt="", model="synthetic", tenant=tenant),
            NativeRenderer(),
            kind="native",
            trace_id="t",
            grace_s=0.0,
            prompt_tokens=1,
            max_events=100,
            accepted_at=0.0,
        )
        registry._streams[stream_id] = stream
        registry.metrics.active_streams += 1
        stream.on_end = registry._ended
        stream.begin()
        stream.push("tok")
        streams[stream_id] = stream
    streams["a2"].finish("stop")  # ended already: not ended twice
    revoked = EngineError("key_revoked", "gone", client_fault=True)
    assert registry.end_where(lambda s: s.request.tenant == "alice", revoked) == 1
    assert streams["a1"].outcome is Outcome.ERROR and streams["a1"].error_code == "key_revoked"
    assert b"key_revoked" in streams["a1"].log.after(0)[-1].wire
    assert streams["a2"].outcome is Outcome.COMPLETED and streams["b1"].outcome is None


class _Records(_Store):
    """A replicating store that keeps the records it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[StreamRecord] = []

    def open(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        super().open(record, ttl_s, log)
        self.records.append(record)


def test_stored_requests_count_in_the_resume_budget_while_their_streams_run() -> None:
    """A 1 MB prompt is stored in Redis with its stream for a takeover: counted until the
    stream ends; past the key's bound the next one is not stored (nor taken over)."""

    async def body() -> None:
        store = _Records()
        registry = StreamRegistry(_Recording(), Metrics(), ttl_s=10, store=store)  # type: ignore[arg-type]
        registry.budget = budget = ResumeBudget(10_000_000, per_key={"": 1_500_000})
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            first, second = _stream("s1"), _stream("s2")
            for stream in (first, second):
                stream.handover = b"x" * 1_000_000
                stream.movable = True
                stream.ticket = _Ticket()
                await registry.start(stream)
            assert [r.handover is not None for r in store.records] == [True, False]
            assert first.movable and not second.movable
            assert budget.requests == 1_000_000 and budget.unstored == 1
            first.stop(Outcome.CANCELLED)
            assert budget.requests == 0  # deleted from Redis with the stream's end


class _Closing(_Reader):
    """A reader that writes down that its connection ended (the log closed under it)."""

    ended = False

    def log_closed(self) -> None:
        if self.cursor >= self.log.last_seq:
            self.ended = True

    def catch_up(self) -> None:
        super().catch_up()
        if self.log.shown_all:
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
            assert await registry._take_over(first, Orphan("a"))
            second = _mirror(after=seq)
            second.resumed = Resumed(seq, event_id)
            reader = _Reader(second.log, registry, second)
            store.answer = "moved"
            assert await registry._take_over(second, Orphan("a"))
            local = await registry.find("s1")
            assert (reader.stream is local) is not lost
            if lost:
                assert second.log.closed
                assert b"stream_lost" in second.log.after(seq)[0].wire
            tg.cancel_scope.cancel()

    asyncio.run(body())


class _Prefilling(BaseEngine):
    """An iterator engine still before its first token; `queued`: it has not read the prompt
    (a routed request waiting for its target's slot)."""

    models = ("synthetic",)
    tokens_generated = 0

    def __init__(self, queued: bool) -> None:
        self.queued = queued

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        await anyio.sleep_forever()
        yield Delta("never")  # pragma: no cover

    async def abort(self, request_id: str) -> None:
        return None

    def has_prompt(self, request_id: str) -> bool:
        return not self.queued


class _Billed(_Ticket):
    def __init__(self) -> None:
        super().__init__()
        self.usage: object = "unset"
        self.read = False

    def prompt_read(self) -> None:
        self.read = True

    async def release(self, outcome: Outcome, usage: object = None, **_: object) -> None:
        self.usage = usage
        await super().release(outcome)


@pytest.mark.parametrize("queued", [False, True])
def test_a_client_gone_before_the_first_token_is_billed_the_prompt_its_engine_read(
    queued: bool,
) -> None:
    async def body() -> _Billed:
        registry = StreamRegistry(_Prefilling(queued), Metrics(), ttl_s=10)  # type: ignore[arg-type]
        ticket = _Billed()
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            stream = _stream()
            stream.ticket = ticket
            await registry.start(stream)
            await anyio.lowlevel.checkpoint()
            stream.stop(Outcome.DISCONNECTED)
            with anyio.fail_after(5):
                await ticket.released.wait()
            tg.cancel_scope.cancel()
        return ticket

    ticket = asyncio.run(body())
    assert ticket.releases == [Outcome.DISCONNECTED]
    assert ticket.usage == (None if queued else Usage(prompt=1))
    assert ticket.read is not queued  # told while the route knows which target read it
