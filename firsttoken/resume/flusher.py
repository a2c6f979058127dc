"""The flusher: every owned stream with new events goes to Redis at most once per interval.

Nothing happens here per token: a stream's log tells `Replicas` once that it has new events.
One task writes every dirty stream at most once per `FLUSH_INTERVAL_S`, reading them from the
log: one Lua call per flush (per key group on Redis Cluster) carries one run per stream and
the ends (an `XADD` per token cost 3× the token itself), packed here (`redisclient.pack`).
A crash of this instance loses at most the events of the last interval and the round trip in
flight; `durable`: nothing a reader saw, since its events reach readers only once Redis
confirmed them (`Health`).

While Redis is down it retries with backoff; when it is back, each stream's backlog (events
after `flushed`) goes out as one run, and if Redis restarted (its run id changed, so it may
have lost everything) every kept stream is written again from its first kept event
(`resync`). A write Redis refuses for its fence means another instance took the stream over:
it is forgotten here, and its owner told (`on_fenced`).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError, ResponseError

from firsttoken.redisclient import REDIS_DOWN, AnyRedis, pack, resp_arg, roundtrip
from firsttoken.resume.health import OP_TIMEOUT_S, RETRY_MAX_S, RETRY_MIN_S, Health
from firsttoken.resume.metas import LIVE_EXTRA_S, META_COMMANDS, MetaWriter, send
from firsttoken.resume.redis_keys import tag_of
from firsttoken.resume.replicas import Replica, Replicas, ahead
from firsttoken.resume.runs import pack_counts, pack_lengths
from firsttoken.telemetry.log import log_event

__all__ = ["FENCED", "FLUSH_INTERVAL_S", "Call", "Flusher", "server_run_id"]

FLUSH_INTERVAL_S = 0.05  # a stream's events go to Redis at most this often, as one run
FENCED = "fenced"
# Streams per round trip: building a write is synchronous (~6 µs a stream), so 1,000 streams
# in one stalled the loop for ~10 ms every flush; between batches the loop serves the rest.
_FLUSH_BATCH = 256
# After a Redis restart, the ended streams' events written again per flush: the ~85,000 an
# instance keeps after 2.5 minutes at 15 streams/s, written at once, took every instance's
# CPU and Redis's for ~0.5 s (new streams' TTFT p99 250-340 ms against 124 without them);
# at 1,000 a flush (20,000 a second) they trickle in beside the live ones.
_REWRITE_EVENTS = 1_000

# One call writes every stream of a flush. ARGV[1]: per stream, eleven little-endian uint32s
# (the run's last seq, 0 for no run; the trim's MINID seq; the run's first seq; the byte lengths
# of its fields w, n, t, of the end's outcome and of `billed` (a hand-over's, 0 for none); the
# end's seq, 0 for none; the TTL to set, 0 to keep; the writer's fence), then those five
# fields' bytes. One argument, not eleven a stream: each argument costs packing and parsing.
# KEYS, in the same order: each stream's events and its meta (the outcome goes there: one call
# a flush, not a pipeline of ends beside it). A stream whose meta holds another fence was taken
# over: nothing of it is written ("fenced"); `billed` goes in with its last events, fenced as
# they are, so an owner taken over meanwhile leaves nothing the new one has not counted.
# Returns the streams whose write failed, as (position in the argument, error) pairs: none,
# nearly always (a reply of 500 ones cost 3% of the process to parse). A run or end already
# there ("equal or smaller": written before a reply that was lost) counts as written.
WRITE_RUNS = """
local blob = ARGV[1]
local pos = 1
local k = 0
local i = 0
local out = {}
local function failed(r)
  if type(r) == 'table' and r.err and not string.find(r.err, 'equal or smaller') then
    return r.err
  end
