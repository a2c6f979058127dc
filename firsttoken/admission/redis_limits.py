"""The same limits shared by every instance on one Redis, atomic through Lua scripts.

Stream slots are leases in a sorted set scored by expiry: holders refresh theirs every
second, so the slots of a crashed instance free themselves within `lease_s`.
"""

from __future__ import annotations

import logging
import uuid

import anyio
from redis.asyncio import Redis

from firsttoken.admission.limits import Lease
from firsttoken.observability import log_event

__all__ = ["RedisLimits"]

_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1]) or burst
local ts = tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed = 0
if tokens >= 1 then tokens = tokens - 1; allowed = 1 end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, tostring(tokens)}
"""

_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
  return 1
end
return 0
"""

_REFRESH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[i - 1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
  redis.call('PEXPIRE', KEYS[i - 1], tonumber(ARGV[1]))
end
return 1
"""


def _slots(key: str) -> str:
    return f"ft:slots:{{{key}}}"


class RedisLimits:
    def __init__(self, url: str, rate_per_s: float, burst: int, lease_s: float = 5.0) -> None:
        self.redis: Redis = Redis.from_url(url)
        self.rate = rate_per_s
        self.burst = max(1, burst)
        self.lease_ms = int(lease_s * 1000)
        self._bucket = self.redis.register_script(_BUCKET)
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._refresh = self.redis.register_script(_REFRESH)
        self._held: dict[str, Lease] = {}

    async def run(self) -> None:
        """Refresh this instance's leases until cancelled."""
        try:
            while True:
                await anyio.sleep(self.lease_ms / 3000)
                if not self._held:
                    continue
                leases = list(self._held.values())
                try:
                    await self._refresh(
                        keys=[_slots(le.key) for le in leases],
                        args=[self.lease_ms, *(le.id for le in leases)],
                    )
                except Exception as exc:
                    log_event("redis.lease_refresh_failed", logging.WARNING, error=repr(exc))
        finally:
            with anyio.CancelScope(shield=True):
                await self.redis.aclose()

    async def take_new_stream(self) -> float:
        if self.rate <= 0:
            return 0.0
        allowed, tokens = await self._bucket(
            keys=["ft:bucket:new-streams"], args=[self.rate, self.burst]
        )
        if int(allowed):
            return 0.0
        return (1 - float(tokens)) / self.rate

    async def acquire(self, key: str, limit: int) -> Lease | None:
        lease = Lease(key, uuid.uuid4().hex)
        if not int(await self._acquire(keys=[_slots(key)], args=[limit, self.lease_ms, lease.id])):
            return None
        self._held[lease.id] = lease
        return lease

    async def release(self, lease: Lease) -> None:
        self._held.pop(lease.id, None)
        await self.redis.zrem(_slots(lease.key), lease.id)
