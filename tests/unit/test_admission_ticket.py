"""The ticket (admission/ticket.py): built from what admission granted, it gives it back
and bills the answer; what the stream reports through it."""

from __future__ import annotations

import asyncio

import pytest

from firsttoken.admission import ApiKey, billed, sets_own_latency, shedding
from firsttoken.admission import gate as gate_module
from firsttoken.admission.spend import Budget, LocalSpend, MemorySpend, parse_budget
from firsttoken.core.stream import Outcome, Usage
from firsttoken.pricing import LegStart
from firsttoken.routing.config import parse_routes
from tests.unit.admissions import (
    ANYONE,
    DAVE,
    ROUTES,
    admission,
    budgeted,
    guarded,
    priced,
)
from tests.unit.clock import FakeClock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(shedding.time, "monotonic", fake)
    return fake


def test_a_latency_the_request_set_does_not_trip_the_ttft_guard(clock: FakeClock) -> None:
    async def body() -> None:
        adm = guarded()
        for _ in range(20):  # e.g. synthetic ttft_ms 700
            ticket = await adm.admit(
                ANYONE, own_latency=sets_own_latency({"synthetic": {"ttft_ms": 700}})
            )
            ticket.first_token(0.7)
            await ticket.release(Outcome.COMPLETED)
        clock.advance(0.2)
        assert adm.shedder.refusal() is None
        for _ in range(20):  # the engine's own slowness still does
            ticket = await adm.admit(ANYONE, own_latency=sets_own_latency({"synthetic": None}))
            ticket.first_token(0.7)
            await ticket.release(Outcome.COMPLETED)
        clock.advance(0.2)
        refusal = adm.shedder.refusal()
        assert refusal is not None and refusal[0] == "overloaded"

    asyncio.run(body())


def test_only_a_chosen_ttft_is_the_requests_own_latency() -> None:
    assert sets_own_latency({"synthetic": {"ttft_ms": 0}})
    assert not sets_own_latency({"synthetic": {"ttft_ms": None, "fail_after": 0}})
    assert not sets_own_latency({"synthetic": None})
    assert not sets_own_latency({})


def test_a_stream_that_generated_nothing_pays_its_prompt_only_if_its_client_left() -> None:
    used = Usage(prompt=7, completion=0, cached=2)
    assert billed(Outcome.ERROR, used) == Usage()  # e.g. refused upstream before a token
    # Left during the prefill: the engine read the prompt (an upstream bills it so).
    assert billed(Outcome.CANCELLED, used) == used
    assert billed(Outcome.DISCONNECTED, used) == used
    assert billed(Outcome.DISCONNECTED, None) == Usage()  # no engine had it (queued)
    assert billed(Outcome.COMPLETED, used) == used  # an empty answer still read its prompt
    cut = Usage(prompt=7, completion=5)
    assert billed(Outcome.DISCONNECTED, cut) == cut  # cut by its client: what was generated
    assert billed(Outcome.DISCONNECTED, None) == Usage()  # never started


def test_usage_is_counted_per_key_name(clock: FakeClock) -> None:
    async def body() -> None:
        adm = budgeted(clock)
        opened = await adm.admit(ANYONE, prompt_tokens=3, max_tokens=10)
        await opened.release(Outcome.COMPLETED, Usage(3, 10, 4, 2))
        dave = await adm.admit(DAVE, prompt_tokens=5, max_tokens=10)
        await dave.release(Outcome.COMPLETED, Usage(5, 9))
        await dave.release(Outcome.COMPLETED, Usage(5, 9))  # released once only
        tokens = adm.metrics.key_tokens
        assert tokens["open", "prompt"] == 3 and tokens["open", "completion"] == 10
        assert tokens["open", "reasoning"] == 4 and tokens["open", "cached"] == 2
        assert tokens["dave", "prompt"] == 5 and tokens["dave", "completion"] == 9
        assert tokens["dave", "cached"] == 0

    asyncio.run(body())


