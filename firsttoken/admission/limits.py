"""Rate and concurrency limits, in this process: a token bucket and per-key slot counts.

`admit` checks the key's slots first (a refused stream must not spend a rate token), then the
server-wide bucket; it answers (verdict, retry_after_s, lease).
"""

from __future__ import annotations

import time

__all__ = ["OK", "RATE", "SLOTS", "Lease", "MemoryLimits", "seconds_to_next_minute"]

OK, RATE, SLOTS = "ok", "rate", "slots"


class Lease:
    """One held stream slot for a key; give it back with `Limits.release`."""

    __slots__ = ("id", "key")

    def __init__(self, key: str, lease_id: str) -> None:
        self.key = key
        self.id = lease_id


class MemoryLimits:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate = rate_per_s
        self.burst = max(1, burst)
        self._tokens = float(self.burst)
        self._stamp = time.monotonic()
        self._held: dict[str, int] = {}
        self._next = 0
        self._spent: dict[str, tuple[int, int]] = {}  # key -> (minute, tokens used in it)

    async def run(self) -> None:
        return None

    async def admit(self, key: str | None, limit: int) -> tuple[str, float, Lease | None]:
        """`key` None: no per-key slots (an open server)."""
        held = self._held.get(key, 0) if key is not None else 0
        if key is not None and held >= limit:
            return SLOTS, 1.0, None
        if self.rate > 0:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            if self._tokens < 1:
                return RATE, (1 - self._tokens) / self.rate, None
            self._tokens -= 1
        if key is None:
            return OK, 0.0, None
        self._held[key] = held + 1
        self._next += 1
        return OK, 0.0, Lease(key, str(self._next))

    async def tokens_spent(self, key: str) -> int:
        """Tokens the key used in the current clock minute."""
        window, used = self._spent.get(key, (0, 0))
        return used if window == _minute() else 0

    async def spend(self, key: str, tokens: int) -> None:
        window, used = self._spent.get(key, (0, 0))
        now = _minute()
        self._spent[key] = (now, (used if window == now else 0) + tokens)

    async def release(self, lease: Lease) -> None:
        left = self._held.get(lease.key, 0) - 1
        if left > 0:
            self._held[lease.key] = left
        else:
            self._held.pop(lease.key, None)


def _minute() -> int:
    return int(time.time() // 60)


def seconds_to_next_minute() -> float:
    return 60 - time.time() % 60
