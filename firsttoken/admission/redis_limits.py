"""The same limits shared by every instance on one Redis, atomic through Lua scripts.

Stream slots are leases in a sorted set scored by expiry: holders refresh theirs every
second, so the slots of a crashed instance free themselves within `lease_s`.
"""

from __future__ import annotations

import logging
import time
import uuid

import anyio
from redis.asyncio import Redis

from firsttoken.admission.limits import OK, RATE, SLOTS, Lease
from firsttoken.observability import log_event

__all__ = ["RedisLimits"]

# KEYS: bucket, slots (or a dummy when no key). ARGV: rate, burst, limit (0: no slots),
# lease_ms, lease_id. Returns {verdict, retry_after_s}: 0 ok, 1 rate, 2 slots.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local now_ms = math.floor(now * 1000)
local rate, burst, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lease_ms = tonumber(ARGV[4])
if limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  if redis.call('ZCARD', KEYS[2]) >= limit then return {2, '1'} end
end
if rate > 0 then
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(b[1]) or burst
  local ts = tonumber(b[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
  if tokens < 1 then return {1, tostring((1 - tokens) / rate)} end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
end
if limit > 0 then
  redis.call('ZADD', KEYS[2], now_ms + lease_ms, ARGV[5])
  redis.call('PEXPIRE', KEYS[2], lease_ms)
end
return {0, '0'}
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


def _budget(key: str) -> str:
    """This clock minute's token count for the key (a fixed one-minute window)."""
    return f"ft:tpm:{{{key}}}:{int(time.time() // 60)}"


def _slots(key: str) -> str:
    return f"ft:slots:{{{key}}}"


class RedisLimits:
    def __init__(self, url: str, rate_per_s: float, burst: int, lease_s: float = 5.0) -> None:
        self.redis: Redis = Redis.from_url(url)
        self.rate = rate_per_s
        self.burst = max(1, burst)
        self.lease_ms = int(lease_s * 1000)
        self._admit = self.redis.register_script(_ADMIT)
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

    async def admit(self, key: str | None, limit: int) -> tuple[str, float, Lease | None]:
        """One round trip: the key's slots, then the shared bucket, atomically."""
        lease = Lease(key, uuid.uuid4().hex) if key is not None else None
        verdict, retry = await self._admit(
            keys=["ft:bucket:new-streams", _slots(key) if key is not None else "ft:nokey"],
            args=[
                self.rate,
                self.burst,
                limit if key is not None else 0,
                self.lease_ms,
                lease.id if lease else "",
            ],
        )
        verdict = int(verdict)
        if verdict == 2:
            return SLOTS, 1.0, None
        if verdict == 1:
            return RATE, float(retry), None
        if lease is not None:
            self._held[lease.id] = lease
        return OK, 0.0, lease

    async def tokens_spent(self, key: str) -> int:
        used = await self.redis.get(_budget(key))
        return int(used) if used else 0

    async def spend(self, key: str, tokens: int) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.incrby(_budget(key), tokens)
            pipe.expire(_budget(key), 120)
            await pipe.execute()

    async def release(self, lease: Lease) -> None:
        self._held.pop(lease.id, None)
        await self.redis.zrem(_slots(lease.key), lease.id)
