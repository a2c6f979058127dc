"""Redis store: streams shared by every gateway instance that points at the same Redis.

Keys (`{g}` is the stream's group tag, `keys.py`: what one command touches is in one slot):
  ft:{g}:<id>:meta     hash: kind, digest (sha256 of the resume token), trace, model,
                       tenant (the key that created it: who may read a response by id),
                       owner, fence (raised by each takeover; every write of the owner
                       carries it), takeover (1/0), req (what continuing it needs,
                       `StreamRecord.handover`: deleted with the end, which leaves nothing
                       to continue), outcome,
                       billed (what the answer's owners billed, left at a hand-over:
                       "prompt completion reasoning"; absent: nobody billed any of it yet)
  ft:{g}:<id>:events   Redis Stream of runs (`runs.py`): entry `<last seq>-0` carries the
                       events written since the stream's previous flush; a final
                       `<last seq>-1` entry with `end` closes it
  ft:{g}:<id>:readers  set with a short expiry while another instance has a reader attached
  ft:{g}:owned:<n>     set: the ids of the group's streams instance <n> owns and has not ended
                       (added with the meta or by a claim, removed with the end): what a
                       survivor bills when <n> dies (`_sweep`)
  ft:instances         set: every instance that heartbeats; one whose liveness key is gone is
                       removed by the survivor that sweeps its streams (once: `SREM` says who)
  ft:instance:<n>      the owner's liveness: lives 1.2 s, rewritten every 0.2 s by a thread of
                       its own (a busy event loop does not make an owner look dead); deleted
                       when the instance hands its streams over and exits
  ft:cancel            pub/sub channel: stream ids to stop, heard by the owner
  ft:[{g}:]wake:<n>:<l> a reading instance's wake-ups for its shared tail (`tailer.py`)
Nothing happens here per token: a stream's log tells the store once that it has new events
(`EventLog.on_append`). One flusher writes every stream that has new events at most once per
`FLUSH_INTERVAL_S`, reading them from the log: one Lua call per flush (per key group on Redis
Cluster) carries one run per stream and the ends (an `XADD` per token cost 3× the token
itself), packed here (`redisclient.pack`). A crash of this instance loses at most the events
of the last interval and the round trip in flight; `durable`: nothing a reader saw, since its
events reach readers only once Redis confirmed them.

A stream outlives its owner: a reader here of a stream whose owner's liveness key is gone
claims it (`claim`: one Lua call on its meta; one instance wins, and the stream's fence goes
up), and the core continues it from what Redis holds (`core/registry.py`). The old owner, if
it was only paused or cut off, finds its next write refused (`fenced`) and lets go.
Reads of other instances' streams go through one shared tail (`Tailer`), whatever their number.

Redis going away never touches a local stream. Each stream this instance owns keeps its
events in its log (at most `max_events`; once the resume budget drops the log's events, a log
of those Redis lacks) until it expires, and `flushed`, the highest seq Redis has confirmed.
The flusher retries with backoff while Redis is down; when it is back, each stream's backlog
(events after `flushed`) goes out as one run, and if Redis restarted (its run id changed, so
it may have lost everything) every kept stream is written again from its first kept event.
An event that fell off the bound before Redis confirmed it is counted in
`firsttoken_redis_events_dropped_total`; the stream's older entries are then trimmed in
Redis, and a reader whose next event is in the hole gets `resume_expired` (at the start) or
`stream_lost` (later), never a silent gap.
"""

from __future__ import annotations

import heapq
import logging
import struct
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

import anyio
from anyio.abc import TaskStatus
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError, ResponseError

from firsttoken.eventlog import EventLog
from firsttoken.redisclient import (
    REDIS_DOWN,
    Liveness,
    RawEntries,
    eviction_risk,
    pack,
    redis_client,
    resp_arg,
    roundtrip,
)
from firsttoken.resume.keys import TAGS, events_key, meta_key, owned_key, readers_key, tag_of
from firsttoken.resume.runs import decode_run, pack_counts, pack_lengths, run_first
from firsttoken.resume.store import BillOrphaned, Claim, Orphan, Orphaned, Resumed, StreamRecord
from firsttoken.resume.tailer import Follower, Tailer, apply_entries, entry_id, fail
from firsttoken.telemetry.metrics import log_event
from firsttoken.wire.errors import APIError

__all__ = ["RedisStore"]

_CANCEL = "ft:cancel"
_LIVE_EXTRA_S = 3600  # a live stream's keys outlast any sane answer; the TTL applies at the end
_PRESENCE_MS = 3000
_INSTANCE_MS = 1200
_LIVENESS_S = 0.2
# A stream that cannot be taken over is lost once its owner's key has been missing this long
# past its lapse (a Redis that restarted empty has it back within _LIVENESS_S).
_OWNER_GONE_S = 2.0
_OP_TIMEOUT_S = 1.0  # a request-path Redis call waits no longer than this
# `durable`: a flush unanswered this long counts as Redis away, and the owner's readers go on
# without it (`_release`): a few flush intervals, well under what a reader notices as a stall.
_STALL_S = 0.2
_RETRY_MIN_S, _RETRY_MAX_S = 0.1, 2.0  # the flusher's backoff while Redis is down
# Under a maxmemory-policy that evicts, how often Redis's count of evicted keys is read
# (heartbeats): an eviction may have taken a spend counter, a slot or a stream.
_EVICTIONS_EVERY = 5
# Streams per round trip: building a write is synchronous (~6 µs a stream), so 1,000 streams
# in one stalled the loop for ~10 ms every flush; between batches the loop serves the rest.
_FLUSH_BATCH = 256


def _unavailable(what: str) -> APIError:
    return APIError(
        503,
        "store_unavailable",
        f"the shared stream store (Redis) is unreachable; {what}",
        headers={"retry-after": "1"},
    )


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
_WRITE_RUNS = """
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
_META_COMMANDS = 5  # per stream (`_meta_commands`)

# New streams' metas, one call for every stream opened in a turn of the loop (four commands a
# stream before: Redis parsed and ran 4N, the client packed 4N and read 4N replies). KEYS:
# each stream's meta. ARGV[1]: the owner (this instance); ARGV[2]: per stream, ten
# little-endian uint32s (the TTL; the fence; takeover 0/1; the byte lengths of kind, digest,
# trace, model, tenant, the stored request and the outcome, 0 for none), then those seven
# fields' bytes. The owner and fence are set only where missing, as `_meta_commands` does.
# Returns the streams whose write failed, as (position, error) pairs.
_WRITE_METAS = """
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

FLUSH_INTERVAL_S = 0.05  # a stream's events go to Redis at most this often, as one run
FENCED = "fenced"

