"""The gate (admission/gate.py) on a fake clock: each limit refuses or holds, and a refusal
or a cancellation gives back what the limits before it held."""

from __future__ import annotations

import asyncio

import pytest

from firsttoken.admission import Admission, ApiKey, KeyRing, shedding
from firsttoken.admission.gate import (
    Bucket,
    Draft,
    MoneyBudget,
    Probe,
    RequestRate,
    Shedding,
    Slots,
    TokenRate,
)
from firsttoken.admission.limits import RequestRates, TokenBudgets
from firsttoken.admission.spend import parse_budget
from firsttoken.config import Settings
from firsttoken.core.stream import Outcome, Usage
from firsttoken.formats.errors import APIError
from firsttoken.pricing import LegStart
from firsttoken.telemetry.metrics import Metrics
from tests.unit import virtual_loop
from tests.unit.admissions import (
    ANYONE,
    CENT,
    DAVE,
    admission,
    budgeted,
    priced,
)
from tests.unit.clock import FakeClock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(shedding.time, "monotonic", fake)
    return fake


def test_a_budget_holds_prompt_plus_max_tokens_and_settles_with_the_real_use(
    clock: FakeClock,
) -> None:
    async def body() -> None:
        adm = budgeted(clock)
        first = await adm.admit(DAVE, prompt_tokens=5, max_tokens=50)
        assert adm.limits.budgets.used("dave") == 55
        with pytest.raises(APIError) as refused:  # 55 + 55 > 100: never lowered behind its back
            await adm.admit(DAVE, prompt_tokens=5, max_tokens=50)
        assert refused.value.status == 429 and "retry-after" in refused.value.headers
        assert adm.limits.budgets.used("dave") == 55  # the refused one holds nothing
        second = await adm.admit(DAVE, prompt_tokens=5, max_tokens=40)  # 55 + 45 = 100
        with pytest.raises(APIError) as refused:
            await adm.admit(DAVE, prompt_tokens=5, max_tokens=1)
        assert refused.value.status == 429 and refused.value.code == "token_budget_exceeded"
        await first.release(Outcome.COMPLETED, Usage(prompt=5, completion=20))
        await second.release(Outcome.DISCONNECTED, Usage(prompt=5, completion=3))  # cut
        assert adm.limits.budgets.used("dave") == 25 + 8

    asyncio.run(body())


def test_no_max_tokens_holds_the_default_answer_or_what_is_left(clock: FakeClock) -> None:
    async def body() -> None:
        adm = budgeted(clock)
        roomy = ApiKey(name="erin", tokens_per_minute=10_000)
        ticket = await adm.admit(roomy, prompt_tokens=5)
        assert adm.limits.budgets.used("erin") == 5 + 1024
        assert ticket.admitted.max_tokens == 10_000 - 5  # it may run to what was left
        ticket = await adm.admit(DAVE, prompt_tokens=5)
        assert adm.limits.budgets.used("dave") == 100  # the default is more than is left
        assert ticket.admitted.max_tokens == 95

    asyncio.run(body())


def test_a_max_tokens_that_does_not_fit_is_refused_never_lowered(clock: FakeClock) -> None:
    # Issue 37.4: max_tokens 100,000 on a key of 1,000 a minute was admitted as asked, and
    # 105,001 tokens were billed; issue 53: lowering it instead cut answers short unseen. A
    # limit the client named is taken as named, or refused (as OpenAI and LiteLLM do).
    async def body() -> None:
        adm = budgeted(clock)
        frank = ApiKey(name="frank", tokens_per_minute=1000)
        with pytest.raises(APIError) as never:
            await adm.admit(frank, prompt_tokens=5, max_tokens=100_000)
        assert never.value.status == 400 and never.value.param == "max_tokens"
        ticket = await adm.admit(frank, prompt_tokens=5, max_tokens=995)
        assert ticket.admitted.max_tokens == 995
        assert adm.limits.budgets.used("frank") == 1000
        with pytest.raises(APIError) as refused:
            await adm.admit(frank, prompt_tokens=5, max_tokens=1)
        assert refused.value.status == 429
        unlimited = await adm.admit(ANYONE, prompt_tokens=5, max_tokens=100_000)
        assert unlimited.admitted.max_tokens == 100_000  # no budget: as asked

    asyncio.run(body())


