"""New streams' metas: every stream opened in one turn of the loop goes to Redis in one call.

A burst of 500 new streams made 500 round trips, each waiting for a connection; here one
task (`MetaWriter.write_forever`) takes what opened since its last write and sends it as one
Lua call (`_WRITE_METAS`), in several only past `_META_CALL_BYTES` of stored requests.
Nothing waits for it: the stream's id is handed out at once, and another instance asked for
it meanwhile waits a while for the meta (`RedisStore.lookup`). A meta that did not go in
(Redis away, or it failed) is left to the flusher, which writes it as commands
(`meta_commands`) before the stream's next run.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any, cast

import anyio
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from firsttoken.redisclient import REDIS_DOWN, AnyRedis, pack, resp_arg, roundtrip
from firsttoken.resume.health import OP_TIMEOUT_S, Health
from firsttoken.resume.redis_keys import meta_key, owned_key, tag_of
from firsttoken.resume.replicas import Replica, Replicas

__all__ = ["LIVE_EXTRA_S", "META_COMMANDS", "MetaWriter", "meta_commands", "send"]

LIVE_EXTRA_S = 3600  # a live stream's keys outlast any sane answer; the TTL applies at the end
META_COMMANDS = 5  # per stream (`meta_commands`)

# New streams' metas, one call for every stream opened in a turn of the loop (four commands a
# stream before: Redis parsed and ran 4N, the client packed 4N and read 4N replies). KEYS:
# each stream's meta. ARGV[1]: the owner (this instance); ARGV[2]: per stream, ten
# little-endian uint32s (the TTL; the fence; takeover 0/1; the byte lengths of kind, digest,
# trace, model, tenant, the stored request and the outcome, 0 for none), then those seven
# fields' bytes. The owner and fence are set only where missing, as `meta_commands` does.
# Returns the streams whose write failed, as (position, error) pairs.
WRITE_METAS = """
local blob = ARGV[2]
local pos = 1
local i = 0
local out = {}
local function take(n)
  local s = string.sub(blob, pos, pos + n - 1)
  pos = pos + n
  return s
end
local function failed(r)
  if type(r) == 'table' and r.err then return r.err end
end
while pos <= #blob do
  i = i + 1
  local meta = KEYS[i]
  local ttl, fence, takeover, kl, dl, tl, ml, nl, rl, ol
  ttl, fence, takeover, kl, dl, tl, ml, nl, rl, ol, pos =
    struct.unpack('<I4I4I4I4I4I4I4I4I4I4', blob, pos)
  local kind, digest, trace, model, tenant = take(kl), take(dl), take(tl), take(ml), take(nl)
  local req, outcome = take(rl), take(ol)
  local err = failed(redis.pcall('HSET', meta, 'kind', kind, 'digest', digest, 'trace', trace,
                                 'model', model, 'tenant', tenant, 'takeover', takeover))
  if not err and rl > 0 then err = failed(redis.pcall('HSET', meta, 'req', req)) end
  if not err and ol > 0 then err = failed(redis.pcall('HSET', meta, 'outcome', outcome)) end
  err = err or failed(redis.pcall('HSETNX', meta, 'owner', ARGV[1]))
    or failed(redis.pcall('HSETNX', meta, 'fence', fence))
    or failed(redis.pcall('EXPIRE', meta, ttl))
  if not err and ol == 0 and redis.call('HGET', meta, 'owner') == ARGV[1] then
    local prefix, id = string.match(meta, '^(ft:{[^}]*}:)(.*):meta$')
    if prefix then err = failed(redis.pcall('SADD', prefix .. 'owned:' .. ARGV[1], id)) end
  end
  if err then
    table.insert(out, i)
    table.insert(out, err)
  end
end
return out
"""
_META_HEAD = struct.Struct("<10I")
# A Lua call holds Redis for its whole length: 50 new streams' metas with a 1 MB request each
# in one call kept every other client waiting 243 ms. Past this many bytes of requests, the
# metas of a turn go in several calls, one after the other (others' commands run between).
_META_CALL_BYTES = 1 << 20


def meta_commands(rep: Replica, instance: str) -> list[tuple[Any, ...]]:
    """`META_COMMANDS` commands that write `rep`'s meta, owned by `instance`. The owner and
    fence are set only where missing: written again after a Redis restart, a meta must not
    take back a stream another instance has taken over since (its fence is higher; the next
    write here is refused)."""
    r = rep.record
    key = meta_key(r.id)
    handover = rep.handover()
    fields: list[Any] = ["kind", r.format, "digest", r.token_digest, "trace", r.trace_id]
    fields += ("model", r.model, "takeover", 0 if handover is None else 1)
    if handover is not None:
        fields += ("req", handover)
    owned = ("SADD", owned_key(tag_of(key), instance), r.id)
    if rep.end is not None:
        fields += ("outcome", rep.end[0])
        owned = ("SREM", *owned[1:])  # ended before its meta went out: nothing to sweep
    fields += ("tenant", r.tenant)  # who may read a response back by id
    return [
        ("HSET", key, *fields),
        ("HSETNX", key, "owner", instance),
        ("HSETNX", key, "fence", rep.fence),
        ("EXPIRE", key, int(rep.ttl_s + LIVE_EXTRA_S)),
        owned,
    ]


async def send(redis: AnyRedis, cluster: bool, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Commands in one round trip, their replies in order (an error reply in its place)."""
    if cluster:
        async with redis.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute(raise_on_error=False)
    single = cast(Redis, redis)  # not a cluster
    return await roundtrip(single, [pack(*c) for c in commands], len(commands))


