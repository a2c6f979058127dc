"""Dead instances' streams that no reader took over: ended and billed by one survivor.

Every `SWEEP_EVERY_S` a survivor looks at which instances of `ft:instances` heartbeat no more
(`dead_instances`: a key missing for `OWNER_GONE_S`); of each dead one, the survivor whose
`SREM` took it out of the set sweeps its streams (`ft:{g}:owned:<n>`), after `grace_s`, time
for a reader that resumes by itself to come back and take its stream over. Each stream is
one Lua call (`SWEEP`, atomic with the claims: it ends the stream only while the dead owner
still holds it unended, and raises its fence), then its events' token counts are read and
billed (`bill`). A sweep cut short puts the dead instance back for another survivor.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, cast

import anyio
from anyio.abc import TaskGroup

from firsttoken.redisclient import REDIS_DOWN, AnyRedis, RawEntries
from firsttoken.resume.health import OP_TIMEOUT_S, Health
from firsttoken.resume.heartbeat import INSTANCES, OWNER_GONE_S, instance_key
from firsttoken.resume.redis_keys import TAGS, events_key, meta_key, owned_key
from firsttoken.resume.runs import decode_run, run_first
from firsttoken.resume.store import BillOrphaned, Orphaned
from firsttoken.telemetry.log import log_event

__all__ = ["SWEEP", "Sweeper", "dead_instances", "tokens_held"]

# A dead instance's streams are ended this many at a time (a Lua call each, then one pipeline
# reading their events), then billed; off the request path, once.
_SWEEP_BATCH = 100
SWEEP_EVERY_S = 1.0  # how often the instances' liveness is looked at (one SMEMBERS, N EXISTS)

# A sweep of one stream of a dead owner that no reader took over. KEYS: its meta, its events,
# the dead owner's set of its group; ARGV: the dead owner, the sweeper, the TTL left to the
# ended stream, its id. Atomic with a claim: it ends the stream only while the dead owner still
# holds it unended (the fence goes up, so a paused owner that comes back writes nothing more),
# and a claim after it finds it ended. Returns {"swept", request ("" for none), billed,
# trace} or {why not}.
SWEEP = """
redis.call('SREM', KEYS[3], ARGV[4])
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return {'gone'} end
if redis.call('HEXISTS', KEYS[1], 'outcome') == 1 then return {'ended'} end
if owner ~= ARGV[1] then return {'moved'} end
redis.call('HINCRBY', KEYS[1], 'fence', 1)
local req = redis.call('HGET', KEYS[1], 'req') or ''
local billed = redis.call('HGET', KEYS[1], 'billed') or ''
local trace = redis.call('HGET', KEYS[1], 'trace') or ''
local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local last = 0
if #newest > 0 then last = tonumber(string.match(newest[1][1], '^(%d+)')) end
redis.call('XADD', KEYS[2], last .. '-1', 'end', 'orphaned')
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'outcome', 'orphaned')
redis.call('HDEL', KEYS[1], 'req')
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return {'swept', req, billed, trace}
"""


def dead_instances(
    others: list[str], alive: list[bool], missing: dict[str, float], now: float, gone_s: float
) -> list[str]:
    """The instances of `others` whose liveness key has been missing for `gone_s` (`alive`:
    whether each one's key is there now; `missing`: since when each one's was found missing,
    kept between looks). A Redis that restarted empty has every live key back within a
    heartbeat, well before."""
    dead = []
    for name, live in zip(others, alive, strict=True):
        if live:
            missing.pop(name, None)
            continue
        since = missing.setdefault(name, now)
        if now - since >= gone_s:
            del missing[name]
            dead.append(name)
    for name in set(missing) - set(others):  # removed by another survivor's sweep
        del missing[name]
    return dead


def tokens_held(entries: RawEntries) -> tuple[int, bool]:
    """The tokens of the events a stream's entries hold (its runs, up to its end), and whether
    they hold it from its first event (a run trimmed past `max_events` takes its counts)."""
    tokens = 0
    complete = True
    last = 0
    for i, (_, fields) in enumerate(entries):
        if b"end" in fields:
            break
        first = run_first(fields)
        if i == 0 and first > 1:
            complete = False
        for seq, _, count in decode_run(fields, max(last, first - 1)):
            tokens += count
            last = seq
    return tokens, complete


class Sweeper:
    """Watches the other instances; sweeps the streams of each dead one it wins. `bill`,
    `grace_s` and `ttl_s` are the store's `on_orphaned`, `orphan_grace_s`, `orphan_ttl_s`."""

    def __init__(self, redis: AnyRedis, instance: str, health: Health) -> None:
        self.redis = redis
        self.instance = instance
        self.health = health
        self.bill: BillOrphaned | None = None
        self.grace_s = 0.0
        self.ttl_s = 60.0  # how long a swept stream stays known (its end's TTL)
        self.swept = 0
        self._script = redis.register_script(SWEEP)

    async def watch(self, tg: TaskGroup) -> None:
        """Every `SWEEP_EVERY_S`: which instances heartbeat no more. Of each one dead, one
        survivor (the one whose `SREM` from `ft:instances` took it out) sweeps its streams."""
        missing: dict[str, float] = {}
        while True:
            await anyio.sleep(SWEEP_EVERY_S)
            try:
                with anyio.fail_after(OP_TIMEOUT_S):
                    raw = cast("set[bytes]", await self.redis.smembers(INSTANCES))
                    others = sorted(n.decode() for n in raw if n.decode() != self.instance)
                    alive = [bool(await self.redis.exists(instance_key(n))) for n in others]
            except REDIS_DOWN:
                missing.clear()  # through an outage nobody's key can be seen: none is dead
                continue
            for name in dead_instances(others, alive, missing, time.monotonic(), OWNER_GONE_S):
                try:
                    with anyio.fail_after(OP_TIMEOUT_S):
                        won = await self.redis.srem(INSTANCES, name)
                except REDIS_DOWN:
                    continue
                if won:
                    tg.start_soon(self.sweep, name)

    async def sweep(self, dead: str) -> None:
        """End and bill the streams `dead` left unended that no reader took over, once
        `grace_s` has passed: in batches of `_SWEEP_BATCH`."""
        log_event("redis.sweep_started", instance=dead, grace_s=self.grace_s)
        swept = 0
        done = False
        try:
            await anyio.sleep(self.grace_s)
            for tag in TAGS:
                swept += await self._sweep_group(dead, owned_key(tag, dead))
            done = True
        except Exception as exc:  # a bug must not end the store's task group
            log_event("redis.sweep_failed", logging.ERROR, instance=dead, error=repr(exc))
        finally:
            if not done:  # this instance exits, or failed: another survivor sweeps it again
                with anyio.CancelScope(shield=True), anyio.move_on_after(OP_TIMEOUT_S):
                    try:
                        await self.redis.sadd(INSTANCES, dead)
                    except REDIS_DOWN:
                        pass
        log_event("redis.sweep_done", instance=dead, streams=swept)

    async def _sweep_group(self, dead: str, owned: str) -> int:
        """Sweep the streams of one key group in `dead`'s set `owned`; how many were swept."""
        assert self.bill is not None
        members = await self.health.retrying(partial(self.redis.smembers, owned))
        ids = sorted(m.decode() for m in cast("set[bytes]", members))
        swept = 0
        for at in range(0, len(ids), _SWEEP_BATCH):
            for orphaned in await self._sweep_batch(dead, owned, ids[at : at + _SWEEP_BATCH]):
                swept += 1
                self.swept += 1
                try:
                    await self.bill(orphaned)
                except Exception as exc:  # one failed bill must not stop the rest
                    log_event(
                        "redis.orphan_unbilled",
                        logging.ERROR,
                        stream=orphaned.id,
                        error=repr(exc),
                    )
        await self.health.retrying(partial(self.redis.delete, owned))
        return swept

    async def _sweep_batch(self, dead: str, owned: str, ids: list[str]) -> list[Orphaned]:
        ttl = max(1, int(self.ttl_s))
        found: list[tuple[str, list[Any]]] = []
        for sid in ids:  # a cluster's pipelines refuse scripts: one call each
            answer = await self.health.retrying(
                partial(
                    self._script,
                    keys=[meta_key(sid), events_key(sid), owned],
                    args=[dead, self.instance, ttl, sid],
                )
            )
            if answer[0] == b"swept":
                found.append((sid, answer))
        if not found:
            return []

        async def read() -> list[Any]:
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid, _ in found:
                    pipe.xrange(events_key(sid), min="-", max="+")
                return await pipe.execute()

        runs = await self.health.retrying(read)
        out = []
        for (sid, answer), entries in zip(found, runs, strict=True):
            tokens, complete = tokens_held(entries)
            req, billed, trace = answer[1], answer[2], answer[3].decode()
            log_event("stream.orphan_swept", stream=sid, owner=dead, tokens=tokens)
            if req:  # none: it could not be taken over, and carries no key to bill
                out.append(Orphaned(sid, trace, req, billed, tokens, complete))
        return out
