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
                       survivor bills when <n> dies (`sweeper.py`)
  ft:instances         set: every instance that heartbeats; one whose liveness key is gone is
                       removed by the survivor that sweeps its streams (once: `SREM` says who)
  ft:instance:<n>      the owner's liveness: lives 1.2 s, rewritten every 0.2 s by a thread of
                       its own (a busy event loop does not make an owner look dead); deleted
                       when the instance hands its streams over and exits (`heartbeat.py`)
  ft:cancel            pub/sub channel: stream ids to stop, heard by the owner (`cancels.py`)
  ft:[{g}:]wake:<n>:<l> a reading instance's wake-ups for its shared tail (`tailer.py`)

`RedisStore` is the `EventStore` these parts make together, each with one job:
  replicas.py   the streams this instance owns, what Redis confirmed of each, their expiry
  metas.py      new streams' metas, one call per turn of the loop (nothing waits for it)
  flusher.py    every dirty stream's run and end, one call per flush; fences; resyncs
  health.py     Redis up or down; `durable`'s gates lifted while it is away or slow
  heartbeat.py  this instance's liveness key and its place among the instances
  takeover.py   the claim of a dead owner's stream (one Lua call; the fence goes up)
  sweeper.py    a dead instance's streams nobody took over: ended and billed by one survivor
  cancels.py    the cancel channel
  evictions.py  whether Redis may evict our keys, and how many it did
  tailer.py     one shared tail for every reader here of other instances' streams
Nothing happens here per token: a stream's log tells its replica once that it has new events
(`EventLog.on_append`), and the flusher writes it at most once per `FLUSH_INTERVAL_S`.

