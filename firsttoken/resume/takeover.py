"""A takeover: a reader here of a stream whose owner is gone claims it, and one instance wins.

The claim is one Lua call on the stream's meta (`CLAIM`): it checks the owner is the one the
claimer saw die and that the stream may be taken over, raises its fence and moves it to the
claimer's owned set. The old owner, if it was only paused or cut off, finds its next write
refused for the fence (`flusher.py`) and lets go. The claimer then reads every event Redis
holds, which nobody adds to any more, and the core continues the stream from them
(`core/registry.py`).
"""

from __future__ import annotations

from typing import cast

import anyio

from firsttoken.redisclient import REDIS_DOWN, AnyRedis, RawEntries
from firsttoken.resume.health import OP_TIMEOUT_S, Health
from firsttoken.resume.redis_keys import events_key, meta_key
from firsttoken.resume.runs import decode_run, run_first
from firsttoken.resume.store import Claim
from firsttoken.resume.tailer import entry_id

__all__ = ["CLAIM", "Claimer"]

# KEYS[1]: the stream's meta; ARGV: the owner the claimer saw die, the claimer. Returns
# {"claimed", fence, request, billed ("" for none)} or {why not[, the owner now]}.
CLAIM = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return {'gone'} end
if redis.call('HEXISTS', KEYS[1], 'outcome') == 1 then return {'ended'} end
if owner ~= ARGV[1] then return {'moved', owner} end
local req = redis.call('HGET', KEYS[1], 'req')
if redis.call('HGET', KEYS[1], 'takeover') ~= '1' or not req then return {'refused'} end
local fence = redis.call('HINCRBY', KEYS[1], 'fence', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[2])
local prefix, id = string.match(KEYS[1], '^(ft:{[^}]*}:)(.*):meta$')
if prefix then
  redis.call('SREM', prefix .. 'owned:' .. ARGV[1], id)
  redis.call('SADD', prefix .. 'owned:' .. ARGV[2], id)
end
return {'claimed', fence, req, redis.call('HGET', KEYS[1], 'billed') or ''}
"""


def held_events(entries: RawEntries) -> list[tuple[int, bytes, int]] | None:
    """The events a claimed stream's entries hold, from its first; None when one is missing
    (trimmed or lost: no text to go on from)."""
    events: list[tuple[int, bytes, int]] = []
    for _, fields in entries:
        if b"end" in fields:
            break
        if run_first(fields) > len(events) + 1:
            return None
        events += decode_run(fields, len(events))
    return events


class Claimer:
    """Claims streams for this instance (`instance`)."""

    def __init__(self, redis: AnyRedis, instance: str, health: Health) -> None:
        self.redis = redis
        self.instance = instance
        self.health = health
        self._script = redis.register_script(CLAIM)

    async def claim(self, stream_id: str, owner: str, after: int) -> Claim | str:
        """Take `stream_id` over from `owner`, gone, for a reader at `after`: the claim is one
        Lua call; then every event Redis holds. Else why not (`EventStore.claim`)."""
        key = events_key(stream_id)
        try:
            with anyio.fail_after(OP_TIMEOUT_S):
                lost = await self._lost(key, after)
                if lost:
                    return "lost"
                answer = await self._script(keys=[meta_key(stream_id)], args=[owner, self.instance])
            why: str = answer[0].decode()
            if why != "claimed":
                return why
            fence, handover, billed = int(answer[1]), answer[2], answer[3]
            with anyio.fail_after(OP_TIMEOUT_S * 5):
                entries = cast(RawEntries, await self.redis.xrange(key, min="-", max="+"))
        except REDIS_DOWN as exc:
            # A burst of claims (every reader of a dead instance at once) may run past the
            # deadline on a busy loop: that reader's claim fails, not the store.
            self.health.failed(exc)
            return "gone"
        events = held_events(entries)
        if events is None:
            return "lost"
        return Claim(fence, owner, handover, events, billed)

    async def _lost(self, key: str, after: int) -> bool:
        """Whether the reader saw what died with its owner, or the stream's start was trimmed
        (no text to go on from): nothing to claim then."""
        newest = cast(RawEntries, await self.redis.xrevrange(key, count=1))
        if newest and b"end" not in newest[0][1]:
            held = entry_id(newest[0][0])[0]
            if after > held:
                return True
        oldest = cast(RawEntries, await self.redis.xrange(key, min="-", max="+", count=1))
        return bool(oldest and b"end" not in oldest[0][1] and run_first(oldest[0][1]) > 1)
