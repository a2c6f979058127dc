"""Money budgets shared by every instance on one Redis (`spend.py`'s rules, in Lua).

A key's spend in one period is one integer of picos, `ft:spend:{KEY}:PERIOD`: checked and
held in one script, so requests arriving together on any instance see each other's holds.
While Redis is unreachable each instance holds and settles in its own memory (as the other
limits fail open, `redis_limits.py`): a fleet of N may then spend up to N times what is left,
and budgets are still enforced. What Redis could not take when a request ended is kept in
this instance. It shares the limits' client and their `Outage`: while Redis is away no call
waits on it, and the limits' probe says when it is back.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from firsttoken.admission.spend import Budget, MemorySpend, SpendHold, period_of
from firsttoken.redisclient import REDIS_DOWN, Outage
from firsttoken.telemetry.log import log_event

__all__ = ["RedisSpend"]

# KEYS: the key's spend this period. ARGV: amount, hold, ttl_s (0: none), per_token, share.
# Returns -1 refused (nothing left), 0 held, or an open-ended answer's cap (per_token > 0:
# `share_of_left`, held on top of ARGV[2]). Picos are exact in Lua's doubles below 2^53
# (9,007 of a currency).
_RESERVE = """
local left = tonumber(ARGV[1]) - tonumber(redis.call('GET', KEYS[1]) or '0')
if left <= 0 then return -1 end
redis.call('INCRBY', KEYS[1], ARGV[2])
local per_token = tonumber(ARGV[4])
local tokens = 0
if per_token > 0 then
  tokens = math.floor((left - tonumber(ARGV[2])) / tonumber(ARGV[5]) / per_token)
  if tokens < 1 then tokens = 1 end
  redis.call('INCRBY', KEYS[1], string.format('%.0f', tokens * per_token))
end
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return tokens
"""
# KEYS: the key's spend in a period. ARGV: picos to add (negative: a hold not used), ttl_s.
_SETTLE = """
if redis.call('INCRBY', KEYS[1], ARGV[1]) < 0 then redis.call('SET', KEYS[1], 0) end
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 1
"""
# KEYS: the key's spend in a period. ARGV: picos it spent at least, ttl_s.
_AT_LEAST = """
local spent = tonumber(redis.call('GET', KEYS[1]) or '0')
if spent < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 1
"""
_OP_TIMEOUT_S = 1.0
# Kept a little past the period's end (a settle may arrive just after it).
_TTL_S = {"day": 2 * 86400, "month": 33 * 86400, "total": 0}


def _spend_key(key: str, period: str) -> str:
    return f"ft:spend:{{{key}}}:{period}"


class RedisSpend:
    shared = True  # the periods' counts are every instance's: a scrape reads them back

    def __init__(self, redis: Any, outage: Outage, local: MemorySpend | None = None) -> None:
        self.redis = redis
        self.local = local or MemorySpend()
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)
        self._at_least = redis.register_script(_AT_LEAST)
        self.outage = outage

    def _down(self, exc: BaseException) -> None:
        if self.outage.failed():
            log_event("redis.spend_fallback", logging.ERROR, error=repr(exc))

    async def reserve(
        self, key: str, budget: Budget, picos: int, per_token: int = 0, share: int = 1
    ) -> SpendHold | None:
        """`MemorySpend.reserve`, fleet-wide."""
        period, _ = period_of(budget.per, self.local.clock())
        # What this instance spent while Redis was away counts against the amount too.
        amount = budget.amount - self.local.spent(key, budget.per)
        try:
            self.outage.check()
            with anyio.fail_after(_OP_TIMEOUT_S):
                held = int(
                    await self._reserve(
                        keys=[_spend_key(key, period)],
                        args=[amount, picos, _TTL_S[budget.per], per_token, share],
                    )
                )
        except REDIS_DOWN as exc:
            self._down(exc)
            return self.local.reserve(key, budget, picos, per_token, share)
        self.outage.answered()
        if held < 0:
            return None
        if held == 0:
            return SpendHold(key, budget.per, period, picos, local=False)
        hold = picos + held * per_token
        return SpendHold(key, budget.per, period, hold, local=False, answer_tokens=held)

    async def settle(self, hold: SpendHold, cost: int) -> None:
        if hold.local:
            self.local.settle(hold, cost)
            return
        period, _ = period_of(hold.per, self.local.clock())
        excess = cost - hold.picos
        if hold.period != period and excess <= 0:
            return
        try:
            self.outage.check()
            with anyio.fail_after(_OP_TIMEOUT_S):
                await self._settle(
                    keys=[_spend_key(hold.key, period)], args=[excess, _TTL_S[hold.per]]
                )
        except REDIS_DOWN as exc:
            self._down(exc)
            if excess > 0:
                self.local.add(hold.key, hold.per, excess)

    async def spent(self, key: str, per: str) -> int:
        """The key's spend in its current period, fleet-wide (0 while Redis is away)."""
        period, _ = period_of(per, self.local.clock())
        try:
            self.outage.check()
            with anyio.fail_after(_OP_TIMEOUT_S):
                value = await self.redis.get(_spend_key(key, period))
        except REDIS_DOWN:
            return self.local.spent(key, per)
        return int(value or 0) + self.local.spent(key, per)

    async def seed(self, key: str, per: str, picos: int) -> None:
        """The ledger's count, where Redis has none yet (a fresh Redis, at start)."""
        period, _ = period_of(per, self.local.clock())
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                await self.redis.set(_spend_key(key, period), picos, nx=True)
        except REDIS_DOWN as exc:
            self._down(exc)

    async def at_least(self, key: str, per: str, picos: int) -> None:
        """`MemorySpend.at_least`, fleet-wide: every instance that reloads raises it alike."""
        period, _ = period_of(per, self.local.clock())
        try:
            self.outage.check()
            with anyio.fail_after(_OP_TIMEOUT_S):
                await self._at_least(keys=[_spend_key(key, period)], args=[picos, _TTL_S[per]])
        except REDIS_DOWN as exc:
            self._down(exc)
            self.local.at_least(key, per, picos)
