"""Rate and concurrency limits, in this process: a token bucket and per-key slot counts."""

from __future__ import annotations

import time

__all__ = ["Lease", "MemoryLimits"]


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

    async def run(self) -> None:
        return None

    async def take_new_stream(self) -> float:
        """0.0 when a new stream may start, else seconds until one may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate

    async def acquire(self, key: str, limit: int) -> Lease | None:
        held = self._held.get(key, 0)
        if held >= limit:
            return None
        self._held[key] = held + 1
        self._next += 1
        return Lease(key, str(self._next))

    async def release(self, lease: Lease) -> None:
        left = self._held.get(lease.key, 0) - 1
        if left > 0:
            self._held[lease.key] = left
        else:
            self._held.pop(lease.key, None)