def test_a_prompt_larger_than_the_whole_budget_is_a_400(clock: FakeClock) -> None:
    async def body() -> None:
        adm = budgeted(clock)
        with pytest.raises(APIError) as refused:
            await adm.admit(DAVE, prompt_tokens=100, max_tokens=1)
        assert refused.value.status == 400 and refused.value.code == "token_budget_exceeded"
        assert adm.limits.budgets.used("dave") == 0

    asyncio.run(body())


def test_a_request_refused_after_its_hold_gives_the_hold_back(clock: FakeClock) -> None:
    async def body() -> None:
        adm = budgeted(clock)
        adm.keys = KeyRing({"sk-dave": DAVE})  # per-key slots count only with a keys file
        held = [await adm.admit(DAVE, prompt_tokens=1, max_tokens=10) for _ in range(2)]
        with pytest.raises(APIError) as refused:  # its two slots are taken
            await adm.admit(DAVE, prompt_tokens=1, max_tokens=10)
        assert refused.value.code == "concurrency_limit_exceeded"
        assert adm.limits.budgets.used("dave") == 22
        for ticket in held:
            await ticket.release(Outcome.COMPLETED, Usage(prompt=1, completion=10))
        assert adm.limits.budgets.used("dave") == 22

    asyncio.run(body())


def test_a_key_past_its_requests_per_minute_gets_429_rate_limited(clock: FakeClock) -> None:
    async def body() -> None:
        adm = admission()
        minute = FakeClock(start=6000.0)
        adm.limits.requests = RequestRates(minute)
        hasty = ApiKey(name="hasty", requests_per_minute=2)
        for _ in range(2):
            await (await adm.admit(hasty)).release(Outcome.COMPLETED)
        with pytest.raises(APIError) as refused:
            await adm.admit(hasty)
        assert (refused.value.status, refused.value.code) == (429, "rate_limited")
        assert refused.value.headers == {"retry-after": "60"}
        assert adm.metrics.streams["rejected"] == 1
        minute.advance(60)
        await adm.admit(hasty)

    asyncio.run(body())


def test_a_money_budget_caps_answers_that_name_no_max_tokens(clock: FakeClock) -> None:
    async def body() -> None:
        adm = priced(clock)
        cent = ApiKey(name="carol", max_streams=5, budget=parse_budget({"amount": "0.01"}, "b"))
        assert cent.budget is not None and cent.budget.amount == CENT
        # Five at once, none naming max_tokens, each answer as long as the engine likes
        # (20,000 tokens): each is capped to what its share of the money left buys.
        tickets = [await adm.admit(cent, 100, None, "chat", request_id=f"r{i}") for i in range(5)]
        caps = [t.admitted.max_tokens for t in tickets]
        assert all(cap is not None and 0 < cap < 1024 for cap in caps), caps
        for ticket in tickets:
            ticket.legs = (LegStart("gpu"),)
            ran = min(20_000, ticket.admitted.max_tokens or 20_000)  # the engine stops at its cap
            await ticket.release(Outcome.COMPLETED, Usage(prompt=100, completion=ran))
        assert adm.spend.local.spent("carol", "day") <= CENT
        # One after another, each to its cap, until nothing is left: at most one over.
        with pytest.raises(APIError) as refused:
            for i in range(100):
                ticket = await adm.admit(cent, 100, None, "chat", request_id=f"s{i}")
                ticket.legs = (LegStart("gpu"),)
                usage = Usage(prompt=100, completion=ticket.admitted.max_tokens or 20_000)
                await ticket.release(Outcome.COMPLETED, usage)
        assert refused.value.code == "budget_exceeded"
        one_reservation = 100 * 10**6 + 10**7  # the prompt and one token, in picos
        assert adm.spend.local.spent("carol", "day") <= CENT + one_reservation

    asyncio.run(body())


