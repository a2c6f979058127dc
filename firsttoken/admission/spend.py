"""Budgets in money: what a key may spend per UTC day, per UTC month, or in total.

Held two-phase, as `tokens_per_minute` is (limits.py): a request reserves its worst case when
it is admitted (its prompt and its `max_tokens` at the most expensive prices its route may
use), and its ticket settles the reservation to what was delivered when it ends. Admission
goes on while anything is left of the period: the check and the hold are one step, so of
requests racing for the last cents one gets through, and the period's spend ends at most one
reservation over its amount (every other request then finds nothing left).

An answer that names no `max_tokens` has no worst case of its own, so it gets one: its hold
is its prompt plus a `share` of what is left after it (1/`max_streams`: the key's streams can
all run at once), and its answer may run only to the tokens that share buys at the dearest
answer price (`SpendHold.answer_tokens`, which admission makes its `max_tokens`). Its hold is
then its worst case too, and the bound above holds for it.

Amounts are picos (`pricing.py`): integers, exact, the same in Redis. Periods are calendar
periods in UTC on the clock passed in: a day from 00:00, a month from its first day; `total`
never resets. A reservation counts in the period it was made in; settled after that period
ended, only what it cost beyond the reservation is added, to the current period (money spent
still counts somewhere; a reservation that was too large frees nothing in a period gone).
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from firsttoken.pricing import parse_money, to_picos

__all__ = [
    "PERIODS",
    "Budget",
    "LocalSpend",
    "MemorySpend",
    "Spend",
    "SpendHold",
    "parse_budget",
    "period_of",
    "period_start",
    "share_of_left",
]

PERIODS = ("day", "month", "total")
# `total` never resets: a client told to come back gets a day (the operator must raise it).
TOTAL_RETRY_S = 86400.0


@dataclass(frozen=True, slots=True)
class Budget:
    amount: int  # picos
    per: str  # day | month | total


def parse_budget(raw: object, where: str) -> Budget:
    """`budget = { amount = 25.00, per = "day" }` from a keys file; ValueError naming `where`."""
    if not isinstance(raw, Mapping):
        raise ValueError(f'{where} must be an inline table {{ amount = 25.00, per = "day" }}')
    unknown = sorted(set(raw) - {"amount", "per"})
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown field (known: amount, per)")
    if "amount" not in raw:
        raise ValueError(f"{where}.amount is required")
    amount = parse_money(raw["amount"], f"{where}.amount")
    per = raw.get("per", "day")
    if per not in PERIODS:
        raise ValueError(f"{where}.per must be one of {', '.join(PERIODS)}, not {per!r}")
    return Budget(to_picos(amount), str(per))


def period_of(per: str, now: float) -> tuple[str, float]:
    """The period `now` (Unix seconds) falls in, by name ("2026-12-02", "2026-12", "total"),
    and the seconds until the next one begins (`TOTAL_RETRY_S` for `total`)."""
    if per == "total":
        return "total", TOTAL_RETRY_S
    t = datetime.fromtimestamp(now, UTC)
    if per == "day":
        return t.strftime("%Y-%m-%d"), 86400.0 - (now % 86400.0)
    days = calendar.monthrange(t.year, t.month)[1]
    start = calendar.timegm((t.year, t.month, 1, 0, 0, 0))
    return t.strftime("%Y-%m"), start + days * 86400.0 - now


def period_start(per: str, now: float) -> float:
    """When the period `now` falls in began (Unix seconds; 0 for `total`)."""
    if per == "total":
        return 0.0
    if per == "day":
        return now - now % 86400.0
    t = datetime.fromtimestamp(now, UTC)
    return float(calendar.timegm((t.year, t.month, 1, 0, 0, 0)))


@dataclass(frozen=True, slots=True)
class SpendHold:
    """Money held against a key's budget for one request until it ends."""

    key: str
    per: str
    period: str  # the period it counts in
    picos: int
    local: bool = True  # held in this process (with Redis: taken while Redis was away)
    # An open-ended answer's cap: the tokens its hold buys (`share_of_left`); None: no cap.
    answer_tokens: int | None = None


