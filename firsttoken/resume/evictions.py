"""Whether Redis may evict keys of ours, and how many it did.

A lost spend counter admits a key over its money budget again, and nothing else would tell:
the policy is read once at start (a warning if it evicts), and under such a policy Redis's
count of evicted keys is read every `EVERY` heartbeats (an eviction may have taken a spend
counter, a slot or a stream).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from firsttoken.redisclient import REDIS_DOWN, AnyRedis, eviction_risk
from firsttoken.resume.health import OP_TIMEOUT_S
from firsttoken.telemetry.log import log_event

__all__ = ["EVERY", "Evictions", "values_of"]

EVERY = 5  # heartbeats between two looks at Redis's evicted keys


def values_of(found: Any, name: str) -> set[str]:
    """The values of `name` in a CONFIG GET reply: one node's {name: value}, or a cluster's
    {node: {name: value}}; bytes or str, as the client decodes."""
    out: set[str] = set()
    if isinstance(found, dict):
        for key, value in found.items():
            if isinstance(value, dict):
                out |= values_of(value, name)
            elif (key.decode() if isinstance(key, bytes) else key) == name:
                out.add(value.decode() if isinstance(value, bytes) else str(value))
    return out


class Evictions:
    """Redis's `maxmemory-policy` (`policy`, where it says) and the keys it evicted since this
    instance started (`evicted`: counted under a policy that evicts only)."""

    def __init__(self, redis: AnyRedis) -> None:
        self.redis = redis
        self.policy: str | None = None
        self.evicted = 0
        self.seen: int | None = None  # Redis's evicted_keys at the last look; None: no looks
        self._beats = 0

    async def check_policy(self) -> None:
        """Say at start, once, that Redis may evict keys of ours."""
        try:
            if isinstance(self.redis, RedisCluster):
                found = await self.redis.config_get(
                    "maxmemory-policy", target_nodes=RedisCluster.PRIMARIES
                )
            else:
                found = await self.redis.config_get("maxmemory-policy")
        except ResponseError:  # CONFIG refused (a managed Redis): its docs name the policy
            return
        policies = sorted(values_of(found, "maxmemory-policy"))
        risky = [p for p in policies if eviction_risk(p) is not None]
        self.policy = risky[0] if risky else (policies[0] if policies else None)
        if not risky:
            return
        log_event(
            "redis.eviction_policy",
            logging.WARNING,
            policy=risky[0],
            may_evict=eviction_risk(risky[0]),
            fix="CONFIG SET maxmemory-policy noeviction (docs/deploy.md)",
        )
        self.seen = await self.evicted_keys()

    async def evicted_keys(self) -> int:
        if isinstance(self.redis, RedisCluster):
            found = await self.redis.info("stats", target_nodes=RedisCluster.PRIMARIES)
            return sum(int(info.get("evicted_keys", 0)) for info in found.values())
        return int((await self.redis.info("stats")).get("evicted_keys", 0))

    async def on_beat(self) -> None:
        """A heartbeat went through: every `EVERY`th, count what was evicted since."""
        self._beats += 1
        if self.seen is not None and self._beats % EVERY == 0:
            await self.count()

    async def count(self) -> None:
        """Log the keys evicted since the last look."""
        seen = self.seen
        assert seen is not None
        try:
            with anyio.fail_after(OP_TIMEOUT_S):
                now = await self.evicted_keys()
        except (*REDIS_DOWN, ResponseError):
            return
        self.seen = now
        grew = now - seen if now >= seen else now  # less: Redis restarted, its count anew
        if grew:
            self.evicted += grew
            log_event(
                "redis.keys_evicted",
                logging.WARNING,
                evicted=grew,
                policy=self.policy,
                may_evict=eviction_risk(self.policy or ""),
            )
