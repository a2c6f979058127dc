"""The same limits shared by every instance on one Redis, atomic through Lua scripts.

Stream slots are leases in a sorted set scored by expiry: holders refresh theirs every third
of `lease_s` (1.67 s by default), so the slots of a crashed instance free themselves within
`lease_s`.

On Redis Cluster a script's keys must share a slot. A key's slots and its token counts carry
the key's name as their hash tag; the new-stream bucket has its own. So there, admission is
two calls instead of one: the key's slots first (a lease taken), then the bucket (the lease
given back if the bucket refuses); and leases are refreshed one call per key.

While Redis is unreachable, admission **fails open to this instance's own limits**: the same
rate bucket, key slots and token budgets, kept in memory (`MemoryLimits`), so each instance
still enforces them locally and a fleet of N admits at most N times the shared limit (no
request waits on Redis meanwhile: `run` asks it every 0.25 s whether it is back). Refusing
every stream because the limit store is away would turn a Redis restart into an outage of
the whole service, while the streams themselves need nothing from Redis. Leases taken locally
stay local until released; leases held in Redis before the outage are written back (plain
ZADD) at the first refresh after it, since a restarted Redis lost them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
from prometheus_client.core import CounterMetricFamily, Metric

from firsttoken.admission.limits import OK, RATE, SLOTS, Lease, MemoryLimits, Reservation
from firsttoken.redisclient import REDIS_DOWN, Outage, redis_client
from firsttoken.telemetry.log import log_event

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

# ARGV: lease_ms, mode ('XX': only refresh; '': write back after an outage), lease ids.
_REFRESH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 3, #ARGV do
  if ARGV[2] == 'XX' then
    redis.call('ZADD', KEYS[i - 2], 'XX', now + tonumber(ARGV[1]), ARGV[i])
  else
    redis.call('ZADD', KEYS[i - 2], now + tonumber(ARGV[1]), ARGV[i])
  end
  redis.call('PEXPIRE', KEYS[i - 2], tonumber(ARGV[1]))
end
return 1
"""
# KEYS: the key's count for this minute. ARGV: budget, prompt, answer. Returns the answer
# tokens left once the prompt is held (what was held: the prompt and up to `answer` of them),
# or 0 refused. Checked and held in one step: requests that arrive together, on any instance,
# see each other's holds, so together they never hold more than the budget.
_RESERVE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local left = tonumber(ARGV[1]) - used - tonumber(ARGV[2])
if left < 1 then return 0 end
redis.call('INCRBY', KEYS[1], tonumber(ARGV[2]) + math.min(tonumber(ARGV[3]), left))
redis.call('EXPIRE', KEYS[1], 120)
return left
"""

# KEYS: the key's count for this minute. ARGV: tokens to add (negative: a hold not used).
# Never below 0: a Redis that restarted lost the holds this would take back.
_SETTLE = """
if redis.call('INCRBY', KEYS[1], ARGV[1]) < 0 then redis.call('SET', KEYS[1], 0) end
redis.call('EXPIRE', KEYS[1], 120)
return 1
"""
# KEYS: the key's request count for this minute. ARGV: limit. Returns 1 counted, 0 refused.
_REQUESTS = """
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
if count >= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], 120)
return 1
"""
_OP_TIMEOUT_S = 1.0
_ERRORS = REDIS_DOWN


def _budget(key: str, window: int) -> str:
    """The key's token count in one clock minute (a fixed one-minute window)."""
    return f"ft:tpm:{{{key}}}:{window}"


def _requests(key: str, window: int) -> str:
    """The key's request count in one clock minute (`requests_per_minute`)."""
    return f"ft:rpm:{{{key}}}:{window}"


def _slots(key: str) -> str:
    return f"ft:slots:{{{key}}}"


def _no_bucket(key: str) -> str:
    """The admission script's bucket key when only the key's slots are counted (on a
    cluster): never read, but named in the key's slot."""
    return f"ft:nobucket:{{{key}}}"