def share_of_left(left: int, prompt: int, per_token: int, share: int) -> int:
    """The answer tokens an open-ended request may run to: `1/share` of what is left of the
    period (`left` picos) after its prompt's worst cost, at `per_token` picos a token; at
    least 1 (admitted while anything is left, as every request is)."""
    return max(1, (left - prompt) // share // per_token)


class MemorySpend:
    """What each key spent (or holds) in its current period, in this process."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        # (key, per) -> (period, picos): per `per`, so a reload that changes a key's period
        # leaves the new one's count apart from what requests of the old one still settle.
        self._spent: dict[tuple[str, str], tuple[str, int]] = {}

    def spent(self, key: str, per: str) -> int:
        period, _ = period_of(per, self.clock())
        held_period, picos = self._spent.get((key, per), ("", 0))
        return picos if held_period == period else 0

    def reserve(
        self, key: str, budget: Budget, picos: int, per_token: int = 0, share: int = 1
    ) -> SpendHold | None:
        """Hold `picos` when anything is left of the key's period; None when nothing is.
        `per_token` > 0: an open-ended answer at that dearest price, held and capped to its
        `share` of what is left (`share_of_left`)."""
        spent = self.spent(key, budget.per)
        if spent >= budget.amount:
            return None
        tokens = None
        if per_token > 0:
            tokens = share_of_left(budget.amount - spent, picos, per_token, share)
            picos += tokens * per_token
        period, _ = period_of(budget.per, self.clock())
        self._spent[key, budget.per] = (period, spent + picos)
        return SpendHold(key, budget.per, period, picos, answer_tokens=tokens)

    def settle(self, hold: SpendHold, cost: int) -> None:
        """The request ended having cost `cost` picos."""
        period, _ = period_of(hold.per, self.clock())
        excess = cost - hold.picos
        if hold.period == period or excess > 0:
            self.add(hold.key, hold.per, excess)

    def add(self, key: str, per: str, picos: int) -> None:
        """Spent without a reservation (or a correction of one): to the current period."""
        period, _ = period_of(per, self.clock())
        held_period, held = self._spent.get((key, per), ("", 0))
        self._spent[key, per] = (period, max(0, (held if held_period == period else 0) + picos))

    def seed(self, key: str, per: str, picos: int) -> None:
        """What the ledger says the key spent in its current period (at start), added to
        what requests admitted since the start hold."""
        self.add(key, per, picos)

    def at_least(self, key: str, per: str, picos: int) -> None:
        """The key's period has spent at least `picos` (the ledger's count, when a reload
        changes its `per`): raised to it, never lowered (what it counts may hold more)."""
        if self.spent(key, per) < picos:
            self.add(key, per, picos - self.spent(key, per))


class Spend(Protocol):
    """Where admission holds and settles money: in this process (`LocalSpend`) or shared by
    every instance (`redis_spend.RedisSpend`). One interface, so admission never asks which;
    `local` is this process's own count (the clock, and with Redis what it holds while Redis
    is away)."""

    local: MemorySpend
    shared: bool  # with other instances: the periods' counts live elsewhere (read back)

    async def reserve(
        self, key: str, budget: Budget, picos: int, per_token: int = 0, share: int = 1
    ) -> SpendHold | None: ...

    async def settle(self, hold: SpendHold, cost: int) -> None: ...

    async def spent(self, key: str, per: str) -> int: ...

    async def seed(self, key: str, per: str, picos: int) -> None: ...

    async def at_least(self, key: str, per: str, picos: int) -> None: ...


class LocalSpend:
    """`MemorySpend` as a `Spend`: this process's count, awaited like a shared one's."""

    shared = False

    def __init__(self, local: MemorySpend | None = None) -> None:
        self.local = local or MemorySpend()

    async def reserve(
        self, key: str, budget: Budget, picos: int, per_token: int = 0, share: int = 1
    ) -> SpendHold | None:
        return self.local.reserve(key, budget, picos, per_token, share)

    async def settle(self, hold: SpendHold, cost: int) -> None:
        self.local.settle(hold, cost)

    async def spent(self, key: str, per: str) -> int:
        return self.local.spent(key, per)

    async def seed(self, key: str, per: str, picos: int) -> None:
        self.local.seed(key, per, picos)

    async def at_least(self, key: str, per: str, picos: int) -> None:
        self.local.at_least(key, per, picos)