# A takeover: one instance wins. KEYS[1]: the stream's meta; ARGV: the owner the claimer saw
# die, the claimer. Returns {"claimed", fence, request, billed ("" for none)} or {why not[, the
# owner now]}.
_CLAIM = """
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

_INSTANCES = "ft:instances"
# A sweep's work: a dead instance's streams are ended this many at a time (a Lua call each,
# then one pipeline reading their events), then billed; off the request path, once.
_SWEEP_BATCH = 100
_SWEEP_EVERY_S = 1.0  # how often the instances' liveness is looked at (one SMEMBERS, N EXISTS)

# A sweep of one stream of a dead owner that no reader took over. KEYS: its meta, its events,
# the dead owner's set of its group; ARGV: the dead owner, the sweeper, the TTL left to the
# ended stream, its id. Atomic with a claim: it ends the stream only while the dead owner still
# holds it unended (the fence goes up, so a paused owner that comes back writes nothing more),
# and a claim after it finds it ended. Returns {"swept", request ("" for none), billed,
# trace} or {why not}.
_SWEEP = """
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


def _nothing() -> None:
    return None


def _ignore(stream_id: str, kept: int, lost: bool) -> None:
    return None


@dataclass(slots=True, eq=False)
class _Replica:
    """One owned stream as Redis should hold it, and how much of that Redis confirmed.

    Its events are its log's (`EventLog.run_after`): nothing is copied or called per token.
    The log tells the store once that it has new events (`on_append`, set to `wanted`), and
    the flusher asks it again each time it takes the stream's run. Once the log lets its
    events go (the resume budget), `release` leaves this a log of what Redis still lacks."""

    record: StreamRecord
    ttl_s: float
    key: str  # its events' key
    meta: str  # its meta's
    log: EventLog
    wanted: Callable[[], None] = _nothing  # marks it dirty: the log's `on_append`
    key_arg: bytes = b""  # the key as a RESP argument, for the calls packed here
    meta_arg: bytes = b""  # its meta's, likewise
    fence: int = 1  # what its writes carry: 1 for the stream's first owner
    flushed: int = 0  # highest seq Redis confirmed
    trimmed: int = 0  # entries up to this seq were trimmed in Redis after a gap
    lost: int = 0  # events up to this seq are counted in `events_dropped`, if not flushed
    meta_done: bool = False
    ttl_done: bool = False  # the events key has its live TTL
    end: tuple[str, int] | None = None  # (outcome, last seq) once the stream finished
    end_done: bool = False
    end_sent: bool = False  # the write in flight carries the end
    billed: bytes = b""  # a hand-over's `billed`, until Redis has it
    billed_sent: bool = False  # the write in flight carries it
    expires_at: float | None = None  # monotonic; set at the end
    queued: bool = False  # in the store's dirty set
    sent: int = 0  # last seq of the run in flight

    @property
    def first(self) -> int:
        return self.log.first_seq

    @property
    def last(self) -> int:
        return self.log.last_seq

    def written_meta(self) -> None:
        """Redis has the meta: the request stored with it is not kept here too (a waiting
        stream would hold its ~5 KiB for its whole life; after a Redis restart the meta is
        written again without it, and the stream then cannot be taken over)."""
        self.meta_done = True
        if self.record.handover is not None:
            self.record = replace(self.record, handover=None)

    def handover(self) -> bytes | None:
        """The request to store with its meta: none once the stream ended (a takeover has
        nothing left to continue; its end deletes one stored before, `_WRITE_RUNS`)."""
        return self.record.handover if self.end is None else None

    def dirty(self) -> bool:
        ended = self.end is not None and not self.end_done
        return not self.meta_done or self.last > self.flushed or ended or bool(self.billed)

    def unconfirmed(self) -> int:
        return max(0, self.last - max(self.flushed, self.first - 1))

    def newly_lost(self) -> int:
        """Events that fell off the log's bound before Redis confirmed them, not yet counted."""
        gone = self.first - 1
        if gone <= self.lost:
            return 0
        lost = max(0, gone - max(self.flushed, self.lost))
        self.lost = gone
        return lost


@dataclass(slots=True, eq=False)
class _Call:
    """One Lua call of a flush: its streams, its keys (each stream's events key, and its
    meta's where the call carries its end), and its argument in parts (`_pack`)."""

    reps: list[_Replica] = field(default_factory=list)
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
class _MetaBatch:
    reps: list[_Replica] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None


