"""Admission and the breaker on a fake clock: every path that admits and then does not run
gives back what it took (the half-open probe above all); keys, takeovers, budgets' metrics."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from starlette.requests import Request

from firsttoken.admission import Admission, ApiKey, KeyRing, shedding
from firsttoken.admission.shedding import LoadShedder
from firsttoken.admission.spend import Budget, LocalSpend, MemorySpend
from firsttoken.config import Settings
from firsttoken.core.stream import Outcome, Stream, Usage
from firsttoken.formats.errors import APIError
from firsttoken.pricing import LegStart
from firsttoken.routing.config import parse_routes
from firsttoken.telemetry.metrics import Metrics
from tests.unit.admissions import (
    ANYONE,
    DAVE,
    ROUTES,
    admission,
    budgeted,
    guarded,
)
from tests.unit.clock import FakeClock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(shedding.time, "monotonic", fake)
    return fake


async def open_breaker(adm: Admission) -> None:
    for _ in range(2):
        ticket = await adm.admit(ANYONE)
        await ticket.release(Outcome.ERROR)
    assert adm.shedder.breaker == LoadShedder.OPEN


def test_a_probe_whose_client_leaves_gives_the_probe_back(clock: FakeClock) -> None:
    async def body() -> None:
        adm = admission()
        await open_breaker(adm)
        with pytest.raises(APIError) as refused:
            await adm.admit(ANYONE)
        assert refused.value.status == 503
        clock.advance(10.0)
        probe = await adm.admit(ANYONE)
        assert probe.admitted.probe
        with pytest.raises(APIError):  # one probe at a time
            await adm.admit(ANYONE)
        await probe.release(Outcome.DISCONNECTED)  # left before its first token
        again = await adm.admit(ANYONE)  # not wedged: a new probe
        assert again.admitted.probe
        await again.release(Outcome.COMPLETED)
        assert adm.shedder.breaker == LoadShedder.CLOSED
        healthy = await adm.admit(ANYONE)
        assert not healthy.admitted.probe

    asyncio.run(body())


def test_a_failed_probe_reopens_and_an_old_stream_changes_nothing(clock: FakeClock) -> None:
    async def body() -> None:
        adm = admission()
        old = await adm.admit(ANYONE)  # admitted while closed
        await open_breaker(adm)
        clock.advance(10.0)
        probe = await adm.admit(ANYONE)
        await old.release(Outcome.COMPLETED)  # ends during half-open: not the probe
        assert adm.shedder.breaker == LoadShedder.HALF_OPEN
        await probe.release(Outcome.ERROR)
        assert adm.shedder.breaker == LoadShedder.OPEN

    asyncio.run(body())


def test_errors_a_request_caused_do_not_open_the_breaker(clock: FakeClock) -> None:
    async def body() -> None:
        adm = guarded()
        for _ in range(25):  # e.g. synthetic fail_after 0, or an upstream's 400
            ticket = await adm.admit(ANYONE)
            ticket.client_fault = True
            await ticket.release(Outcome.ERROR)
            clock.advance(0.01)
        assert adm.shedder.breaker == LoadShedder.CLOSED
        assert adm.shedder.refusal() is None
        for _ in range(20):  # the engine's own failures still do
            ticket = await adm.admit(ANYONE)
            await ticket.release(Outcome.ERROR)
        assert adm.shedder.breaker == LoadShedder.OPEN

    asyncio.run(body())


def test_a_probe_that_fails_by_its_own_request_gives_the_probe_back(clock: FakeClock) -> None:
    async def body() -> None:
        adm = admission()
        await open_breaker(adm)
        clock.advance(10.0)
        probe = await adm.admit(ANYONE)
        probe.client_fault = True
        await probe.release(Outcome.ERROR)
        assert adm.shedder.breaker == LoadShedder.HALF_OPEN  # undecided, not reopened
        again = await adm.admit(ANYONE)
        assert again.admitted.probe

    asyncio.run(body())


def test_a_moved_streams_hold_is_settled_once_by_the_instance_that_took_it_over(
    clock: FakeClock,
) -> None:
    """The first instance frees its slot but leaves the token hold: only the taker knows what
    the whole answer used, and only the claim's winner settles it."""

    async def body() -> None:
        adm = budgeted(clock)
        ticket = await adm.admit(DAVE, prompt_tokens=5, max_tokens=50)
        held = adm.held(ticket)
        assert "reservation" not in held  # held in this process: it dies with it
        await ticket.release(Outcome.MOVED, Usage(prompt=5, completion=10))
        assert adm.limits.budgets.used("dave") == 55  # still held
        r = ticket.admitted.reservation
        assert r is not None
        shared = {"reservation": [r.key, r.tokens, r.window]}  # as Redis mode holds it
        await adm.settle_taken(shared, used=5 + 12)
        assert adm.limits.budgets.used("dave") == 17

    asyncio.run(body())