def test_a_refusal_gives_back_what_the_limits_before_it_held_last_first() -> None:
    given_back: list[str] = []

    async def give_back(what: str) -> None:
        given_back.append(what)

    async def body() -> None:
        draft = Draft(DAVE, 5, 10, "chat")
        await draft.give_back()  # nothing held: nothing to give back
        assert draft.undo is None
        for what in ("tokens", "money", "slot"):
            draft.hold(give_back, what)
        await draft.give_back()
        assert given_back == ["slot", "money", "tokens"]

    asyncio.run(body())


def test_a_request_cancelled_while_its_slot_is_asked_gives_back_its_holds(
    clock: FakeClock,
) -> None:
    """With Redis the slot is one round trip, after the key's token and money holds were
    taken: a client that leaves (or a timeout that ends it) then must not leave them held
    for the rest of the minute, or of the day."""

    async def body() -> None:
        adm = priced(clock)
        adm.limits.budgets = TokenBudgets(clock)
        key = ApiKey(name="dave", tokens_per_minute=100, budget=parse_budget({"amount": 1}, "b"))
        adm.keys = KeyRing({"sk-dave": key})
        asked = asyncio.Event()
        admit = adm.limits.admit

        async def slow(*args: object, **kwargs: object) -> tuple:
            asked.set()
            await asyncio.sleep(1)  # a store that takes its time
            return await admit(*args, **kwargs)  # type: ignore[arg-type]

        adm.limits.admit = slow  # type: ignore[method-assign]
        task = asyncio.create_task(adm.admit(key, 5, 50, "chat"))
        await asked.wait()
        assert adm.limits.budgets.used("dave") == 55
        assert adm.spend.local.spent("dave", "day") > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert adm.limits.budgets.used("dave") == 0
        assert adm.spend.local.spent("dave", "day") == 0
        assert adm.metrics.streams["rejected"] == 0  # not refused: cancelled

    virtual_loop.run(body())


def test_with_no_keys_file_and_no_bucket_a_request_asks_for_no_slot() -> None:
    """What nothing configured costs: no keys file and --rate-limit-per-s 0 leave shedding
    and the breaker's probe, both decided at once; a key pays for the limits it has."""

    def limits(adm: Admission, key: ApiKey) -> list[type]:
        return [type(limit) for limit in adm.limits_for(key)]

    open_ = admission()  # no keys file, rate 0
    anyone = open_.taken_key("")  # the one key there is without a keys file
    assert anyone is not None and limits(open_, anyone) == [Shedding, Probe]
    bucket = Admission(Settings(rate_limit_per_s=100), Metrics())
    assert limits(bucket, anyone) == [Shedding, Bucket, Probe]  # in this process: at once
    keyed = admission()
    keyed.keys = KeyRing({"sk-dave": DAVE})
    assert limits(keyed, ApiKey(name="plain")) == [Shedding, Slots, Probe]
    everything = ApiKey(
        name="all",
        requests_per_minute=10,
        tokens_per_minute=100,
        budget=parse_budget({"amount": 1}, "b"),
    )
    assert limits(keyed, everything) == [
        Shedding,
        RequestRate,
        TokenRate,
        MoneyBudget,
        Slots,
        Probe,
    ]
    assert limits(open_, DAVE) == [Shedding, TokenRate, Slots, Probe]


def test_the_servers_bucket_refuses_the_open_key_as_it_refuses_any() -> None:
    """Without a keys file the bucket is asked alone, at once (`Bucket`): the same 429."""

    async def body() -> None:
        adm = Admission(Settings(rate_limit_per_s=1, rate_limit_burst=1), Metrics())
        anyone = adm.taken_key("")
        assert anyone is not None
        await adm.admit(anyone)
        with pytest.raises(APIError) as refused:
            await adm.admit(anyone)
        error = refused.value
        assert (error.status, error.code) == (429, "rate_limit_exceeded")
        assert error.message == "over the server's limit of 1 new streams per second"
        assert error.headers == {"retry-after": "1"} and adm.metrics.streams["rejected"] == 1

    asyncio.run(body())
