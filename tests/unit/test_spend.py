"""Money budgets on a fake clock: calendar periods in UTC, holds, settling, and how far
requests racing for the last cents can go over."""

from __future__ import annotations

import asyncio
import calendar

import pytest

from firsttoken.admission.spend import (
    Budget,
    LocalSpend,
    MemorySpend,
    parse_budget,
    period_of,
    period_start,
)
from tests.unit.clock import FakeClock

CENT = 10**10  # picos
DAY_START = float(calendar.timegm((2026, 12, 2, 0, 0, 0)))


def spend(at: float = DAY_START + 3600) -> tuple[MemorySpend, FakeClock]:
    clock = FakeClock(at)
    return MemorySpend(clock), clock


def test_periods_are_calendar_periods_in_utc() -> None:
    noon = DAY_START + 12 * 3600
    assert period_of("day", noon) == ("2026-12-02", 12 * 3600)
    name, left = period_of("month", noon)
    assert name == "2026-12"
    assert left == 30 * 86400 - 12 * 3600  # to 2027-01-01 00:00
    assert period_of("total", noon)[0] == "total"
    assert period_start("day", noon) == DAY_START
    assert period_start("month", noon) == calendar.timegm((2026, 12, 1, 0, 0, 0))
    assert period_start("total", noon) == 0


def test_february_ends_on_its_own_last_day() -> None:
    feb = float(calendar.timegm((2027, 2, 28, 23, 0, 0)))
    assert period_of("month", feb) == ("2027-02", 3600)


def test_a_hold_counts_until_settled_to_what_was_delivered() -> None:
    s, _ = spend()
    budget = Budget(100 * CENT, "day")
    hold = s.reserve("alice", budget, 30 * CENT)
    assert hold is not None
    assert s.spent("alice", "day") == 30 * CENT
    s.settle(hold, 7 * CENT)
    assert s.spent("alice", "day") == 7 * CENT
    assert s.spent("bob", "day") == 0


def test_racing_requests_go_over_by_at_most_one_reservation() -> None:
    s, _ = spend()
    budget = Budget(100 * CENT, "day")
    s.add("alice", "day", 99 * CENT)  # 1 cent left
    holds = [s.reserve("alice", budget, 5 * CENT) for _ in range(50)]
    admitted = [h for h in holds if h is not None]
    assert len(admitted) == 1
    assert s.spent("alice", "day") - budget.amount == 4 * CENT  # < one reservation


def test_a_new_day_starts_from_nothing() -> None:
    s, clock = spend()
    budget = Budget(10 * CENT, "day")
    assert s.reserve("alice", budget, 10 * CENT) is not None
    assert s.reserve("alice", budget, CENT) is None
    clock.advance(23 * 3600)  # past midnight UTC
    assert s.spent("alice", "day") == 0
    assert s.reserve("alice", budget, CENT) is not None


def test_a_hold_settled_after_its_period_adds_only_what_went_over() -> None:
    s, clock = spend(DAY_START + 86400 - 10)
    budget = Budget(100 * CENT, "day")
    under = s.reserve("alice", budget, 10 * CENT)
    over = s.reserve("alice", budget, 10 * CENT)
    assert under is not None and over is not None
    clock.advance(20)  # the next day
    s.settle(under, 4 * CENT)  # cost less than held: frees nothing in a day gone
    assert s.spent("alice", "day") == 0
    s.settle(over, 13 * CENT)  # cost more: the excess counts today
    assert s.spent("alice", "day") == 3 * CENT


def test_a_total_budget_never_resets() -> None:
    s, clock = spend()
    budget = Budget(5 * CENT, "total")
    assert s.reserve("alice", budget, 5 * CENT) is not None
    clock.advance(400 * 86400)
    assert s.reserve("alice", budget, CENT) is None


def test_the_ledger_seeds_the_current_period() -> None:
    s, _ = spend()
    s.seed("alice", "month", 42)
    assert s.spent("alice", "month") == 42


def test_a_budget_reads_exactly_from_the_keys_file() -> None:
    assert parse_budget({"amount": 25.0, "per": "month"}, "b") == Budget(25 * 10**12, "month")
    assert parse_budget({"amount": "0.01"}, "b") == Budget(CENT, "day")


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (5, "must be an inline table"),
        ({"per": "day"}, "amount is required"),
        ({"amount": 1, "per": "week"}, "must be one of day, month, total"),
        ({"amount": 1, "every": "day"}, "unknown field"),
        ({"amount": -1}, ">= 0"),
    ],
)
def test_a_bad_budget_is_refused_saying_why(raw: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_budget(raw, "keys[0].budget")


def test_an_open_ended_answer_holds_and_may_run_to_its_share_of_what_is_left() -> None:
    s, _ = spend()
    budget = Budget(100 * CENT, "day")
    # A prompt of 10 cents, a cent a token, 5 streams: a fifth of the 90 cents left after it.
    hold = s.reserve("alice", budget, 10 * CENT, per_token=CENT, share=5)
    assert hold is not None and hold.answer_tokens == 18
    assert hold.picos == 10 * CENT + 18 * CENT == s.spent("alice", "day")
    # The key's five streams all fit, each capped to its share of what was left then.
    more = [s.reserve("alice", budget, 0, per_token=CENT, share=5) for _ in range(4)]
    assert [h.answer_tokens for h in more if h is not None] == [14, 11, 9, 7]
    assert s.spent("alice", "day") <= budget.amount


def test_an_open_ended_answer_on_the_last_cents_may_run_to_one_token() -> None:
    s, _ = spend()
    budget = Budget(100 * CENT, "day")
    s.add("alice", "day", 99 * CENT)
    hold = s.reserve("alice", budget, 5 * CENT, per_token=CENT, share=5)
    assert hold is not None and hold.answer_tokens == 1  # one reservation over, no more
    assert s.reserve("alice", budget, 0, per_token=CENT, share=5) is None


def test_each_period_kind_counts_apart_and_a_reload_raises_the_new_one_to_the_ledger() -> None:
    s, _ = spend()
    day = s.reserve("alice", Budget(100 * CENT, "day"), 30 * CENT)
    assert day is not None
    # A reload made it a monthly budget: the ledger says 45 cents this month.
    s.at_least("alice", "month", 45 * CENT)
    s.at_least("alice", "month", 20 * CENT)  # never lowered
    assert s.spent("alice", "month") == 45 * CENT
    s.settle(day, 10 * CENT)  # a request of the old period ends: its own count only
    assert s.spent("alice", "month") == 45 * CENT and s.spent("alice", "day") == 10 * CENT


def test_local_spend_is_awaited_as_a_shared_one_and_counts_in_memory() -> None:
    """Admission awaits one interface whatever holds the money (`Spend`): in memory it is
    `MemorySpend`'s count, the same as its own."""
    memory, _ = spend()
    local = LocalSpend(memory)
    budget = Budget(CENT, "day")

    async def body() -> None:
        assert not local.shared and local.local is memory
        hold = await local.reserve("carol", budget, CENT // 2)
        assert hold is not None and await local.spent("carol", "day") == CENT // 2
        await local.settle(hold, CENT // 4)
        await local.seed("carol", "day", CENT // 4)
        await local.at_least("carol", "day", CENT // 4)  # never lowered
        assert await local.spent("carol", "day") == memory.spent("carol", "day") == CENT // 2

    asyncio.run(body())