_BUCKET = "ft:{bucket}:new-streams"  # the new-stream rate, shared by every instance
_NO_KEY = "ft:{bucket}:nokey"  # its script's slots key when there are none to count


class RedisLimits:
    def __init__(
        self,
        url: str,
        rate_per_s: float,
        burst: int,
        lease_s: float = 5.0,
        *,
        max_connections: int,
        cluster: bool = False,
    ) -> None:
        self.redis = redis_client(url, max_connections=max_connections, cluster=cluster)
        self.cluster = cluster
        self.rate = rate_per_s
        self.burst = max(1, burst)
        self.lease_ms = int(lease_s * 1000)
        self._admit = self.redis.register_script(_ADMIT)
        self._refresh = self.redis.register_script(_REFRESH)
        self._reserve = self.redis.register_script(_RESERVE)
        self._settle = self.redis.register_script(_SETTLE)
        self._requests = self.redis.register_script(_REQUESTS)
        self._held: dict[str, Lease] = {}
        self.local = MemoryLimits(rate_per_s, burst)  # the fallback while Redis is away
        self._local_leases: set[str] = set()
        self.outage = Outage()  # shared with the money budgets (`RedisSpend`)
        self.fallbacks = 0  # admission decisions taken locally

    @property
    def degraded(self) -> str | None:
        return None if self.outage.up else "redis_limits"

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "firsttoken_redis_limits_fallback",
            "Admission decisions taken with this instance's own limits: Redis was unreachable.",
        )
        family.add_metric([], self.fallbacks)
        yield family

    def _down(self, exc: BaseException) -> None:
        if self.outage.failed():
            log_event("redis.limits_fallback", logging.ERROR, error=repr(exc))

    def _back(self) -> None:
        if self.outage.answered():
            log_event("redis.limits_back")

    async def run(self) -> None:
        """Refresh this instance's leases until cancelled; while Redis is away, ask it every
        `Outage.PROBE_S` whether it is back (no request waits on it meanwhile), then write
        back the leases a restarted Redis lost."""
        try:
            while True:
                await anyio.sleep(self.lease_ms / 3000 if self.outage.up else Outage.PROBE_S)
                write_back = not self.outage.up  # a restarted Redis lost the leases it held
                if write_back and not await self.probe():
                    continue
                if self._held:
                    await self._refresh_leases("" if write_back else "XX")
        finally:
            with anyio.CancelScope(shield=True):
                await self.redis.aclose()

    async def _refresh_leases(self, mode: str) -> None:
        leases = list(self._held.values())
        # On a cluster one call per key (its slot); else one call for all.
        groups: dict[str, list[Lease]] = {}
        for le in leases:
            groups.setdefault(le.key if self.cluster else "", []).append(le)
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                for group in groups.values():
                    await self._refresh(
                        keys=[_slots(le.key) for le in group],
                        args=[self.lease_ms, mode, *(le.id for le in group)],
                    )
        except _ERRORS as exc:
            self._down(exc)
            log_event("redis.lease_refresh_failed", logging.WARNING, error=repr(exc))

    async def probe(self) -> bool:
        """Whether Redis answers now (and, if so, it is up again)."""
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                await self.redis.ping()
        except _ERRORS:
            return False
        self._back()
        return True

    async def admit(self, key: str | None, limit: int) -> tuple[str, float, Lease | None]:
        """One round trip: the key's slots, then the shared bucket, atomically; this
        instance's own limits while Redis is unreachable."""
        if key is None and self.rate <= 0:
            return OK, 0.0, None  # nothing shared to count: no round trip
        lease = Lease(key, uuid.uuid4().hex) if key is not None else None
        try:
            self.outage.check()
            with anyio.fail_after(_OP_TIMEOUT_S):
                if self.cluster:
                    verdict, retry = await self._admit_apart(key, limit, lease)
                else:
                    verdict, retry = await self._admit(
                        keys=[_BUCKET, _slots(key) if key is not None else _NO_KEY],
                        args=[
                            self.rate,
                            self.burst,
                            limit if key is not None else 0,
                            self.lease_ms,
                            lease.id if lease else "",
                        ],
                    )
        except _ERRORS as exc:
            self._down(exc)
            self.fallbacks += 1
            answer = await self.local.admit(key, limit)
            if answer[2] is not None:
                self._local_leases.add(answer[2].id)
            return answer
        self._back()
        verdict = int(verdict)
        if verdict == 2:
            return SLOTS, 1.0, None
        if verdict == 1:
            return RATE, float(retry), None
        if lease is not None:
            self._held[lease.id] = lease
        return OK, 0.0, lease

    async def _admit_apart(
        self, key: str | None, limit: int, lease: Lease | None
    ) -> tuple[Any, Any]:
        """Admission on a cluster: the key's slots, then the bucket, each in its own slot."""
        if key is not None and lease is not None:
            verdict, retry = await self._admit(
                keys=[_no_bucket(key), _slots(key)],
                args=[0, self.burst, limit, self.lease_ms, lease.id],
            )
            if int(verdict) != 0 or self.rate <= 0:
                return verdict, retry
        verdict, retry = await self._admit(
            keys=[_BUCKET, _NO_KEY], args=[self.rate, self.burst, 0, self.lease_ms, ""]
        )
        if int(verdict) != 0 and key is not None and lease is not None:
            await self.redis.zrem(_slots(key), lease.id)  # the bucket refused: give it back
        return verdict, retry

    async def reserve(self, key: str, budget: int, prompt: int, answer: int) -> Reservation | None:
        """`TokenBudgets.reserve` in Redis (what this instance used while Redis was away
        counts too); in this instance alone while Redis is unreachable."""
        budgets = self.local.budgets
        window = budgets.minute()
        try:
            self.outage.check()
            with anyio.fail_after(_OP_TIMEOUT_S):
                left = int(
                    await self._reserve(
                        keys=[_budget(key, window)],
                        args=[budget - budgets.used(key), prompt, answer],
                    )
                )
        except _ERRORS as exc:
            self._down(exc)
            self.fallbacks += 1
            return budgets.reserve(key, budget, prompt, answer)
        self._back()
        if left < 1:
            return None
        return Reservation(key, prompt + min(answer, left), window, local=False, left=left)

    async def count_request(self, key: str, limit: int) -> float | None:
        """`RequestRates.take` in Redis, shared by every instance; in this instance alone while
        Redis is unreachable."""
        now = time.time()
        try:
            self.outage.check()
            with anyio.fail_after(_OP_TIMEOUT_S):
                counted = int(
                    await self._requests(keys=[_requests(key, int(now // 60))], args=[limit])
                )
        except _ERRORS as exc:
            self._down(exc)
            self.fallbacks += 1
            return self.local.requests.take(key, limit)
        self._back()
        return None if counted else 60 - now % 60

    async def settle(self, reservation: Reservation, used: int) -> None:
        """Correct the hold by what the request used (`TokenBudgets.settle`'s rule), where it
        was taken; what Redis cannot take now is billed in this instance."""
        if reservation.local:
            self.local.budgets.settle(reservation, used)
            return
        excess = used - reservation.tokens
        window = self.local.budgets.minute()
        if reservation.window != window and excess <= 0:
            return
        try:
            self.outage.check()
            with anyio.fail_after(_OP_TIMEOUT_S):
                await self._settle(keys=[_budget(reservation.key, window)], args=[excess])
        except _ERRORS as exc:
            self._down(exc)
            if excess > 0:
                self.local.budgets.add(reservation.key, excess)
        else:
            self._back()

    async def release(self, lease: Lease) -> None:
        if lease.id in self._local_leases:
            self._local_leases.discard(lease.id)
            await self.local.release(lease)
            return
        self._held.pop(lease.id, None)
        try:
            self.outage.check()
            with anyio.fail_after(_OP_TIMEOUT_S):
                await self.redis.zrem(_slots(lease.key), lease.id)
        except _ERRORS as exc:
            self._down(exc)  # the lease is no longer refreshed: it frees itself within lease_s
        else:
            self._back()