def by_request_bytes(reps: list[Replica]) -> Iterator[list[Replica]]:
    """`reps` in runs of at most `_META_CALL_BYTES` of stored requests (one at least)."""
    run: list[Replica] = []
    size = 0
    for rep in reps:
        handover = rep.record.handover
        grows = len(handover) if handover is not None else 0
        if run and size + grows > _META_CALL_BYTES:
            yield run
            run, size = [], 0
        run.append(rep)
        size += grows
    if run:
        yield run


def _nobody() -> None:
    return None


class MetaWriter:
    """The metas of the streams opened since its last write, in one write."""

    def __init__(
        self,
        redis: AnyRedis,
        instance: str,
        replicas: Replicas,
        health: Health,
        *,
        cluster: bool,
    ) -> None:
        self.redis = redis
        self.instance = instance
        self.replicas = replicas
        self.health = health
        self.cluster = cluster
        self._script = redis.register_script(WRITE_METAS)
        self._batch: list[Replica] = []  # streams opened since the last write
        self._wake = anyio.Event()
        # Told that Redis took a write while the store is down (the flusher recovers now).
        self.answered: Callable[[], None] = _nobody

    async def load(self) -> None:
        """The first burst's call finds the script (none on a cluster: commands there)."""
        if not self.cluster:
            await self.redis.script_load(WRITE_METAS)

    def open(self, rep: Replica) -> None:
        """Send `rep`'s meta with every other stream opened in this turn of the loop."""
        if not self._batch:
            self._wake.set()
        self._batch.append(rep)

    async def write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            batch, self._batch = self._batch, []
            if batch:
                await self.write(batch)

    async def write(self, batch: list[Replica]) -> None:
        """`batch`'s metas; what did not go in is the flusher's to write (`failed`)."""
        try:
            with anyio.fail_after(OP_TIMEOUT_S):
                if self.cluster:  # a script's keys must share a slot: commands there
                    commands = [c for rep in batch for c in self.commands(rep)]
                    replies = await send(self.redis, True, commands)
                else:
                    replies = []
                    for reps in by_request_bytes(batch):
                        replies += await self.call(reps)
        except REDIS_DOWN as exc:
            self.failed(batch, exc)
            return
        # An error reply (e.g. OOM) fails the batch as an outage would.
        error = next((r for r in replies if isinstance(r, BaseException)), None)
        if error is not None:
            self.failed(batch, error)
            return
        for rep in batch:
            rep.written_meta()
        if not self.health.up:
            self.answered()

    def failed(self, batch: list[Replica], error: BaseException) -> None:
        """The flusher writes the metas Redis did not take, before the streams' next runs;
        the store is down unless the write only ran out of time (`Health.failed`: the
        flusher's own write says soon whether Redis is away)."""
        self.health.failed(error)
        for rep in batch:
            # Not one it let go meanwhile (another instance's now, or forgotten).
            if not rep.meta_done and self.replicas.get(rep.record.id) is rep:
                self.replicas.mark(rep)

    def commands(self, rep: Replica) -> list[tuple[Any, ...]]:
        return meta_commands(rep, self.instance)

    async def call(self, reps: list[Replica]) -> list[Any]:
        """New streams' metas in one Lua call (`WRITE_METAS`), packed here; the script is
        loaded when Redis does not have it (first use, or after a restart). Returns the
        call's errors as exceptions (none when all went in)."""
        command = self._packed(reps)
        single = cast(Redis, self.redis)  # never a cluster here (`_write`)
        for attempt in range(2):
            (reply,) = await roundtrip(single, [command], 1)
            if isinstance(reply, NoScriptError) and not attempt:
                await single.script_load(WRITE_METAS)
                continue
            if isinstance(reply, BaseException):
                return [reply]
            return [
                ResponseError(f"stream {reply[i]}: {reply[i + 1]}") for i in range(0, len(reply), 2)
            ]
        raise AssertionError("unreachable")

    def _packed(self, reps: list[Replica]) -> bytes:
        """`EVALSHA` of `WRITE_METAS` for `reps`, as Redis reads it."""
        blob: list[bytes] = []
        for rep in reps:
            r = rep.record
            fields = [f.encode() for f in (r.format, r.token_digest, r.trace_id, r.model, r.tenant)]
            handover = rep.handover()
            fields.append(handover or b"")
            fields.append(rep.end[0].encode() if rep.end is not None else b"")
            blob.append(
                _META_HEAD.pack(
                    int(rep.ttl_s + LIVE_EXTRA_S),
                    rep.fence,
                    0 if handover is None else 1,
                    *(len(f) for f in fields),
                )
            )
            blob += fields
        packed = b"".join(blob)
        head = b"*%d\r\n$7\r\nEVALSHA\r\n%b%b" % (
            len(reps) + 5,
            resp_arg(self._script.sha.encode()),
            resp_arg(b"%d" % len(reps)),
        )
        return b"".join(
            (
                head,
                *(rep.meta_arg for rep in reps),
                resp_arg(self.instance.encode()),
                resp_arg(packed),
            )
        )