def test_the_time_admission_waited_on_shared_limits_does_not_trip_the_ttft_guard(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis stopped answering: each admission waits its 1 s timeout, then falls back to
    this instance's limits. That second is the store's; the guard judges the engine."""
    counter = FakeClock()
    monkeypatch.setattr(gate_module.time, "perf_counter", counter)

    async def body() -> None:
        adm = guarded()
        admit = adm.limits.admit

        async def waiting(*args: object, **kwargs: object) -> tuple:
            counter.advance(1.0)  # the Redis call's timeout
            return await admit(*args, **kwargs)  # type: ignore[arg-type]

        adm.limits.admit = waiting  # type: ignore[method-assign]
        for _ in range(20):
            ticket = await adm.admit(ANYONE)
            counter.advance(0.05)  # the engine's own first token
            ticket.first_token(1.05)  # from the request's first byte
            await ticket.release(Outcome.COMPLETED)
        clock.advance(0.2)
        assert adm.shedder.refusal() is None


def test_a_prompt_read_before_the_client_left_is_priced_at_the_target_that_read_it(
    clock: FakeClock,
) -> None:
    async def body() -> None:
        adm = priced(clock)
        adm.serving = lambda request_id: "gpu"  # the route's answer while the leg is open
        payer = ApiKey(name="paula", budget=parse_budget({"amount": 1}, "b"))
        ticket = await adm.admit(payer, 902, 100, "chat", request_id="r1")
        ticket.prompt_read()  # the registry, as the stream ends before its first token
        await ticket.release(Outcome.DISCONNECTED, Usage(prompt=902))
        assert adm.spend.local.spent("paula", "day") == 902 * 10**6  # 1 a million prompt tokens
        assert adm.ledger.spend["paula"] == 902 * 10**6

    asyncio.run(body())


def test_the_hand_offs_prefill_is_billed_with_the_request_and_spends_the_budget(
    clock: FakeClock,
) -> None:
    """The routed engine's `prefill` meta event (just before the answer's end) bills the
    center's prefill: its prompt and one token, at the center's prices."""

    async def body() -> None:
        adm = admission()
        adm.spend = LocalSpend(MemorySpend(clock=lambda: 1_800_000_000.0))
        adm.ledger.price(parse_routes(ROUTES))
        key = ApiKey(name="erin", budget=Budget(10**12, "day"))
        ticket = await adm.admit(key, 10, 20, "chat", request_id="s1")
        ticket.legs = (LegStart("edge"),)
        ticket.seam({"prefill": {"target": "center"}})
        await ticket.release(Outcome.COMPLETED, Usage(prompt=10, completion=20))
        (record,) = adm.ledger.writer.queue
        answer = 10 * 500_000 + 20 * 50_000_000
        prefill = 10 * 1_000_000 + 1 * 100_000_000
        assert [leg.target for leg in record.legs] == ["edge", "center"]
        assert record.cost == answer + prefill
        assert adm.spend.local.spent("erin", "day") == answer + prefill

    asyncio.run(body())


def test_what_admission_granted_is_fixed_and_the_ticket_is_built_from_it(
    clock: FakeClock,
) -> None:
    """Nobody fills a ticket in after admission: what it was granted is one frozen value, and
    the ticket keeps only what its stream reports."""

    async def body() -> None:
        adm = budgeted(clock)
        ticket = await adm.admit(
            DAVE, 5, None, "chat", request_id="r1", trace_id="t1", own_latency=True
        )
        granted = ticket.admitted
        assert (granted.key, granted.prompt_tokens, granted.max_tokens) == (DAVE, 5, 95)
        assert (granted.request_id, granted.trace_id, granted.own_latency) == ("r1", "t1", True)
        assert granted.reservation is not None and granted.lease is None  # no keys file
        with pytest.raises(AttributeError):
            granted.max_tokens = 1000  # type: ignore[misc]
        with pytest.raises(AttributeError):
            ticket.request_id = "r2"  # type: ignore[attr-defined]
        await ticket.release(Outcome.COMPLETED, Usage(prompt=5, completion=1))

    asyncio.run(body())


def test_a_request_refused_before_its_stream_existed_is_recorded_with_its_trace_id(
    clock: FakeClock,
) -> None:
    """The ids come with admission: a request the engine refuses before its stream is built
    (the gateway gives its ticket back) has its trace id in its ledger record too."""

    async def body() -> None:
        adm = priced(clock)
        payer = ApiKey(name="paula", budget=parse_budget({"amount": 1}, "b"))
        ticket = await adm.admit(payer, 10, 5, "chat", request_id="r1", trace_id="t1")
        await ticket.release(Outcome.ERROR)  # `registry.unstarted`
        (record,) = adm.ledger.writer.queue
        assert (record.request_id, record.trace_id, record.outcome) == ("r1", "t1", "error")

    asyncio.run(body())