class RedisStore:
    replicates = True

    def __init__(
        self,
        url: str,
        *,
        max_events: int,
        max_connections: int,
        cluster: bool = False,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        durable: bool = False,
    ) -> None:
        self.redis = redis_client(url, max_connections=max_connections, cluster=cluster)
        self.cluster = cluster
        self.max_events = max_events
        self.flush_interval_s = flush_interval_s
        self.durable = durable  # readers see an event only once Redis confirmed it
        # `durable` while Redis is away or slow: readers see every event as it comes, since
        # no other instance can take a stream over meanwhile (`_release`).
        self.released = False
        self._stalled = False  # a flush has waited past `_STALL_S` for its reply
        self._writing_since: float | None = None  # monotonic start of the flush in flight
        self._flush_began = anyio.Event()  # for the stall watch
        self.instance = uuid.uuid4().hex
        self.handed_over = False  # a drain let its liveness key go (`hand_over`)
        self._liveness = Liveness(
            url,
            f"ft:instance:{self.instance}",
            cluster=cluster,
            ttl_ms=_INSTANCE_MS,
            every_s=_LIVENESS_S,
        )
        # Told of each stream another instance took over while this one still generated it,
        # with the last event of it Redis holds from this one, and whether its readers may
        # have been sent events the takeover does not continue from (`durable`, released
        # while Redis was away): those are lost, not moved.
        self.on_fenced: Callable[[str, int, bool], None] = _ignore
        self.fenced = 0
        # Bills the streams of a dead instance that no reader took over (`_sweep`); None:
        # no instance is watched. They are swept `orphan_grace_s` after its death is seen,
        # time for a reader that resumes by itself to come back and take its stream over.
        self.on_orphaned: BillOrphaned | None = None
        self.orphan_grace_s = 0.0
        self.orphan_ttl_s = 60.0  # how long a swept stream stays known (its end's TTL)
        self.orphans_swept = 0
        self.clock: Callable[[], float] = time.monotonic  # of expiry (a fake one in tests)
        self.up = True
        self.events_dropped = 0  # never reached Redis: fell off a backlog past its bound
        self.outages = 0
        self.resyncs = 0
        self.eviction_policy: str | None = None  # Redis's maxmemory-policy, where it says
        self.evicted = 0  # keys Redis evicted since this instance started (risky policy only)
        self._evicted_seen: int | None = None  # Redis's evicted_keys at the last look
        self._replicas: dict[str, _Replica] = {}
        self._dirty: dict[str, _Replica] = {}
        self._expiry: list[tuple[float, str]] = []  # a heap of (expires_at, id) of ended ones
        self._wake = anyio.Event()
        self._write_runs = self.redis.register_script(_WRITE_RUNS)
        self._write_meta_script = self.redis.register_script(_WRITE_METAS)
        self._claim = self.redis.register_script(_CLAIM)
        self._sweep_script = self.redis.register_script(_SWEEP)
        self._script_missing = True  # loaded before the first flush, and after a restart
        self._metas: _MetaBatch | None = None  # streams opened since the last meta write
        self._metas_wake = anyio.Event()
        self._opening: dict[str, _MetaBatch] = {}  # until `registered` is awaited
        self._answering = anyio.Event()  # set by the heartbeat when Redis is back
        self._run_id: str | None = None
        self._epoch = 0  # resyncs so far: a write begun before one confirms nothing
        self._tailer = Tailer(
            self.redis,
            self.instance,
            on_error=self._down,
            cluster=cluster,
            presence_ms=_PRESENCE_MS,
            owner_gone_s=_OWNER_GONE_S,
        )

    # -- health, for /readyz and /metrics -------------------------------------------------

    @property
    def degraded(self) -> str | None:
        return None if self.up else "redis"

    def backlog(self) -> int:
        """Events kept here that Redis has not confirmed (all streams)."""
        return sum(rep.unconfirmed() for rep in self._replicas.values())

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("firsttoken_redis_up", "1 while the stream store answers.")
        up.add_metric([], int(self.up))
        yield up
        backlog = GaugeMetricFamily(
            "firsttoken_redis_backlog_events", "Events waiting to be replicated to Redis."
        )
        backlog.add_metric([], self.backlog())
        yield backlog
        dropped = CounterMetricFamily(
            "firsttoken_redis_events_dropped",
            "Events that never reached Redis: they fell off a stream's backlog bound.",
        )
        for rep in self._replicas.values():  # live while Redis is away, not at its return
            self.events_dropped += rep.newly_lost()
        dropped.add_metric([], self.events_dropped)
        yield dropped
        kept = GaugeMetricFamily(
            "firsttoken_redis_kept_streams", "Streams whose events are kept for replication."
        )
        kept.add_metric([], len(self._replicas))
        yield kept
        followed = GaugeMetricFamily(
            "firsttoken_redis_followed_streams",
            "Readers here of other instances' streams, served by the shared tail.",
        )
        followed.add_metric([], self._tailer.count())
        yield followed
        fenced = CounterMetricFamily(
            "firsttoken_redis_fenced_writes",
            "Writes Redis refused because another instance had taken the stream over.",
        )
        fenced.add_metric([], self.fenced)
        yield fenced
        swept = CounterMetricFamily(
            "firsttoken_redis_orphans_swept",
            "Streams of dead instances that no reader took over, ended and billed here.",
        )
        swept.add_metric([], self.orphans_swept)
        yield swept
        outages = CounterMetricFamily("firsttoken_redis_outages", "Times Redis became unreachable.")
        outages.add_metric([], self.outages)
        yield outages
        evicted = CounterMetricFamily(
            "firsttoken_redis_keys_evicted",
            "Keys Redis evicted (maxmemory-policy other than noeviction) since this instance "
            "started: any may have been a spend counter, a limit's or a stream's.",
        )
        evicted.add_metric([], self.evicted)
        yield evicted

    def _set_up(self, up: bool, error: BaseException | None = None) -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            log_event("redis.up", backlog=self.backlog())
        else:
            self.outages += 1
            log_event("redis.down", logging.ERROR, error=repr(error), backlog=self.backlog())
            self._release()

    def _release(self) -> None:
        """`durable`, Redis away or slow: every stream's readers see its events as they come
        from now on. No other instance can take a stream over while Redis does not answer
        (its claim goes through Redis too), so holding them back would stall every reader
        for the outage and protect nothing. A reader shown more than Redis confirmed is past
        the point from which a takeover is exact: if another instance takes the stream over
        before Redis has it (this one was cut off, not Redis), it gets `stream_lost`
        (`_ahead`)."""
        if not self.durable or self.released:
            return
        self.released = True
        log_event("redis.durable_released", logging.WARNING, streams=len(self._replicas))
        for rep in self._replicas.values():
            rep.log.unhold()

    def _hold_again(self) -> None:
        """Redis answers in time again: readers see only what it confirmed from now on; what
        they were shown meanwhile stays shown (ahead of Redis until it confirms it)."""
        if not self.released or not self.up or self._stalled:
            return
        self.released = False
        log_event("redis.durable_held", streams=len(self._replicas))
        for rep in self._replicas.values():
            rep.log.hold_from_next()

    def _write_began(self) -> None:
        self._writing_since = anyio.current_time()
        self._flush_began.set()

    def _write_ended(self, error: BaseException | None) -> None:
        """The flush in flight was answered (`error` None: Redis took it all) or failed."""
        self._writing_since = None
        self._stalled = False
        self._set_up(error is None, error)
        self._hold_again()

    async def _watch_stalls(self) -> None:
        """`durable`: a flush whose reply has not come within `_STALL_S` (Redis stopped,
        blocked by a big write, a network that drops without a reset) releases the readers
        as an outage does; its reply, or its failure, ends that."""
        while True:
            await self._flush_began.wait()
            self._flush_began = anyio.Event()
            since = self._writing_since
            if since is None:
                continue
            await anyio.sleep(max(0.0, since + _STALL_S - anyio.current_time()))
            if self._writing_since == since and not self._stalled:
                self._stalled = True
                log_event("redis.slow", logging.WARNING, waited_s=_STALL_S)
                self._release()

    def _down(self, error: BaseException) -> None:
        self._set_up(False, error)

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]) -> None:
        await self.redis.ping()  # fail at start, not at the first stream
        if not self.cluster:
            await self.redis.script_load(_WRITE_METAS)  # the first burst's call finds it
        self._run_id = await self._server_run_id()
        await self._check_eviction_policy()
        await self._heartbeat_once()
        self._liveness.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._flush_forever)
                tg.start_soon(self._write_metas)
                tg.start_soon(self._heartbeat)
                if self.on_orphaned is not None:
                    tg.start_soon(self._watch_instances, tg)
                if self.durable:
                    tg.start_soon(self._watch_stalls)
                await tg.start(self._tailer.run)
                await tg.start(self._listen_cancels, on_cancel)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                # A drain's last events (server_shutdown) reach Redis before we go, so an
                # instance that stays can still serve the resume.
                with anyio.move_on_after(2.0):
                    try:
                        while self._dirty and self.up:
                            await self._flush_batch()
                    except REDIS_DOWN as exc:
                        log_event("redis.final_flush_failed", logging.WARNING, error=repr(exc))
                # Gone on purpose, after the last write: a reader elsewhere takes the streams
                # over now, not once the key lapses.
                await anyio.to_thread.run_sync(self._liveness.stop)
                await self._leave_instances()
                await self.redis.aclose()

    # -- the owner's side -----------------------------------------------------------------

    def open(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        """Replicate `log` from now, and send the stream's meta with every other stream
        opened in the same turn of the loop (one round trip: a burst of 500 new streams made
        500, each waiting for a connection). The engine may start meanwhile; `registered`
        waits for the write before the stream's id is handed out."""
        rep = self._replica(record, ttl_s, log)
        if not self.up:
            self._mark(rep)  # the flusher writes it when Redis is back
            return
        batch = self._metas
        if batch is None:
            batch = self._metas = _MetaBatch()
            self._metas_wake.set()
        batch.reps.append(rep)
        self._opening[record.id] = batch

    def _replica(self, record: StreamRecord, ttl_s: float, log: EventLog) -> _Replica:
        key, meta = events_key(record.id), meta_key(record.id)
        rep = _Replica(
            record,
            ttl_s,
            key,
            meta,
            log,
            key_arg=resp_arg(key.encode()),
            meta_arg=resp_arg(meta.encode()),
        )
        rep.wanted = partial(self._mark, rep)
        log.on_append = rep.wanted
        if self.durable and not self.released:
            log.hold(log.last_seq)  # what it holds now, Redis has (a takeover's prefix)
        self._replicas[record.id] = rep
        return rep

    def adopt(self, record: StreamRecord, ttl_s: float, log: EventLog, fence: int) -> None:
        """A stream taken over: Redis holds its log up to now and its meta (`claim`)."""
        rep = self._replica(record, ttl_s, log)
        rep.fence = fence
        rep.flushed = log.last_seq
        rep.meta_done = True
        if log.last_seq:
            rep.ttl_done = True
        self._mark(rep)

    async def hand_over(self, stream_ids: Collection[str]) -> None:
        """A drain handed `stream_ids` over (`let_go(flush=True)`): once Redis holds what
        they wrote (at most 2 s), delete this instance's liveness key, so that readers
        elsewhere take them over now, not when this process exits. The streams it goes on
        generating (an SDK's, finished on their connection) are still written; a reader
        elsewhere of one of them would take that one over too, and its reader here gets the
        format's error (`on_fenced`)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and self.up:
            owed = (self._replicas.get(sid) for sid in stream_ids)
            if not any(rep is not None and rep.dirty() for rep in owed):
                break
            await anyio.sleep(0.01)
        self.handed_over = True
        await anyio.to_thread.run_sync(self._liveness.stop)
        # Not to be swept: it bills what it generated (its part of a stream handed over,
        # and the streams it finishes on their connections).
        await self._leave_instances()

    def let_go(self, stream_id: str, *, flush: bool, billed: bytes = b"") -> bool:
        """Stop replicating a stream this instance no longer generates. A hand-over writes
        what Redis lacks first (the final flush, or the next one), and `billed` with it; a
        fenced stream is another instance's, and nothing more of it is written."""
        rep = self._replicas.get(stream_id)
        if rep is None:
            return False
        if flush:
            rep.billed = billed
            rep.expires_at = self.clock()  # gone at the first expiry after its last write
            heapq.heappush(self._expiry, (rep.expires_at, stream_id))
            self._mark(rep)
            return True
        self._forget(stream_id, rep)
        return True

    def _forget(self, stream_id: str, rep: _Replica) -> None:
        del self._replicas[stream_id]
        self._dirty.pop(stream_id, None)
        self._opening.pop(stream_id, None)
        rep.log.on_append = None
        rep.wanted = _nothing  # it holds `rep`: no cycle left for the collector

    async def registered(self, stream_id: str) -> None:
        """Return once the stream's meta is in Redis, so that another instance finds it as
        soon as its id is out; or, Redis failing to take it within 1 s, once the flusher has
        it to write (the store is then degraded, and the stream goes on)."""
        batch = self._opening.pop(stream_id, None)
        if batch is None:
            return
        error = batch.error
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                await batch.done.wait()
            error = batch.error
        except TimeoutError as exc:
            error = exc
        if error is not None:
            self._set_up(False, error)
            rep = self._replicas.get(stream_id)
            if rep is not None and not rep.meta_done:
                self._mark(rep)

    async def register(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        self.open(record, ttl_s, log)
        await self.registered(record.id)

    async def _write_metas(self) -> None:
        """The metas of the streams opened since the last round trip, in one write."""
        while True:
            await self._metas_wake.wait()
            self._metas_wake = anyio.Event()
            batch, self._metas = self._metas, None
            if batch is None:
                continue
            try:
                with anyio.fail_after(_OP_TIMEOUT_S):
                    if self.cluster:  # a script's keys must share a slot: commands there
                        commands = [c for rep in batch.reps for c in self._meta_commands(rep)]
                        replies = await self._send(commands)
                    else:
                        replies = []
                        for reps in _by_request_bytes(batch.reps):
                            replies += await self._meta_call(reps)
            except REDIS_DOWN as exc:
                batch.error = exc
            else:  # an error reply (e.g. OOM) fails the batch as an outage would
                batch.error = next((r for r in replies if isinstance(r, BaseException)), None)
                if batch.error is None:
                    for rep in batch.reps:
                        rep.written_meta()
            finally:
                batch.done.set()

    async def _meta_call(self, reps: list[_Replica]) -> list[Any]:
        """New streams' metas in one Lua call (`_WRITE_METAS`), packed here; the script is
        loaded when Redis does not have it (first use, or after a restart). Returns the
        call's errors as exceptions (none when all went in)."""
        blob: list[bytes] = []
        for rep in reps:
            r = rep.record
            fields = [f.encode() for f in (r.kind, r.token_digest, r.trace_id, r.model, r.tenant)]
            handover = rep.handover()
            fields.append(handover or b"")
            fields.append(rep.end[0].encode() if rep.end is not None else b"")
            blob.append(
                _META_HEAD.pack(
                    int(rep.ttl_s + _LIVE_EXTRA_S),
                    rep.fence,
                    0 if handover is None else 1,
                    *(len(f) for f in fields),
                )
            )
            blob += fields
        packed = b"".join(blob)
        sha = self._write_meta_script.sha
        head = b"*%d\r\n$7\r\nEVALSHA\r\n%b%b" % (
            len(reps) + 5,
            resp_arg(sha.encode()),
            resp_arg(b"%d" % len(reps)),
        )
        command = b"".join(
            (
                head,
                *(rep.meta_arg for rep in reps),
                resp_arg(self.instance.encode()),
                resp_arg(packed),
            )
        )
        single = cast(Redis, self.redis)  # never a cluster here (`_write_metas`)
        for attempt in range(2):
            (reply,) = await roundtrip(single, [command], 1)
            if isinstance(reply, NoScriptError) and not attempt:
                await single.script_load(_WRITE_METAS)
                continue
            if isinstance(reply, BaseException):
                return [reply]
            return [
                ResponseError(f"stream {reply[i]}: {reply[i + 1]}") for i in range(0, len(reply), 2)
            ]
        raise AssertionError("unreachable")

    def finish(self, stream_id: str, outcome: str, last_seq: int, ttl_s: float) -> None:
        rep = self._replicas.get(stream_id)
        if rep is None:
            return
        self._opening.pop(stream_id, None)
        rep.end = (outcome, last_seq)
        rep.ttl_s = ttl_s
        rep.expires_at = self.clock() + ttl_s
        heapq.heappush(self._expiry, (rep.expires_at, stream_id))
        self._mark(rep)

    def release(self, stream_id: str) -> None:
        """The stream's log is about to let its events go: keep those Redis has not
        confirmed yet (they still have to go out)."""
        rep = self._replicas.get(stream_id)
        if rep is not None:
            rep.log = rep.log.detached_after(rep.flushed)

    def _mark(self, rep: _Replica) -> None:
        if not rep.queued:
            rep.queued = True
            self._dirty[rep.record.id] = rep
            self._wake.set()

    def _meta_commands(self, rep: _Replica) -> list[tuple[Any, ...]]:
        """`_META_COMMANDS` commands. The owner and fence are set only where missing: written
        again after a Redis restart, a meta must not take back a stream another instance has
        taken over since (its fence is higher; the next write here is refused)."""
        r = rep.record
        key = meta_key(r.id)
        handover = rep.handover()
        fields: list[Any] = ["kind", r.kind, "digest", r.token_digest, "trace", r.trace_id]
        fields += ("model", r.model, "takeover", 0 if handover is None else 1)
        if handover is not None:
            fields += ("req", handover)
        owned = ("SADD", owned_key(tag_of(key), self.instance), r.id)
        if rep.end is not None:
            fields += ("outcome", rep.end[0])
            owned = ("SREM", *owned[1:])  # ended before its meta went out: nothing to sweep
        fields += ("tenant", r.tenant)  # who may read a response back by id
        return [
            ("HSET", key, *fields),
            ("HSETNX", key, "owner", self.instance),
            ("HSETNX", key, "fence", rep.fence),
            ("EXPIRE", key, int(rep.ttl_s + _LIVE_EXTRA_S)),
            owned,
        ]

    async def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Commands in one round trip, their replies in order (an error reply in its place)."""
        if self.cluster:
            async with self.redis.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                return await pipe.execute(raise_on_error=False)
        single = cast(Redis, self.redis)  # not a cluster
        return await roundtrip(single, [pack(*c) for c in commands], len(commands))

    # -- the flusher ----------------------------------------------------------------------

    async def _flush_forever(self) -> None:
        delay = _RETRY_MIN_S
        last_flush = 0.0
        while True:
            if self.up or not self._dirty:
                await self._wake.wait()
            if self.up:
                # One run per stream per interval: the events of the wait go out together.
                await anyio.sleep(max(0.0, last_flush + self.flush_interval_s - time.monotonic()))
            self._wake = anyio.Event()
            self._expire()
            last_flush = time.monotonic()
            try:
                self._write_began()
                if not self.up:
                    await self._recover()
                # What is dirty now, in batches; what a write in flight makes dirty again waits
                # for the next interval (flushing it at once made runs of one event).
                left = len(self._dirty)
                while left > 0 and self._dirty:
                    left -= await self._flush_batch()
            except REDIS_DOWN as exc:
                self._write_ended(exc)
                # Back off, but go at once when the heartbeat finds Redis answering again.
                with anyio.move_on_after(delay):
                    await self._answering.wait()
                self._answering = anyio.Event()
                delay = min(_RETRY_MAX_S, delay * 2)
                continue
            self._write_ended(None)
            delay = _RETRY_MIN_S

    async def _recover(self) -> None:
        """Redis answers again: if it restarted, it may hold none of our streams."""
        run_id = await self._server_run_id()
        await self._heartbeat_once()
        if run_id is None or run_id != self._run_id:  # None: INFO refused, so assume so
            self._resync(run_id)

    def _resync(self, run_id: str | None) -> None:
        """Redis may hold none of our streams (it restarted), or lost the last writes it
        confirmed (a failover to a replica that had not received them): everything kept goes
        again, from the first kept event."""
        self._run_id = run_id
        self._script_missing = True
        self._epoch += 1
        self.resyncs += 1
        for rep in self._replicas.values():
            self.events_dropped += rep.newly_lost()  # before the gap is written off below
            rep.flushed = rep.trimmed = rep.first - 1
            rep.meta_done = rep.end_done = rep.ttl_done = False
            self._mark(rep)
        log_event("redis.resync", streams=len(self._replicas))

    def _expire(self) -> None:
        now = self.clock()
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, sid = heapq.heappop(expiry)
            rep = self._replicas.get(sid)
            if rep is None or rep.expires_at is None or rep.expires_at > now:
                continue
            if rep.end is None and rep.dirty():  # let go, with events still to write
                heapq.heappush(expiry, (now + self.flush_interval_s, sid))
                continue
            self._forget(sid, rep)

    async def _flush_batch(self) -> int:
        """Write up to `_FLUSH_BATCH` dirty streams in one round trip: the metas that are
        missing and the gaps' trims as commands, then every run and end in one Lua call (one
        per key group on a cluster: a call's keys must share a slot)."""
        if self._script_missing:
            await self.redis.script_load(_WRITE_RUNS)
            self._script_missing = False
        epoch = self._epoch
        batch: list[_Replica] = []
        before: list[tuple[Any, ...]] = []  # the metas and trims
        metas: list[_Replica] = []
        trims: list[tuple[_Replica, int]] = []
        calls: dict[str, _Call] = {}
        for sid in list(self._dirty):
            if len(batch) >= _FLUSH_BATCH:
                break
            rep = self._dirty.pop(sid)
            rep.queued = False
            rep.log.on_append = rep.wanted  # what comes after this run marks it again
            batch.append(rep)
            if not rep.meta_done:
                metas.append(rep)
                before += self._meta_commands(rep)
            first = rep.log.first_seq
            if first > rep.flushed + 1:
                self.events_dropped += rep.newly_lost()
                if rep.trimmed < first - 1:  # a gap: not to be stitched to what follows
                    trims.append((rep, first - 1))
                    before.append(("XTRIM", rep.key, "MINID", f"{first}-0"))
            group = tag_of(rep.key) if self.cluster else ""
            call = calls.get(group)
            if call is None:
                call = calls[group] = _Call()
            self._pack(rep, call)
        try:
            if self.cluster:
                results = await self._write_apart(before, list(calls.values()))
            else:
                (call,) = calls.values()
                pieces = [pack(*c) for c in before]
                pieces += call.packed(self._write_runs.sha)
                results = await roundtrip(cast(Redis, self.redis), pieces, len(before) + 1)
        except BaseException:
            for rep in batch:  # nothing confirmed: all of it goes again
                rep.sent = 0
                rep.end_sent = False
                self._mark(rep)
            raise
        if epoch != self._epoch:  # a resync began meanwhile: all of it goes again anyway
            for rep in batch:
                rep.sent = 0
                rep.end_sent = False
            return len(batch)
        self._confirm(batch, metas, trims, [call.reps for call in calls.values()], results)
        return len(batch)

    async def _write_apart(self, before: list[tuple[Any, ...]], calls: list[_Call]) -> list[Any]:
        """A flush on a cluster, whose pipelines refuse scripts: the metas and trims, then
        the Lua calls (one per group, each to its master, at once)."""
        results: list[Any] = await self._send(before) if before else []
        runs: list[Any] = [None] * len(calls)

        async def call(i: int, c: _Call) -> None:
            try:
                runs[i] = await self.redis.evalsha(
                    self._write_runs.sha, len(c.keys), *c.keys, b"".join(c.blob)
                )
            except REDIS_DOWN as exc:
                runs[i] = exc

        async with anyio.create_task_group() as tg:
            for i, c in enumerate(calls):
                tg.start_soon(call, i, c)
        return results + runs

    def _pack(self, rep: _Replica, call: _Call) -> None:
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
            ttl = int(rep.ttl_s + _LIVE_EXTRA_S)
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

    def _confirm(
        self,
        batch: list[_Replica],
        metas: list[_Replica],
        trims: list[tuple[_Replica, int]],
        calls: list[list[_Replica]],
        results: list[Any],
    ) -> None:
        """Mark what Redis took; a stream with a failed write goes round again, and one that
        another instance took over is let go."""
        failed: BaseException | str | None = None
        fenced: list[_Replica] = []
        for i, rep in enumerate(metas):
            replies = results[_META_COMMANDS * i : _META_COMMANDS * (i + 1)]
            error = next((r for r in replies if isinstance(r, BaseException)), None)
            if error is not None:
                failed = error
            else:
                rep.written_meta()
        at = _META_COMMANDS * len(metas)
        for (rep, upto), result in zip(trims, results[at : at + len(trims)], strict=True):
            if isinstance(result, BaseException):
                failed = result
            else:
                rep.trimmed = upto
        at += len(trims)
        for reps, refused in zip(calls, results[at:], strict=True):
            runs: list[Any] = [1] * len(reps)
            if isinstance(refused, BaseException):
                failed = refused
                if isinstance(refused, NoScriptError):  # e.g. Redis restarted meanwhile
                    self._script_missing = True
                runs = [refused] * len(reps)
            else:
                for i, error in zip(refused[0::2], refused[1::2], strict=True):
                    runs[int(i) - 1] = error
            for rep, result in zip(reps, runs, strict=True):
                if result == 1:
                    if rep.sent:
                        rep.flushed = max(rep.flushed, rep.sent)
                        rep.ttl_done = True
                        if self.durable and not self.released:
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
                rep.sent = 0
                rep.end_sent = False
                rep.billed_sent = False
        for rep in fenced:
            self.fenced += 1
            self._forget(rep.record.id, rep)
            lost = self.durable and _ahead(rep)
            if lost:
                rep.log.unhold()  # they learn it: the log's end goes to them whole
            self.on_fenced(rep.record.id, rep.flushed, lost)
        for rep in batch:
            if rep.dirty() and rep.record.id in self._replicas:
                self._mark(rep)
        if failed is not None:  # e.g. OOM: Redis answers but takes nothing; back off
            raise RedisError(f"Redis refused a replication write: {failed!r}")

    # -- another instance's side ------------------------------------------------------------

    async def lookup(self, stream_id: str) -> StreamRecord | None:
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                meta = await self.redis.hmget(
                    meta_key(stream_id), ["kind", "digest", "trace", "model", "tenant"]
                )
        except REDIS_DOWN as exc:
            self._set_up(False, exc)
            raise _unavailable("streams of other instances cannot be found now") from None
        if meta[0] is None:
            return None
        raw = cast("list[bytes | None]", meta)
        kind, digest, trace, model = (v.decode() for v in cast("list[bytes]", raw[:4]))
        tenant = (raw[4] or b"").decode()  # none in a meta written before it was kept
        return StreamRecord(stream_id, kind, digest, trace, model, tenant=tenant)

    async def delete(self, stream_id: str) -> None:
        rep = self._replicas.get(stream_id)
        if rep is not None:  # nothing more of it is written from here
            self._forget(stream_id, rep)
        keys = (meta_key(stream_id), events_key(stream_id))
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                await self.redis.delete(*keys)
                if rep is not None:
                    # A write of it already in flight lands within a flush: gone after that.
                    await anyio.sleep(self.flush_interval_s)
                    await self.redis.delete(*keys)
        except REDIS_DOWN as exc:
            self._set_up(False, exc)
            raise _unavailable("responses cannot be deleted now") from None

    async def cancel(self, stream_id: str) -> str | None:
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                await self.redis.publish(_CANCEL, stream_id)
        except REDIS_DOWN as exc:
            self._set_up(False, exc)
            raise _unavailable("the cancel could not reach the stream's instance") from None
        with anyio.move_on_after(5):
            while True:
                try:
                    outcome = await self.redis.hget(meta_key(stream_id), "outcome")
                except REDIS_DOWN:
                    outcome = None
                if outcome:
                    return cast(bytes, outcome).decode()  # a raw reply
                await anyio.sleep(0.02)
        return None

    async def has_remote_readers(self, stream_id: str) -> bool:
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                return bool(await self.redis.exists(readers_key(stream_id)))
        except REDIS_DOWN:
            # Unknown while Redis is away: keep the stream (a reader may be there) rather
            # than abandon it; the buffer's bound still holds.
            return True

    async def tail(
        self, stream_id: str, after: int, log: EventLog, resumed: Resumed | None = None
    ) -> Orphan | None:
        """Fill `log` (a mirror on this instance) with the events after `after`, then the live
        tail, until the owner closes the stream, or is gone: then an `Orphan` when the stream
        may be taken over, else `stream_lost`. Through a Redis outage it waits (the reader
        keeps its heartbeats) and goes on from where it was. `resumed`: the reader's last
        event, checked against the store's event of its seq as soon as that is here.

        The catch-up is this reader's own; the live tail is the shared one (`Tailer`)."""
        if not log.last_seq:
            log.begin_at(after)
        after = log.last_seq
        if resumed is not None and (resumed.checked or resumed.seq != after):
            resumed = None
        key = events_key(stream_id)
        # The entry that holds the reader's last event too, while it is to be checked.
        start = f"{after}-0" if resumed is not None else f"({after}-0" if after else "-"
        entries = await self._retrying(lambda: self.redis.xrange(key, min=start, max="+"))
        if entries and after + 1 < (first := _first_seq(entries[0])):
            fail(log, "resume_expired", f"events up to {first - 1} are no longer kept")
            return None
        last = entry_id(entries[-1][0]) if entries else (after, 0)
        if not entries and resumed is not None:
            last = (after - 1, 0)  # the live tail from the entry that may end at its event
        if apply_entries(entries, log, resumed):
            return None
        owner, takeover = await self._retrying(
            lambda: self.redis.hmget(meta_key(stream_id), ["owner", "takeover"])
        )
        follower = Follower(
            key=key,
            presence_key=readers_key(stream_id),
            owner_key=f"ft:instance:{owner.decode()}" if owner else None,
            log=log,
            last=last,
            takeover=takeover == b"1",
            resumed=resumed if resumed is not None and not resumed.checked else None,
        )
        await self._tailer.follow(follower)
        if follower.orphaned and owner:
            return Orphan(owner.decode())
        return None

    async def claim(self, stream_id: str, owner: str, after: int) -> Claim | str:
        """Take `stream_id` over from `owner`, gone, for a reader at `after`: the claim is one
        Lua call (`_CLAIM`); then every event Redis holds, which nobody adds to any more."""
        key = events_key(stream_id)
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                newest = cast(RawEntries, await self.redis.xrevrange(key, count=1))
                if newest and b"end" not in newest[0][1]:
                    held = entry_id(newest[0][0])[0]
                    if after > held:  # the reader saw what died with its owner
                        return "lost"
                oldest = cast(RawEntries, await self.redis.xrange(key, min="-", max="+", count=1))
                if oldest and b"end" not in oldest[0][1] and run_first(oldest[0][1]) > 1:
                    return "lost"  # its start was trimmed: no text to go on from
                answer = await self._claim(keys=[meta_key(stream_id)], args=[owner, self.instance])
            why: str = answer[0].decode()
            if why != "claimed":
                return why
            fence, handover, billed = int(answer[1]), answer[2], answer[3]
            with anyio.fail_after(_OP_TIMEOUT_S * 5):
                entries = cast(RawEntries, await self.redis.xrange(key, min="-", max="+"))
        except REDIS_DOWN as exc:
            self._set_up(False, exc)
            return "gone"
        events: list[tuple[int, bytes, int]] = []
        for _, fields in entries:
            if b"end" in fields:
                break
            if run_first(fields) > len(events) + 1:  # trimmed or lost: no text to go on from
                return "lost"
            last = len(events)
            events += decode_run(fields, last)
        return Claim(fence, owner, handover, events, billed)

    async def _retrying(self, call: Callable[[], Any]) -> Any:
        delay = _RETRY_MIN_S
        while True:
            try:
                return await call()
            except REDIS_DOWN as exc:
                self._set_up(False, exc)
                await anyio.sleep(delay)
                delay = min(_RETRY_MAX_S, delay * 2)

    # -- liveness and cancels -------------------------------------------------------------

    async def _server_run_id(self) -> str | None:
        """Redis's `run_id`, new at every start; on a cluster, every master's (a failover
        puts another one there); None where INFO is not allowed."""
        try:
            if isinstance(self.redis, RedisCluster):
                found = await self.redis.info("server", target_nodes=RedisCluster.PRIMARIES)
                ids = sorted(str(info.get("run_id")) for info in found.values())
                return ",".join(ids)
            info = await self.redis.info("server")
        except ResponseError:  # e.g. a managed Redis that renamed INFO
            return None
        run_id = info.get("run_id")
        return str(run_id) if run_id is not None else None

    async def _heartbeat_once(self) -> None:
        if self.handed_over:
            return
        await self.redis.set(f"ft:instance:{self.instance}", 1, px=_INSTANCE_MS)
        await self.redis.sadd(_INSTANCES, self.instance)

    async def _leave_instances(self) -> None:
        """Gone on purpose: not a dead instance, nothing of it to sweep (what it hands over
        at a drain its own record bills; a claim bills the rest)."""
        with anyio.move_on_after(_OP_TIMEOUT_S):
            try:
                await self.redis.srem(_INSTANCES, self.instance)
                await self.redis.delete(*(owned_key(tag, self.instance) for tag in TAGS))
            except REDIS_DOWN:
                pass  # a survivor sweeps what it left unended: nothing it had not billed

    # -- dead instances' streams that nobody took over ------------------------------------

    async def _watch_instances(self, tg: Any) -> None:
        """Every `_SWEEP_EVERY_S`: which instances heartbeat no more. Of each one dead, one
        survivor (the one whose `SREM` from `ft:instances` took it out) sweeps its streams."""
        missing: dict[str, float] = {}
        while True:
            await anyio.sleep(_SWEEP_EVERY_S)
            try:
                with anyio.fail_after(_OP_TIMEOUT_S):
                    raw = cast("set[bytes]", await self.redis.smembers(_INSTANCES))
                    others = sorted(n.decode() for n in raw if n.decode() != self.instance)
                    alive = [bool(await self.redis.exists(f"ft:instance:{n}")) for n in others]
            except REDIS_DOWN:
                missing.clear()  # through an outage nobody's key can be seen: none is dead
                continue
            for name in dead_instances(others, alive, missing, time.monotonic(), _OWNER_GONE_S):
                try:
                    with anyio.fail_after(_OP_TIMEOUT_S):
                        won = await self.redis.srem(_INSTANCES, name)
                except REDIS_DOWN:
                    continue
                if won:
                    tg.start_soon(self._sweep, name)

    async def _sweep(self, dead: str) -> None:
        """End and bill the streams `dead` left unended that no reader took over, once
        `orphan_grace_s` has passed: in batches of `_SWEEP_BATCH`, each stream one Lua call
        (`_SWEEP`, atomic with the claims), then the events' token counts."""
        log_event("redis.sweep_started", instance=dead, grace_s=self.orphan_grace_s)
        swept = 0
        done = False
        try:
            await anyio.sleep(self.orphan_grace_s)
            for tag in TAGS:
                swept += await self._sweep_group(dead, owned_key(tag, dead))
            done = True
        except Exception as exc:  # a bug must not end the store's task group
            log_event("redis.sweep_failed", logging.ERROR, instance=dead, error=repr(exc))
        finally:
            if not done:  # this instance exits, or failed: another survivor sweeps it again
                with anyio.CancelScope(shield=True), anyio.move_on_after(_OP_TIMEOUT_S):
                    try:
                        await self.redis.sadd(_INSTANCES, dead)
                    except REDIS_DOWN:
                        pass
        log_event("redis.sweep_done", instance=dead, streams=swept)

    async def _sweep_group(self, dead: str, owned: str) -> int:
        """Sweep the streams of one key group in `dead`'s set `owned`; how many were swept."""
        assert self.on_orphaned is not None
        members = await self._retrying(partial(self.redis.smembers, owned))
        ids = sorted(m.decode() for m in cast("set[bytes]", members))
        swept = 0
        for at in range(0, len(ids), _SWEEP_BATCH):
            for orphaned in await self._sweep_batch(dead, owned, ids[at : at + _SWEEP_BATCH]):
                swept += 1
                self.orphans_swept += 1
                try:
                    await self.on_orphaned(orphaned)
                except Exception as exc:  # one failed bill must not stop the rest
                    log_event(
                        "redis.orphan_unbilled",
                        logging.ERROR,
                        stream=orphaned.id,
                        error=repr(exc),
                    )
        await self._retrying(partial(self.redis.delete, owned))
        return swept

    async def _sweep_batch(self, dead: str, owned: str, ids: list[str]) -> list[Orphaned]:
        ttl = max(1, int(self.orphan_ttl_s))
        found: list[tuple[str, list[Any]]] = []
        for sid in ids:  # a cluster's pipelines refuse scripts: one call each
            answer = await self._retrying(
                partial(
                    self._sweep_script,
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

        runs = await self._retrying(read)
        out = []
        for (sid, answer), entries in zip(found, runs, strict=True):
            tokens, complete = tokens_held(entries)
            req, billed, trace = answer[1], answer[2], answer[3].decode()
            log_event("stream.orphan_swept", stream=sid, owner=dead, tokens=tokens)
            if req:  # none: it could not be taken over, and carries no key to bill
                out.append(Orphaned(sid, trace, req, billed, tokens, complete))
        return out

    async def _check_eviction_policy(self) -> None:
        """Say at start, once, that Redis may evict keys of ours: a lost spend counter
        admits a key over its money budget again, and nothing else would tell."""
        try:
            if isinstance(self.redis, RedisCluster):
                found = await self.redis.config_get(
                    "maxmemory-policy", target_nodes=RedisCluster.PRIMARIES
                )
            else:
                found = await self.redis.config_get("maxmemory-policy")
        except ResponseError:  # CONFIG refused (a managed Redis): its docs name the policy
            return
        policies = sorted(_values_of(found, "maxmemory-policy"))
        risky = [p for p in policies if eviction_risk(p) is not None]
        self.eviction_policy = risky[0] if risky else (policies[0] if policies else None)
        if not risky:
            return
        log_event(
            "redis.eviction_policy",
            logging.WARNING,
            policy=risky[0],
            may_evict=eviction_risk(risky[0]),
            fix="CONFIG SET maxmemory-policy noeviction (docs/deploy.md)",
        )
        self._evicted_seen = await self._evicted_keys()

    async def _evicted_keys(self) -> int:
        if isinstance(self.redis, RedisCluster):
            found = await self.redis.info("stats", target_nodes=RedisCluster.PRIMARIES)
            return sum(int(info.get("evicted_keys", 0)) for info in found.values())
        return int((await self.redis.info("stats")).get("evicted_keys", 0))

    async def _count_evictions(self) -> None:
        """Under a policy that evicts: log the keys evicted since the last look (every
        `_EVICTIONS_EVERY` heartbeats)."""
        seen = self._evicted_seen
        assert seen is not None
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                now = await self._evicted_keys()
        except (*REDIS_DOWN, ResponseError):
            return
        self._evicted_seen = now
        grew = now - seen if now >= seen else now  # less: Redis restarted, its count anew
        if grew:
            self.evicted += grew
            log_event(
                "redis.keys_evicted",
                logging.WARNING,
                evicted=grew,
                policy=self.eviction_policy,
                may_evict=eviction_risk(self.eviction_policy or ""),
            )

    async def _heartbeat(self) -> None:
        beats = 0
        while True:
            await anyio.sleep(1)
            self._expire()  # also when no stream is writing
            try:
                with anyio.fail_after(_OP_TIMEOUT_S * 2):
                    await self._heartbeat_once()
            except REDIS_DOWN as exc:
                self._set_up(False, exc)
                continue
            beats += 1
            if self._evicted_seen is not None and beats % _EVICTIONS_EVERY == 0:
                await self._count_evictions()
            if not self.up:
                self._wake.set()  # the flusher recovers, and says so
                self._answering.set()
            elif self.cluster:
                # The cluster client follows a failover without an error the flusher would
                # see: a master that changed may have lost what it confirmed last.
                await self._check_masters()

    async def _check_masters(self) -> None:
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                run_id = await self._server_run_id()
        except REDIS_DOWN:
            return  # the next flush or heartbeat says whether Redis is away
        if run_id is not None and run_id != self._run_id:
            log_event("redis.masters_changed", logging.WARNING)
            self._resync(run_id)

    async def _listen_cancels(
        self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]
    ) -> None:
        started = False
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(_CANCEL)
                if not started:
                    started = True
                    task_status.started()
                async for message in pubsub.listen():
                    if message and message.get("type") == "message":
                        on_cancel(message["data"].decode())
            except Exception as exc:
                # Not only REDIS_DOWN: redis-py 8.1's cluster pub/sub raised AttributeError
                # when its node died under it, and the listener must not end the server.
                if not started:
                    raise
                self._set_up(False, exc)
                await anyio.sleep(_RETRY_MIN_S * 5)  # then subscribe again
            finally:
                with anyio.CancelScope(shield=True):
                    try:
                        # redis-py leaves PubSub.aclose unannotated.
                        await pubsub.aclose()  # type: ignore[no-untyped-call]
                    except Exception:
                        pass  # its connection is gone already


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


def _ahead(rep: _Replica) -> bool:
    """Whether a reader here was shown events Redis had not confirmed (`durable`: only once
    released, or after a restart lost what it had): another instance that took the stream
    over continues from no further than what Redis confirmed, so such a reader, moved there,
    would read another text."""
    return any(reader.cursor > rep.flushed for reader in rep.log.readers)


def _by_request_bytes(reps: list[_Replica]) -> Iterator[list[_Replica]]:
    """`reps` in runs of at most `_META_CALL_BYTES` of stored requests (one at least)."""
    run: list[_Replica] = []
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


def _values_of(found: Any, name: str) -> set[str]:
    """The values of `name` in a CONFIG GET reply: one node's {name: value}, or a cluster's
    {node: {name: value}}; bytes or str, as the client decodes."""
    out: set[str] = set()
    if isinstance(found, dict):
        for key, value in found.items():
            if isinstance(value, dict):
                out |= _values_of(value, name)
            elif (key.decode() if isinstance(key, bytes) else key) == name:
                out.add(value.decode() if isinstance(value, bytes) else str(value))
    return out


def _first_seq(entry: Any) -> int:
    """The first event an entry holds (an end marker: the one after the stream's last)."""
    raw_id, fields = entry
    return entry_id(raw_id)[0] + 1 if b"end" in fields else run_first(fields)
