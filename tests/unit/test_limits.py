"""Token budgets on a fake clock: what a reservation holds, what settling it leaves, and how far
requests that arrive together can go over a key's minute."""

from __future__ import annotations

import asyncio

from firsttoken.admission.limits import (
    OK,
    SLOTS,
    MemoryLimits,
    RequestRates,
    Reservation,
    TokenBudgets,
)
from tests.unit.clock import FakeClock

START = 6000.0  # the start of a clock minute (minute 100)


def budgets() -> tuple[TokenBudgets, FakeClock]:
    clock = FakeClock(START)
    return TokenBudgets(clock), clock


def test_a_reservation_holds_its_tokens_until_settled_with_the_real_use() -> None:
    b, _ = budgets()
    held = b.reserve("alice", 1000, 5, 200)  # prompt 5, max_tokens 200
    assert held == Reservation("alice", 205, 100, left=995)
    assert b.used("alice") == 205
    b.settle(held, 5 + 40)  # the answer stopped after 40 tokens
    assert b.used("alice") == 45
    assert b.used("bob") == 0  # per key


def test_concurrent_requests_never_hold_more_than_the_budget() -> None:
    # 20 arrive together against 100 tokens a minute, each may cost 5 + 50: the first holds
    # 55, the second what is left (5 + 40), and the rest are refused.
    b, _ = budgets()
    held = [b.reserve("k", 100, 5, 50) for _ in range(20)]
    admitted = [r for r in held if r is not None]
    assert [(r.tokens, r.left) for r in admitted] == [(55, 95), (45, 40)]
    assert b.used("k") == 100
    for r in admitted:
        b.settle(r, r.tokens)
    assert b.used("k") == 100


def test_an_answer_larger_than_the_budget_is_capped_to_what_is_left() -> None:
    # Issue 37.4: max_tokens 100,000 against 1,000 a minute held 100,005 and ran: ~100x over.
    b, _ = budgets()
    held = b.reserve("k", 1000, 5, 100_000)
    assert held is not None and held.tokens == 1000 and held.left == 995
    assert b.reserve("k", 1000, 5, 1) is None  # nothing left this minute


def test_a_prompt_that_does_not_fit_what_is_left_is_refused() -> None:
    b, _ = budgets()
    assert b.reserve("k", 100, 60, 10) is not None
    assert b.reserve("k", 100, 40, 10) is None  # 70 held: 40 + 1 do not fit
    assert b.reserve("k", 100, 29, 10) is not None  # 29 + 1 do: its answer gets 1


def test_a_key_at_its_budget_is_refused_until_the_next_minute() -> None:
    b, clock = budgets()
    assert b.reserve("k", 100, 0, 100) is not None
    assert b.reserve("k", 100, 0, 1) is None  # at the budget, not over it: still refused
    clock.advance(59.9)
    assert b.reserve("k", 100, 0, 1) is None
    clock.advance(0.1)
    assert b.used("k") == 0
    assert b.reserve("k", 100, 0, 1) is not None


def test_a_refund_makes_room_for_the_next_request() -> None:
    b, _ = budgets()
    first = b.reserve("k", 100, 5, 1024)  # no max_tokens: prompt 5 + the default 1,024
    assert first is not None and first.tokens == 100  # all that was left
    assert b.reserve("k", 100, 5, 5) is None
    b.settle(first, 0)  # refused before it ran: it used nothing
    assert b.used("k") == 0
    assert b.reserve("k", 100, 5, 5) is not None


def test_settling_a_reservation_of_a_minute_that_is_over() -> None:
    b, clock = budgets()
    short = b.reserve("k", 1000, 0, 300)
    long = b.reserve("k", 1000, 0, 300)
    assert short is not None and long is not None
    clock.advance(61)  # both answers end in the next minute
    b.settle(short, 100)  # used less than it held: nothing to take back from a minute gone
    assert b.used("k") == 0
    b.settle(long, 450)  # used 150 more than it held: those count now
    assert b.used("k") == 150


def test_settling_never_leaves_a_minute_below_zero() -> None:
    b, _ = budgets()
    held = Reservation("k", 500, 100)  # e.g. a hold whose count was lost
    b.settle(held, 0)
    assert b.used("k") == 0


def test_tokens_without_a_reservation_count_in_the_current_minute() -> None:
    b, clock = budgets()
    b.add("k", 30)
    assert b.used("k") == 30
    clock.advance(60)
    b.add("k", 7)
    assert b.used("k") == 7


def test_memory_limits_reserve_and_settle_through_their_budgets() -> None:
    async def body() -> None:
        limits = MemoryLimits(rate_per_s=0, burst=1)
        limits.budgets = TokenBudgets(FakeClock(START))
        held = await limits.reserve("k", 100, 0, 80)
        assert held is not None and held.local
        second = await limits.reserve("k", 100, 0, 80)  # 80 < 100: admitted, to 20
        assert second is not None and second.left == 20
        assert await limits.reserve("k", 100, 0, 1) is None
        await limits.settle(held, 10)
        assert limits.budgets.used("k") == 30
        verdict, _, lease = await limits.admit("k", 1)
        assert verdict == OK and lease is not None
        assert (await limits.admit("k", 1))[0] == SLOTS  # slots are apart from tokens

    asyncio.run(body())


def test_requests_per_minute_count_in_clock_minutes() -> None:
    clock = FakeClock(start=6000.0)  # a minute's start
    rates = RequestRates(clock)
    assert [rates.take("k", 2) for _ in range(2)] == [None, None]
    clock.advance(15)
    assert rates.take("k", 2) == 45.0  # refused: the next minute is 45 s away
    assert rates.take("other", 2) is None  # each key its own count
    clock.advance(45)
    assert rates.take("k", 2) is None  # a new minute