A stream outlives its owner: a reader here of a stream whose owner's liveness key is gone
claims it (`Claimer`: one instance wins, and the stream's fence goes up), and the core
continues it from what Redis holds (`core/registry.py`). The old owner, if it was only paused
or cut off, finds its next write refused (`fenced`) and lets go.

Redis going away never touches a local stream. Each stream this instance owns keeps its
events in its log (at most `max_events`; once the resume budget drops the log's events, a log
of those Redis lacks) until it expires, and `flushed`, the highest seq Redis has confirmed.
An event that fell off the bound before Redis confirmed it is counted in
`firsttoken_redis_events_dropped_total`; the stream's older entries are then trimmed in
Redis, and a reader whose next event is in the hole gets `resume_expired` (at the start) or
`stream_lost` (later), never a silent gap.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from typing import Any, cast

import anyio
from anyio.abc import TaskStatus
from prometheus_client.core import Metric

from firsttoken.eventlog import EventLog
from firsttoken.redisclient import REDIS_DOWN, RawEntries, redis_client
from firsttoken.resume.cancels import Cancels
from firsttoken.resume.evictions import Evictions
from firsttoken.resume.flusher import FLUSH_INTERVAL_S, Flusher
from firsttoken.resume.health import OP_TIMEOUT_S, Health, busy, unavailable
from firsttoken.resume.heartbeat import OWNER_GONE_S, Heartbeat, instance_key
from firsttoken.resume.metas import MetaWriter
from firsttoken.resume.redis_keys import events_key, meta_key, readers_key
from firsttoken.resume.redis_metrics import RedisFigures, redis_metrics
from firsttoken.resume.replicas import Replicas
from firsttoken.resume.runs import run_first
from firsttoken.resume.store import BillOrphaned, Claim, Orphan, Resumed, StreamRecord
from firsttoken.resume.sweeper import Sweeper
from firsttoken.resume.tailer import Follower, Tailer, apply_entries, entry_id, fail
from firsttoken.resume.takeover import Claimer

__all__ = ["FLUSH_INTERVAL_S", "RedisStore"]

_OP_TIMEOUT_S = OP_TIMEOUT_S  # what the pool's wait matches (tests/unit/test_redisclient.py)
_PRESENCE_MS = 3000
_HAND_OVER_S = 2.0  # how long a hand-over waits for Redis to hold its streams' last events
_LOOKED_UP = ["kind", "digest", "trace", "model", "tenant"]  # what `lookup` reads of a meta
# A stream not found is asked again after each of these (1 s in all: what its owner's meta
# write may take while Redis comes back, `OP_TIMEOUT_S`), if its id can be one of ours
# (`api.gateway.new_stream_id`: 32 hex digits).
_META_POLLS_S = (0.05, 0.1, 0.15, 0.2, 0.2, 0.3)
_STREAM_ID = re.compile(r"[0-9a-f]{32}")


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
        self.redis = redis = redis_client(url, max_connections=max_connections, cluster=cluster)
        self.cluster = cluster
        self.instance = uuid.uuid4().hex
        # Bills the streams of a dead instance that no reader took over (`Sweeper`); None:
        # no instance is watched. They are swept `orphan_grace_s` after its death is seen,
        # time for a reader that resumes by itself to come back and take its stream over.
        self.on_orphaned: BillOrphaned | None = None
        self.orphan_grace_s = 0.0
        self.orphan_ttl_s = 60.0  # how long a swept stream stays known (its end's TTL)
        self._replicas = Replicas(flush_interval_s=flush_interval_s)
        self._health = Health(self._replicas, durable=durable)
        self._heartbeat = Heartbeat(redis, url, self.instance, self._health, cluster=cluster)
        self._metas = MetaWriter(
            redis, self.instance, self._replicas, self._health, cluster=cluster
        )
        self._flusher = Flusher(
            redis,
            self._replicas,
            self._health,
            self._metas,
            beat=self._heartbeat.once,
            max_events=max_events,
            cluster=cluster,
            flush_interval_s=flush_interval_s,
        )
        self._claimer = Claimer(redis, self.instance, self._health)
        self._sweeper = Sweeper(redis, self.instance, self._health)
        self._cancels = Cancels(redis, self._health)
        self._evictions = Evictions(redis)
        self._tailer = Tailer(
            redis,
            self.instance,
            # Its reads wait for a connection with everyone's: under a burst of readers that
            # wait runs out while Redis answers, which is not an outage (`Health.failed`).
            on_error=self._health.failed,
            cluster=cluster,
            presence_ms=_PRESENCE_MS,
            owner_gone_s=OWNER_GONE_S,
        )
        self._metas.answered = self._flusher.answered
        self._heartbeat.before_beat = self._replicas.expire
        self._heartbeat.on_beat = self._beat_answered

    # -- what the rest of the package reads and sets -----------------------------------------

    @property
    def on_fenced(self) -> Callable[[str, int, bool], None]:
        """Told of each stream another instance took over while this one still generated
        it (`Flusher.on_fenced`)."""
        return self._flusher.on_fenced

    @on_fenced.setter
    def on_fenced(self, told: Callable[[str, int, bool], None]) -> None:
        self._flusher.on_fenced = told

    @property
    def up(self) -> bool:
        return self._health.up

    @up.setter
    def up(self, up: bool) -> None:
        self._health.up = up

    @property
    def outages(self) -> int:
        return self._health.outages

    @property
    def degraded(self) -> str | None:
        return self._health.degraded

    def backlog(self) -> int:
        """Events kept here that Redis has not confirmed (all streams)."""
        return self._replicas.backlog()

    def collect(self) -> Iterator[Metric]:
        return redis_metrics(
            RedisFigures(
                up=self._health.up,
                backlog=self._replicas.backlog(),
                dropped=self._replicas.count_all_lost(),
                kept=len(self._replicas),
                followed=self._tailer.count(),
                fenced=self._flusher.fenced,
                swept=self._sweeper.swept,
                outages=self._health.outages,
                evicted=self._evictions.evicted,
            )
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]) -> None:
        await self.redis.ping()  # fail at start, not at the first stream
        await self._metas.load()
        await self._flusher.start()
        await self._evictions.check_policy()
        await self._heartbeat.once()
        self._heartbeat.start()
        sweeper = self._sweeper
        sweeper.bill, sweeper.grace_s, sweeper.ttl_s = (
            self.on_orphaned,
            self.orphan_grace_s,
            self.orphan_ttl_s,
        )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._flusher.flush_forever)
                tg.start_soon(self._metas.write_forever)
                tg.start_soon(self._heartbeat.beat_forever)
                if sweeper.bill is not None:
                    tg.start_soon(sweeper.watch, tg)
                if self._health.durable:
                    tg.start_soon(self._health.watch_stalls)
                await tg.start(self._tailer.run)
                await tg.start(self._cancels.listen, on_cancel)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self._flusher.final_flush()
                await self._heartbeat.stop()
                await self.redis.aclose()

    async def _beat_answered(self) -> None:
        await self._evictions.on_beat()
        if not self._health.up:
            self._flusher.answered()  # the flusher recovers, and says so
        elif self.cluster:
            await self._flusher.check_masters()

    # -- the owner's side -----------------------------------------------------------------

    def open(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        """Replicate `log` from now, and send the stream's meta with every other stream
        opened in the same turn of the loop (`MetaWriter`). Nothing waits for it: another
        instance asked for the stream before it lands waits for it (`lookup`)."""
        rep = self._replicas.add(record, ttl_s, log, hold=self._health.holding)
        if not self._health.up:
            self._replicas.mark(rep)  # the flusher writes it when Redis is back
        # Tried at once even so: Redis may be back before the flusher knows (up to a
        # heartbeat, 1 s), and a meta late by that long is a reader elsewhere waiting as long.
        self._metas.open(rep)

    def adopt(self, record: StreamRecord, ttl_s: float, log: EventLog, fence: int) -> None:
        """A stream taken over: Redis holds its log up to now and its meta (`claim`)."""
        rep = self._replicas.add(record, ttl_s, log, hold=self._health.holding)
        rep.fence = fence
        rep.flushed = log.last_seq
        rep.meta_done = True
        if log.last_seq:
            rep.ttl_done = True
        self._replicas.mark(rep)

    def finish(self, stream_id: str, outcome: str, last_seq: int, ttl_s: float) -> None:
        rep = self._replicas.get(stream_id)
        if rep is not None:
            self._replicas.finish(rep, outcome, last_seq, ttl_s)

    def release(self, stream_id: str) -> None:
        self._replicas.release(stream_id)

    def let_go(self, stream_id: str, *, flush: bool, billed: bytes = b"") -> bool:
        """Stop replicating a stream this instance no longer generates. A hand-over writes
        what Redis lacks first (the final flush, or the next one), and `billed` with it; a
        fenced stream is another instance's, and nothing more of it is written."""
        rep = self._replicas.get(stream_id)
        if rep is None:
            return False
        if flush:
            self._replicas.let_go(rep, billed)
        else:
            self._replicas.forget(stream_id, rep)
        return True

    async def hand_over(self, stream_ids: Collection[str]) -> None:
        """A drain handed `stream_ids` over (`let_go(flush=True)`): once Redis holds what
        they wrote (at most 2 s), delete this instance's liveness key, so that readers
        elsewhere take them over now, not when this process exits. The streams it goes on
        generating (an SDK's, finished on their connection) are still written; a reader
        elsewhere of one of them would take that one over too, and its reader here gets the
        format's error (`on_fenced`)."""
        deadline = time.monotonic() + _HAND_OVER_S
        while time.monotonic() < deadline and self._health.up:
            owed = (self._replicas.get(sid) for sid in stream_ids)
            if not any(rep is not None and rep.dirty() for rep in owed):
                break
            await anyio.sleep(0.01)
        await self._heartbeat.hand_over()

    # -- another instance's side ------------------------------------------------------------

    async def lookup(self, stream_id: str) -> StreamRecord | None:
        """Another instance's stream, as its meta says; None when there is none. The owner
        hands a new stream's id out before its meta lands (`open`: nothing waits for it on
        the owner, so a Redis restart adds nothing to a first token), so a stream not found
        is asked again for up to 1 s (`_META_POLLS_S`) before it is unknown: its meta may be
        on its way (next turn of the owner's loop, or the flusher's next write while Redis
        comes back). Only ids that can be ours wait (`_STREAM_ID`): any other is unknown at
        once."""
        meta = await self._meta(stream_id)
        if meta is None and _STREAM_ID.fullmatch(stream_id) is not None:
            for delay in _META_POLLS_S:
                await anyio.sleep(delay)
                meta = await self._meta(stream_id)
                if meta is not None:
                    break
        if meta is None:
            return None
        raw = cast("list[bytes | None]", meta)
        kind, digest, trace, model = (v.decode() for v in cast("list[bytes]", raw[:4]))
        tenant = (raw[4] or b"").decode()  # none in a meta written before it was kept
        return StreamRecord(stream_id, kind, digest, trace, model, tenant=tenant)

    async def _meta(self, stream_id: str) -> list[Any] | None:
        """The fields of the stream's meta that `lookup` reads; None when it has none. A call
        that only ran out of time (`busy`: a burst of resumes on a starved loop, Redis
        answering) is tried once more, and then answers this request alone 503: it does not
        take the store down for everyone (`Health.failed`)."""
        for attempt in range(2):
            try:
                with anyio.fail_after(OP_TIMEOUT_S):
                    meta = await self.redis.hmget(meta_key(stream_id), _LOOKED_UP)
            except REDIS_DOWN as exc:
                self._health.failed(exc)
                if not attempt and busy(exc) and self._health.up:
                    continue
                raise unavailable("streams of other instances cannot be found now") from None
            return None if meta[0] is None else meta
        raise AssertionError("unreachable")

    async def delete(self, stream_id: str) -> None:
        rep = self._replicas.get(stream_id)
        if rep is not None:  # nothing more of it is written from here
            self._replicas.forget(stream_id, rep)
        keys = (meta_key(stream_id), events_key(stream_id))
        try:
            with anyio.fail_after(OP_TIMEOUT_S):
                await self.redis.delete(*keys)
                if rep is not None:
                    # A write of it already in flight lands within a flush: gone after that.
                    await anyio.sleep(self._flusher.flush_interval_s)
                    await self.redis.delete(*keys)
        except REDIS_DOWN as exc:
            self._health.failed(exc)
            raise unavailable("responses cannot be deleted now") from None

    async def cancel(self, stream_id: str) -> str | None:
        return await self._cancels.cancel(stream_id)

    async def has_remote_readers(self, stream_id: str) -> bool:
        try:
            with anyio.fail_after(OP_TIMEOUT_S):
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
        retrying = self._health.retrying
        entries = cast(
            RawEntries, await retrying(lambda: self.redis.xrange(key, min=start, max="+"))
        )
        if entries and after + 1 < (first := _first_seq(entries[0])):
            fail(log, "resume_expired", f"events up to {first - 1} are no longer kept")
            return None
        last = entry_id(entries[-1][0]) if entries else (after, 0)
        if not entries and resumed is not None:
            last = (after - 1, 0)  # the live tail from the entry that may end at its event
        if apply_entries(entries, log, resumed):
            return None
        owner, takeover = cast(
            "list[bytes | None]",
            await retrying(lambda: self.redis.hmget(meta_key(stream_id), ["owner", "takeover"])),
        )
        follower = Follower(
            key=key,
            presence_key=readers_key(stream_id),
            owner_key=instance_key(owner.decode()) if owner else None,
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
        return await self._claimer.claim(stream_id, owner, after)


def _first_seq(entry: Any) -> int:
    """The first event an entry holds (an end marker: the one after the stream's last)."""
    raw_id, fields = entry
    return entry_id(raw_id)[0] + 1 if b"end" in fields else run_first(fields)