end
while pos <= #blob do
  i = i + 1
  k = k + 1
  local key = KEYS[k]
  k = k + 1
  local meta = KEYS[k]
  local last, minid, first, wl, nl, tl, ol, bl, done, ttl, fence
  last, minid, first, wl, nl, tl, ol, bl, done, ttl, fence, pos =
    struct.unpack('<I4I4I4I4I4I4I4I4I4I4I4', blob, pos)
  local w = string.sub(blob, pos, pos + wl - 1)
  pos = pos + wl
  local n = string.sub(blob, pos, pos + nl - 1)
  pos = pos + nl
  local t = string.sub(blob, pos, pos + tl - 1)
  pos = pos + tl
  local outcome = string.sub(blob, pos, pos + ol - 1)
  pos = pos + ol
  local billed = string.sub(blob, pos, pos + bl - 1)
  pos = pos + bl
  local err
  local held = tonumber(redis.call('HGET', meta, 'fence') or '0')
  if held ~= 0 and held ~= fence then
    err = 'fenced'
  elseif last > 0 then
    if tl > 0 then
      err = failed(redis.pcall('XADD', key, 'MINID', '~', minid .. '-0', last .. '-0',
                               'f', first, 'w', w, 'n', n, 't', t))
    else
      err = failed(redis.pcall('XADD', key, 'MINID', '~', minid .. '-0', last .. '-0',
                               'f', first, 'w', w, 'n', n))
    end
  end
  if not err and bl > 0 then
    err = failed(redis.pcall('HSET', meta, 'billed', billed))
  end
  if not err and done > 0 then
    local prefix, id = string.match(meta, '^(ft:{[^}]*}:)(.*):meta$')
    local owner = redis.call('HGET', meta, 'owner')
    if owner and prefix then redis.pcall('SREM', prefix .. 'owned:' .. owner, id) end
    err = failed(redis.pcall('XADD', key, done .. '-1', 'end', outcome))
      or failed(redis.pcall('HSET', meta, 'outcome', outcome))
      or failed(redis.pcall('HDEL', meta, 'req'))
      or failed(redis.pcall('EXPIRE', meta, ttl))
  end
  if not err and ttl > 0 then
    err = failed(redis.pcall('EXPIRE', key, ttl))
  end
  if err then
    table.insert(out, i)
    table.insert(out, err)
  end
