"""Rate, concurrency and token limits, in this process: a token bucket, per-key slot counts
and per-key token budgets.

`admit` checks the key's slots first (a refused stream must not spend a rate token), then the
server-wide bucket; it answers (verdict, retry_after_s, lease).

Token budgets (`tokens_per_minute`) are two-phase. At admission a request reserves what it may
cost, its prompt plus its `max_tokens` (`DEFAULT_ANSWER_TOKENS` when it names none), but never
more than what is left of the key's minute: its answer is capped to that (`Reservation.left`,
which admission makes the request's `max_tokens`), and it is refused when not even its prompt
and one token fit. At its end the reservation is settled with what it really used. The check
and the reservation are one step, so requests that arrive together see each other's
reservations, however many arrive at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = [
    "OK",
    "RATE",
    "SLOTS",
    "Lease",
    "MemoryLimits",
    "RequestRates",
    "Reservation",
    "TokenBudgets",
    "seconds_to_next_minute",
]


OK, RATE, SLOTS = "ok", "rate", "slots"


class Lease:
    """One held stream slot for a key; give it back with `Limits.release`."""

    __slots__ = ("id", "key")

    def __init__(self, key: str, lease_id: str) -> None:
        self.key = key
        self.id = lease_id


@dataclass(frozen=True, slots=True)
class Reservation:
    """Tokens held against a key's budget for one request until it ends."""

    key: str
    tokens: int
    window: int  # the clock minute it counts in
    local: bool = True  # held in this process (with Redis: taken while Redis was away)
    # The answer tokens left of the minute once the prompt was held: the most the request's
    # answer may run to (its max_tokens is lowered to this). 0: no cap was asked for.
    left: int = 0


class TokenBudgets:
    """Tokens used per key in fixed clock-minute windows: reserve, then settle.

    A reservation counts in the minute it was made. Settling corrects that minute by what the
    request really used; once that minute is over, only what it used beyond the reservation
    is added, to the current minute (tokens nobody reserved still count somewhere, and a
    reservation that was too large frees nothing in a minute already gone).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._used: dict[str, tuple[int, int]] = {}  # key -> (minute, tokens used in it)

    def minute(self) -> int:
        return int(self.clock() // 60)

    def used(self, key: str) -> int:
        """Tokens the key used or holds in the current clock minute."""
        window, used = self._used.get(key, (0, 0))
        return used if window == self.minute() else 0

    def reserve(self, key: str, budget: int, prompt: int, answer: int) -> Reservation | None:
        """Hold the prompt and up to `answer` tokens of answer, no more than what is left of
        the key's minute under `budget`; None when not even the prompt and one token fit."""
        used = self.used(key)
        left = budget - used - prompt
        if left < 1:
            return None
        tokens = prompt + min(answer, left)
        now = self.minute()
        self._used[key] = (now, used + tokens)
        return Reservation(key, tokens, now, left=left)

    def settle(self, reservation: Reservation, used: int) -> None:
        """The request ended having used `used` tokens."""
        now, excess = self.minute(), used - reservation.tokens
        if reservation.window == now or excess > 0:
            self._add(reservation.key, now, excess)

    def add(self, key: str, tokens: int) -> None:
        """Tokens used without a reservation (billed to the current minute)."""
        self._add(key, self.minute(), tokens)

    def _add(self, key: str, now: int, tokens: int) -> None:
        window, held = self._used.get(key, (0, 0))
        self._used[key] = (now, max(0, (held if window == now else 0) + tokens))


class RequestRates:
    """Requests per key in fixed clock-minute windows (`requests_per_minute`), as the token
    budgets count: the check and the count are one step."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._count: dict[str, tuple[int, int]] = {}  # key -> (minute, requests in it)

    def take(self, key: str, limit: int) -> float | None:
        """Count one request of `key`; None when it is within `limit` for this minute, else
        the seconds until the next minute (and it is not counted)."""
        now = self.clock()
        minute = int(now // 60)
        window, count = self._count.get(key, (minute, 0))
        if window != minute:
            count = 0
        if count >= limit:
            return 60 - now % 60
        self._count[key] = (minute, count + 1)
        return None


class MemoryLimits:
    degraded: str | None = None  # nothing to lose: no Redis

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate = rate_per_s
        self.burst = max(1, burst)
        self._tokens = float(self.burst)
        self._stamp = time.monotonic()
        self._held: dict[str, int] = {}
        self._next = 0
        self.budgets = TokenBudgets()
        self.requests = RequestRates()

    async def run(self) -> None:
        return None

    def collect(self) -> Iterator[Metric]:
        return iter(())  # nothing of its own to scrape

    async def admit(self, key: str | None, limit: int) -> tuple[str, float, Lease | None]:
        """`key` None: no per-key slots (an open server)."""
        held = self._held.get(key, 0) if key is not None else 0
        if key is not None and held >= limit:
            return SLOTS, 1.0, None
        wait = self.take_rate()
        if wait is not None:
            return RATE, wait, None
        if key is None:
            return OK, 0.0, None
        self._held[key] = held + 1
        self._next += 1
        return OK, 0.0, Lease(key, str(self._next))

    def take_rate(self) -> float | None:
        """One new stream from the server's bucket: None, or the seconds until there is one
        (and none is taken). Without keys that is all `admit` asks, at once."""
        if self.rate <= 0:
            return None
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens < 1:
            return (1 - self._tokens) / self.rate
        self._tokens -= 1
        return None

    async def reserve(self, key: str, budget: int, prompt: int, answer: int) -> Reservation | None:
        return self.budgets.reserve(key, budget, prompt, answer)

    async def count_request(self, key: str, limit: int) -> float | None:
        """`RequestRates.take`: None, or the seconds to wait."""
        return self.requests.take(key, limit)

    async def settle(self, reservation: Reservation, used: int) -> None:
        self.budgets.settle(reservation, used)

    async def release(self, lease: Lease) -> None:
        left = self._held.get(lease.key, 0) - 1
        if left > 0:
            self._held[lease.key] = left
        else:
            self._held.pop(lease.key, None)


def seconds_to_next_minute() -> float:
    return 60 - time.time() % 60