TAKEN = 10 * 500_000 + 300 * 50_000_000  # 10 prompt and 300 answer tokens at edge's prices


def test_a_taken_over_ticket_is_priced_at_its_routes_target_and_spends_the_keys_budget(
    clock: FakeClock,
) -> None:
    """The instance that takes a stream over bills what its owners did not: after a SIGKILL
    the prompt and every token, none of which it generated, at the route's target (the
    continuation gets no first token here to name one), and the key's budget counts it."""

    async def body() -> None:
        adm = admission()
        adm.spend = LocalSpend(MemorySpend(clock=lambda: 1_800_000_000.0))
        adm.ledger.price(parse_routes(ROUTES))
        key = ApiKey(name="erin", budget=Budget(10**12 // 100, "day"))  # $0.01 a day
        # What the continuation may still make.
        ticket = await adm.admit(key, 0, 200, "chat", request_id="s1:taken", taken_over=True)
        await ticket.release(Outcome.COMPLETED, Usage(prompt=10, completion=300))
        (record,) = adm.ledger.writer.queue
        assert [leg.target for leg in record.legs] == ["edge"] and record.cost == TAKEN
        assert adm.spend.local.spent("erin", "day") == TAKEN > key.budget.amount  # type: ignore[union-attr]
        with pytest.raises(APIError) as refused:  # the whole answer counted: nothing left
            await adm.admit(key, 0, 10, "chat")
        assert refused.value.code == "budget_exceeded"

    asyncio.run(body())


def test_a_dead_owners_money_hold_is_given_back_by_the_taker_unless_the_owner_settled_it(
    clock: FakeClock,
) -> None:
    """A SIGKILLed owner's hold (the whole answer's worst case) would stay spent all day: the
    instance that takes the stream over bills the whole answer, so it gives the hold back. An
    owner that handed over settled its own (it billed its part) and is left alone."""

    async def body() -> None:
        adm = admission()
        adm.spend = LocalSpend(MemorySpend(clock=lambda: 1_800_000_000.0))
        adm.ledger.price(parse_routes(ROUTES))
        key = ApiKey(name="erin", budget=Budget(10**12 // 100, "day"))
        ticket = await adm.admit(key, 10, 300, "chat")
        hold = ticket.admitted.spend_hold
        assert hold is not None and adm.spend.local.spent("erin", "day") == hold.picos > 0
        shared = {"spend": [hold.key, hold.per, hold.period, hold.picos]}  # as Redis holds it
        assert adm.held(ticket) == {}  # held in this process: it dies with it
        await adm.settle_taken(shared, 0, owner_billed=True)
        assert adm.spend.local.spent("erin", "day") == hold.picos
        await adm.settle_taken(shared, 0, owner_billed=False)
        assert adm.spend.local.spent("erin", "day") == 0

    asyncio.run(body())


def test_a_taken_over_stream_keeps_the_secret_it_started_with() -> None:
    """During a rotation a name has two secrets: a stream taken over goes on under the one it
    was admitted with, and is refused once that one is gone (as its owner would end it)."""
    old, new = ApiKey(name="ops"), ApiKey(name="ops", weight=2.0)
    adm = admission()
    adm.keys = KeyRing({"sk-old": old, "sk-new": new})
    entry = adm.keys.find("sk-old")
    assert entry is not None
    assert adm.taken_key("ops", entry.digest.hex()) == old
    assert adm.taken_key("ops", entry.digest.hex()).digest == entry.digest  # type: ignore[union-attr]
    adm.keys = KeyRing({"sk-new": new})  # the old secret removed
    assert adm.taken_key("ops", entry.digest.hex()) is None
    assert adm.taken_key("ops", "not hex") is None
    assert adm.taken_key("ops") == new  # a stream from before digests travelled: by name
    adm.keys = None
    assert adm.taken_key("") == ANYONE and adm.taken_key("ops") is None


def test_an_expired_or_disabled_key_is_refused_with_401_on_the_admissions_clock() -> None:
    wall = FakeClock(start=1_000_000.0)
    adm = Admission(Settings(), Metrics(), clock=wall)
    adm.keys = KeyRing(
        {
            "sk-t": ApiKey(name="temp", expires_at=1_000_010.0),
            "sk-o": ApiKey(name="off", disabled=True),
        }
    )

    def refused(secret: str) -> tuple[int, str] | None:
        request = Request({"type": "http", "headers": [(b"x-api-key", secret.encode())]})
        try:
            adm.authenticate(request)
        except APIError as exc:
            return exc.status, exc.code
        return None

    assert refused("sk-t") is None
    assert refused("sk-o") == (401, "key_disabled")
    wall.advance(10)
    assert refused("sk-t") == (401, "key_expired")
    assert refused("sk-x") == (401, "invalid_api_key")


def test_memory_is_read_once_a_second_while_far_below_the_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.unit import virtual_loop

    shedder = LoadShedder(Settings(memory_limit="1000", memory_shed_fraction=0.8), Metrics())
    rss = [100]
    reads: list[float] = []

    def read() -> int:
        reads.append(asyncio.get_running_loop().time())
        return rss[0]

    monkeypatch.setattr(shedding, "rss_bytes", read)
    ended: list[bool] = []

    async def body() -> None:
        task = asyncio.create_task(shedder.watch_memory(lambda: ended.append(True) or True))
        await asyncio.sleep(3.1)
        assert len(reads) == 4  # 0, 1, 2, 3 s: below half of 800 bytes
        rss[0] = 500  # past half: seen at 4 s, then read four times a second
        await asyncio.sleep(1.8)
        assert len(reads) == 8  # 4, 4.25, 4.5, 4.75
        rss[0] = 900  # over the threshold: shed at the next read
        await asyncio.sleep(0.3)
        assert ended and "memory" in shedder.reasons
        task.cancel()

    virtual_loop.run(body())


def keyed() -> tuple[Admission, ApiKey]:
    adm = admission()
    adm.keys = KeyRing({"sk-alice": ApiKey(name="alice"), "sk-bob": ApiKey(name="bob")})
    alice = adm.keys.find("sk-alice")
    assert alice is not None
    return adm, alice


def test_a_key_removed_while_its_body_arrived_is_refused_at_admission() -> None:
    adm, alice = keyed()
    assert adm.recheck(alice) is alice  # nothing reloaded: the same key
    adm.keys = KeyRing({"sk-bob": ApiKey(name="bob")})  # the reload lands mid-body
    with pytest.raises(APIError) as removed:
        adm.recheck(alice)
    assert removed.value.status == 401 and removed.value.code == "invalid_api_key"
    adm.keys = KeyRing({"sk-alice": ApiKey(name="alice", disabled=True)})
    with pytest.raises(APIError) as disabled:
        adm.recheck(alice)
    assert disabled.value.status == 401 and disabled.value.code == "key_disabled"
    adm.keys = KeyRing({"sk-alice": ApiKey(name="alice", max_streams=1)})
    assert adm.recheck(alice).max_streams == 1  # changed: this request takes the new limits


def test_a_stream_admitted_just_before_a_reload_ends_key_revoked_as_it_starts() -> None:
    from firsttoken.core.registry import StreamRegistry
    from firsttoken.engines import GenerationRequest, SyntheticEngine
    from firsttoken.formats.render import NativeRenderer

    async def body() -> None:
        adm, alice = keyed()
        registry = StreamRegistry(SyntheticEngine(), adm.metrics, ttl_s=10)
        registry.revoked = adm.revoked
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            streams = []
            for stream_id, key in (
                ("a", alice),
                ("b", adm.keys.find("sk-bob") if adm.keys else None),
            ):
                assert key is not None
                stream = Stream(
                    GenerationRequest(
                        request_id=stream_id,
                        prompt="hi",
                        model="synthetic",
                        max_tokens=5,
                        tenant=key.name,
                    ),
                    NativeRenderer(),
                    format="native",
                    trace_id="t",
                    grace_s=10.0,
                    prompt_tokens=1,
                    max_events=100,
                    accepted_at=0.0,
                )
                stream.ticket = await adm.admit(key, 1, 5)
                streams.append(stream)
            # The reload removes alice after admission checked her, before her stream started:
            # the reload's sweep of running streams cannot see it yet.
            adm.keys = KeyRing({"sk-bob": ApiKey(name="bob")})
            failed = await registry.start(streams[0])
            assert failed is not None and failed.code == "key_revoked"
            assert await registry.start(streams[1]) is None  # bob's key stands
            assert streams[1].outcome is None  # running
            tg.cancel_scope.cancel()
        assert streams[0].outcome is Outcome.ERROR and streams[0].error_code == "key_revoked"

    asyncio.run(body())


def test_budgets_show_their_amount_and_this_periods_spend_as_metrics(clock: FakeClock) -> None:
    async def body() -> None:
        adm = admission()
        assert list(adm.collect()) == []  # no keys file: nothing
        adm.spend = LocalSpend(MemorySpend(clock=lambda: 1_800_000_000.0))
        adm.ledger.price(parse_routes(ROUTES))
        budget = Budget(10**12 // 100, "day")
        adm.keys = KeyRing(
            {"sk-e": ApiKey(name="erin", budget=budget), "sk-f": ApiKey(name="fred")}
        )
        assert adm.keys is not None
        erin = adm.keys.find("sk-e")
        assert erin is not None
        # Its hold counts while it runs.
        ticket = await adm.admit(erin, 10, 20, "chat", request_id="s1")
        families = {f.name: f for f in adm.collect()}
        (amount,) = families["firsttoken_key_budget_amount"].samples
        (spent,) = families["firsttoken_key_budget_spent"].samples
        assert amount.labels == spent.labels == {"key": "erin", "per": "day"}
        assert amount.value == 0.01
        held = 10 * 1_000_000 + 20 * 100_000_000  # the route's dearest prices
        assert spent.value == held / 10**12
        assert await adm.budget_spent("erin", "day") == held
        ticket.legs = (LegStart("edge"),)
        await ticket.release(Outcome.COMPLETED, Usage(prompt=10, completion=2))
        (spent,) = {f.name: f for f in adm.collect()}["firsttoken_key_budget_spent"].samples
        assert spent.value == (10 * 500_000 + 2 * 50_000_000) / 10**12

    asyncio.run(body())


def test_with_the_ttft_guard_off_no_ttft_is_kept(clock: FakeClock) -> None:
    """A deployment pays only for what it configures: --ttft-slo-ms 0 keeps no window of
    first-token times for a guard that never reads it."""
    off = admission().shedder  # ttft_slo_ms=0
    on = guarded().shedder
    for shedder in (off, on):
        shedder.record_ttft(0.7)
    assert len(off._ttfts) == 0 and len(on._ttfts) == 1