end
return out
"""
_HEAD = struct.Struct("<11I")


def _ignore(stream_id: str, kept: int, lost: bool) -> None:
    return None


async def server_run_id(redis: AnyRedis) -> str | None:
    """Redis's `run_id`, new at every start; on a cluster, every master's (a failover puts
    another one there); None where INFO is not allowed."""
    try:
        if isinstance(redis, RedisCluster):
            found = await redis.info("server", target_nodes=RedisCluster.PRIMARIES)
            ids = sorted(str(info.get("run_id")) for info in found.values())
            return ",".join(ids)
        info = await redis.info("server")
    except ResponseError:  # e.g. a managed Redis that renamed INFO
        return None
    run_id = info.get("run_id")
    return str(run_id) if run_id is not None else None


@dataclass(slots=True, eq=False)
class Call:
    """One Lua call of a flush: its streams, its keys (each stream's events key and its
    meta's), and its argument in parts (`Flusher.pack`)."""

    reps: list[Replica] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    key_args: list[bytes] = field(default_factory=list)
    blob: list[bytes] = field(default_factory=list)

    def packed(self, sha: str) -> list[bytes]:
        """`EVALSHA sha numkeys keys... blob` as Redis reads it: built here from each key's
        argument made once per stream, not by redis-py's packer (~1 µs an argument)."""
        blob = b"".join(self.blob)
        count = len(self.key_args)
        head = b"*%d\r\n$7\r\nEVALSHA\r\n%b%b" % (
            count + 4,
            resp_arg(sha.encode()),
            resp_arg(b"%d" % count),
        )
        return [b"".join((head, *self.key_args, b"$%d\r\n" % len(blob), blob, b"\r\n"))]


@dataclass(slots=True, eq=False)
class _Flush:
    """What one batch writes: the metas that are missing and the gaps' trims as commands
    (`before`), then the Lua calls, one per key group."""

    reps: list[Replica] = field(default_factory=list)
    before: list[tuple[Any, ...]] = field(default_factory=list)
    metas: list[Replica] = field(default_factory=list)
    trims: list[tuple[Replica, int]] = field(default_factory=list)
    calls: dict[str, Call] = field(default_factory=dict)


class Flusher:
    """Writes the dirty `replicas` to Redis, and marks what it confirmed."""

    def __init__(
        self,
        redis: AnyRedis,
        replicas: Replicas,
        health: Health,
        metas: MetaWriter,
        *,
        beat: Callable[[], Awaitable[None]],
        max_events: int,
        cluster: bool,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        self.redis = redis
        self.replicas = replicas
        self.health = health
        self.metas = metas
        self.beat = beat  # this instance's heartbeat, once Redis answers again
        self.max_events = max_events
        self.cluster = cluster
        self.flush_interval_s = flush_interval_s
        # Told of each stream another instance took over while this one still generated it,
        # with the last event of it Redis holds from this one, and whether its readers may
        # have been sent events the takeover does not continue from (`durable`, released
        # while Redis was away): those are lost, not moved.
        self.on_fenced: Callable[[str, int, bool], None] = _ignore
        self.fenced = 0
        self.resyncs = 0
        self.run_id: str | None = None
        self._script = redis.register_script(WRITE_RUNS)
        self._script_missing = True  # loaded before the first flush, and after a restart
        self._epoch = 0  # resyncs so far: a write begun before one confirms nothing
        self._answering = anyio.Event()  # set by the heartbeat when Redis is back

    async def start(self) -> None:
        self.run_id = await server_run_id(self.redis)

    def answered(self) -> None:
        """The heartbeat found Redis answering while the store is down: recover now."""
        self.replicas.wake.set()
        self._answering.set()

    async def flush_forever(self) -> None:
        delay = RETRY_MIN_S
        last_flush = 0.0
        health, replicas = self.health, self.replicas
        while True:
            if health.up or not replicas.dirty:
                await replicas.wake.wait()
            if health.up:
                # One run per stream per interval: the events of the wait go out together.
                await anyio.sleep(max(0.0, last_flush + self.flush_interval_s - time.monotonic()))
            replicas.wake = anyio.Event()
            replicas.expire()
            last_flush = time.monotonic()
            try:
                health.write_began()
                if not health.up:
                    await self._recover()
                # What is dirty now, in batches; what a write in flight makes dirty again waits
                # for the next interval (flushing it at once made runs of one event).
                left = len(replicas.dirty)
                while left > 0 and replicas.dirty:
                    left -= await self.flush_batch()
                replicas.mark_some(_REWRITE_EVENTS)
            except REDIS_DOWN as exc:
                health.write_ended(exc)
                # Back off, but go at once when the heartbeat finds Redis answering again.
                with anyio.move_on_after(delay):
                    await self._answering.wait()
                self._answering = anyio.Event()
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            health.write_ended(None)
            delay = RETRY_MIN_S

    async def final_flush(self) -> None:
        """A drain's last events (server_shutdown) reach Redis before we go, so an instance
        that stays can still serve the resume (at most 2 s)."""
        with anyio.move_on_after(2.0):
            try:
                while self.replicas.dirty and self.health.up:
                    await self.flush_batch()
            except REDIS_DOWN as exc:
                log_event("redis.final_flush_failed", logging.WARNING, error=repr(exc))

    async def _recover(self) -> None:
        """Redis answers again: if it restarted, it may hold none of our streams."""
        run_id = await server_run_id(self.redis)
        await self.beat()
        if run_id is None or run_id != self.run_id:  # None: INFO refused, so assume so
            self.resync(run_id)

    async def check_masters(self) -> None:
        """The cluster client follows a failover without an error the flusher would see: a
        master that changed may have lost what it confirmed last."""
        try:
            with anyio.fail_after(OP_TIMEOUT_S):
                run_id = await server_run_id(self.redis)
        except REDIS_DOWN:
            return  # the next flush or heartbeat says whether Redis is away
        if run_id is not None and run_id != self.run_id:
            log_event("redis.masters_changed", logging.WARNING)
            self.resync(run_id)

    def resync(self, run_id: str | None) -> None:
        """Redis may hold none of our streams (it restarted), or lost the last writes it
        confirmed (a failover to a replica that had not received them): everything kept goes
        again, from the first kept event: the live streams now, the ended ones a few at a
        time beside them (`_REWRITE_EVENTS` a flush)."""
        self.run_id = run_id
        self._script_missing = True
        self._epoch += 1
        self.resyncs += 1
        ended: list[Replica] = []
        for rep in self.replicas:
            self.replicas.count_lost(rep)  # before the gap is written off below
            rep.flushed = rep.trimmed = rep.first - 1
            rep.meta_done = rep.end_done = rep.ttl_done = False
            if rep.end is None:
                self.replicas.mark(rep)
            elif not rep.queued:
                ended.append(rep)
        self.replicas.mark_later(ended)
        log_event("redis.resync", streams=len(self.replicas), ended=len(ended))

    async def flush_batch(self) -> int:
        """Write up to `_FLUSH_BATCH` dirty streams in one round trip: the metas that are
        missing and the gaps' trims as commands, then every run and end in one Lua call (one
        per key group on a cluster: a call's keys must share a slot)."""
        if self._script_missing:
            await self.redis.script_load(WRITE_RUNS)
            self._script_missing = False
        epoch = self._epoch
        flush = self._build(self.replicas.take(_FLUSH_BATCH))
        try:
            if self.cluster:
                results = await self._write_apart(flush.before, list(flush.calls.values()))
            else:
                (call,) = flush.calls.values()
                pieces = [pack(*c) for c in flush.before]
                pieces += call.packed(self._script.sha)
                single = cast(Redis, self.redis)
                results = await roundtrip(single, pieces, len(flush.before) + 1)
        except BaseException:
            for rep in flush.reps:  # nothing confirmed: all of it goes again
                rep.unsent()
                self.replicas.mark(rep)
            raise
        if epoch != self._epoch:  # a resync began meanwhile: all of it goes again anyway
            for rep in flush.reps:
                rep.unsent()
            return len(flush.reps)
        calls = [call.reps for call in flush.calls.values()]
        self.confirm(flush.reps, flush.metas, flush.trims, calls, results)
        return len(flush.reps)

    def _build(self, batch: list[Replica]) -> _Flush:
        flush = _Flush(batch)
        calls, cluster = flush.calls, self.cluster
        for rep in batch:
            if not rep.meta_done:
                flush.metas.append(rep)
                flush.before += self.metas.commands(rep)
            first = rep.log.first_seq
            if first > rep.flushed + 1:
                self.replicas.count_lost(rep)
                if rep.trimmed < first - 1:  # a gap: not to be stitched to what follows
                    flush.trims.append((rep, first - 1))
                    flush.before.append(("XTRIM", rep.key, "MINID", f"{first}-0"))
            group = tag_of(rep.key) if cluster else ""
            call = calls.get(group)
            if call is None:
                call = calls[group] = Call()
            self.pack(rep, call)
        return flush

    async def _write_apart(self, before: list[tuple[Any, ...]], calls: list[Call]) -> list[Any]:
        """A flush on a cluster, whose pipelines refuse scripts: the metas and trims, then
        the Lua calls (one per group, each to its master, at once)."""
        results: list[Any] = await send(self.redis, True, before) if before else []
        runs: list[Any] = [None] * len(calls)

        async def call(i: int, c: Call) -> None:
            try:
                runs[i] = await self.redis.evalsha(
                    self._script.sha, len(c.keys), *c.keys, b"".join(c.blob)
                )
            except REDIS_DOWN as exc:
                runs[i] = exc

        async with anyio.create_task_group() as tg:
            for i, c in enumerate(calls):
                tg.start_soon(call, i, c)
        return results + runs

    def pack(self, rep: Replica, call: Call) -> None:
        """One stream's part of its Lua call: its run of unconfirmed events, its end once
        every event is written, the TTL where it changes."""
        ttl = 0
        w = n = t = outcome = b""
        billed = rep.billed
        rep.billed_sent = bool(billed)
        rep.sent = first = 0
        if rep.log.last_seq > rep.flushed:
            first, wires, counts = rep.log.run_after(rep.flushed)
            rep.sent = first + len(wires) - 1
            w, n = b"".join(wires), pack_lengths(wires)
            if counts:
                t = pack_counts(first, counts)
        end = 0
        call.reps.append(rep)
        call.keys += (rep.key, rep.meta)
        call.key_args += (rep.key_arg, rep.meta_arg)
        if rep.end is not None and not rep.end_done:
            outcome = rep.end[0].encode()
            end = rep.end[1]
            rep.end_sent = True
            ttl = max(1, int(rep.ttl_s))
        elif not rep.ttl_done and rep.sent:
            ttl = int(rep.ttl_s + LIVE_EXTRA_S)
        minid = max(1, rep.sent - self.max_events + 1)
        call.blob += (
            _HEAD.pack(
                rep.sent,
                minid,
                first,
                len(w),
                len(n),
                len(t),
                len(outcome),
                len(billed),
                end,
                ttl,
                rep.fence,
            ),
            w,
            n,
            t,
            outcome,
            billed,
        )

    def confirm(
        self,
        batch: list[Replica],
        metas: list[Replica],
        trims: list[tuple[Replica, int]],
        calls: list[list[Replica]],
        results: list[Any],
    ) -> None:
        """Mark what Redis took; a stream with a failed write goes round again, and one that
        another instance took over is let go. `results`: the metas' replies
        (`META_COMMANDS` each), the trims', then each call's."""
        at = META_COMMANDS * len(metas)
        failed: BaseException | str | None
        failed = self._confirm_metas(metas, results[:at])
        failed = self._confirm_trims(trims, results[at : at + len(trims)]) or failed
        fenced: list[Replica] = []
        for reps, refused in zip(calls, results[at + len(trims) :], strict=True):
            failed = self._confirm_call(reps, refused, fenced) or failed
        for rep in fenced:
            self._fenced(rep)
        owned = self.replicas.by_id  # the dict, not `Replicas.__contains__`: once a stream
        for rep in batch:
            if rep.dirty() and rep.record.id in owned:
                self.replicas.mark(rep)
        if failed is not None:  # e.g. OOM: Redis answers but takes nothing; back off
            raise RedisError(f"Redis refused a replication write: {failed!r}")

    @staticmethod
    def _confirm_metas(metas: list[Replica], results: list[Any]) -> BaseException | None:
        failed = None
        for i, rep in enumerate(metas):
            replies = results[META_COMMANDS * i : META_COMMANDS * (i + 1)]
            error = next((r for r in replies if isinstance(r, BaseException)), None)
            if error is not None:
                failed = error
            else:
                rep.written_meta()
        return failed

    @staticmethod
    def _confirm_trims(
        trims: list[tuple[Replica, int]], results: list[Any]
    ) -> BaseException | None:
        failed = None
        for (rep, upto), result in zip(trims, results, strict=True):
            if isinstance(result, BaseException):
                failed = result
            else:
                rep.trimmed = upto
        return failed

    def _confirm_call(
        self, reps: list[Replica], refused: Any, fenced: list[Replica]
    ) -> BaseException | str | None:
        """One Lua call's reply: the streams it failed (none, nearly always), or an error
        for all of them. Those fenced go to `fenced`; returns the last other failure."""
        failed: BaseException | str | None = None
        runs: list[Any] = [1] * len(reps)
        if isinstance(refused, BaseException):
            failed = refused
            if isinstance(refused, NoScriptError):  # e.g. Redis restarted meanwhile
                self._script_missing = True
            runs = [refused] * len(reps)
        else:
            for i, error in zip(refused[0::2], refused[1::2], strict=True):
                runs[int(i) - 1] = error
        holding = self.health.holding
        for rep, result in zip(reps, runs, strict=True):
            if result == 1:
                if rep.sent:
                    rep.flushed = max(rep.flushed, rep.sent)
                    rep.ttl_done = True
                    if holding:
                        rep.log.hold(rep.flushed)  # its readers may have it now
                if rep.end_sent:
                    rep.end_done = True
                if rep.billed_sent:
                    rep.billed = b""
            else:
                said = result.decode() if isinstance(result, bytes) else result
                if said == FENCED:
                    fenced.append(rep)
                else:
                    failed = failed or said
            rep.sent = 0  # as `rep.unsent()`, inline: once per stream per flush
            rep.end_sent = False
            rep.billed_sent = False
        return failed

    def _fenced(self, rep: Replica) -> None:
        self.fenced += 1
        self.replicas.forget(rep.record.id, rep)
        lost = self.health.durable and ahead(rep)
        if lost:
            rep.log.unhold()  # they learn it: the log's end goes to them whole
        self.on_fenced(rep.record.id, rep.flushed, lost)
