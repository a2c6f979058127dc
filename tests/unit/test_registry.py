"""The registry: a stream whose engine fails to open releases everything, once; finished
buffers are bounded by the resume budget; a stream is billed what its engine read. (Its
takeovers are tests/unit/test_takeovers.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.lowlevel
import pytest

from firsttoken.config import Settings
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.stream import Outcome, Stream, Usage
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.engines.cache import CachedEngine
from firsttoken.formats.render import NativeRenderer
from firsttoken.generation import BaseEngine, Delta, Engine, Generation, Sink, StepEngine
from firsttoken.resume import (
    EventLog,
    MemoryStore,
    ResumeExpired,
    StreamRecord,
)
from firsttoken.resume.budget import ResumeBudget
from firsttoken.telemetry.metrics import Metrics
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


def _stream(stream_id: str = "s1", format: str = "native", grace_s: float = 10.0) -> Stream:
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
        format=format,
        trace_id="t",
        grace_s=grace_s,
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
        format="native",
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


def test_end_where_ends_only_the_live_streams_it_picks_with_their_error() -> None:
    registry = StreamRegistry(_FailingPull(), Metrics(), ttl_s=300)  # type: ignore[arg-type]
    streams = {}
    for stream_id, tenant in (("a1", "alice"), ("a2", "alice"), ("b1", "bob")):
        stream = Stream(
            GenerationRequest(request_id=stream_id, prompt="", model="synthetic", tenant=tenant),
            NativeRenderer(),
            format="native",
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


class _SlowRegistration(_Store):
    """Redis slow to take a stream's meta (restarting): `registered` would wait until
    `taken`, which never comes."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[str] = []
        self.taken = anyio.Event()

    async def registered(self, stream_id: str) -> None:
        self.waited.append(stream_id)
        await self.taken.wait()


@pytest.mark.parametrize(
    ("format", "grace_s"),
    [
        ("native", 0.0),  # its events URL is handed out with its id
        ("responses", 0.0),  # retrieve and background read it by id elsewhere
        ("openai", 5.0),  # resumable: its id and resume token are in the headers
        ("openai", 0.0),
        ("anthropic", 0.0),
    ],
)
def test_no_stream_waits_for_the_store_to_hold_it_before_its_id_is_out(
    format: str, grace_s: float
) -> None:
    """Native and Responses streams, and resumable ones, waited for Redis to hold their meta
    before their id went out: up to 1 s added to their first token while Redis restarted
    (TTFT p99 1.1 s after a restart). Another instance asked for one meanwhile waits for its
    meta instead (`RedisStore.lookup`)."""

    async def body() -> None:
        store = _SlowRegistration()
        registry = StreamRegistry(_FailingPull(), Metrics(), ttl_s=10, store=store)  # type: ignore[arg-type]
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            stream = _stream(format=format, grace_s=grace_s)
            stream.ticket = _Ticket()
            with anyio.move_on_after(0.05) as waited:
                await registry.start(stream)
            assert not waited.cancelled_caught
            assert store.opened == ["s1"] and store.waited == []
            tg.cancel_scope.cancel()

    asyncio.run(body())
