"""Redis store: streams shared by every gateway instance that points at the same Redis.

Keys (the `{id}` hash tag keeps one stream's keys in one Redis Cluster slot):
  ft:{id}:meta     hash: kind, digest (sha256 of the resume token), trace, model, owner, outcome
  ft:{id}:events   Redis Stream; entry id `<seq>-0` carries the framed event (`w`) and its
                   token count (`t`); a final `<last seq>-1` entry with `end` closes it
  ft:{id}:readers  set with a short expiry while another instance has a reader attached
  ft:instance:<n>  the owner's liveness, refreshed every second
  ft:cancel        pub/sub channel: stream ids to stop, heard by the owner
  ft:wake:<n>:<l>  a reading instance's wake-ups for its shared tail (`tailer.py`)
Writes from the per-token path are queued and flushed in pipelined batches by one task.
Reads of other instances' streams go through one shared tail (`Tailer`), whatever their number.

Redis going away never touches a local stream: the per-token path only appends to a
replica's deque. Each stream this instance owns keeps its events (`(seq, wire, tokens)`
tuples sharing the log's bytes, at most `max_events`; tuples of ints and bytes are dropped
from the cyclic GC's view, so a kept event costs its passes nothing) until it expires, and
`flushed`, the highest seq Redis
has confirmed. The flusher retries with backoff while Redis is down; when it is back, each
stream's backlog (events after `flushed`) goes out, and if Redis restarted (its run id
changed, so it may have lost everything) every kept stream is written again from its first
kept event. An event that fell off the bound before Redis confirmed it is counted in
`firsttoken_redis_events_dropped_total`; the stream's older entries are then trimmed in
Redis, so a resume from before the gap gets `resume_expired` instead of a silent hole.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskStatus
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from firsttoken.core.eventlog import Event, EventLog
from firsttoken.observability import log_event
from firsttoken.redisclient import redis_client
from firsttoken.resume.store import StreamRecord
from firsttoken.resume.tailer import Follower, Tailer, apply_entries, entry_id, fail
from firsttoken.wire.errors import APIError

__all__ = ["RedisStore"]

_CANCEL = "ft:cancel"
_LIVE_EXTRA_S = 3600  # a live stream's keys outlast any sane answer; the TTL applies at the end
_PRESENCE_MS = 3000
_INSTANCE_MS = 5000
_OP_TIMEOUT_S = 1.0  # a request-path Redis call waits no longer than this
_RETRY_MIN_S, _RETRY_MAX_S = 0.1, 2.0  # the flusher's backoff while Redis is down
_FLUSH_BATCH = 4096  # commands per pipeline round trip


def _meta(stream_id: str) -> str:
    return f"ft:{{{stream_id}}}:meta"


def _events(stream_id: str) -> str:
    return f"ft:{{{stream_id}}}:events"


def _readers(stream_id: str) -> str:
    return f"ft:{{{stream_id}}}:readers"


def _unavailable(what: str) -> APIError:
    return APIError(
        503,
        "store_unavailable",
        f"the shared stream store (Redis) is unreachable; {what}",
        headers={"retry-after": "1"},
    )


_Kept = tuple[int, bytes, int]  # (seq, framed wire, tokens)
_SEQ = 0


@dataclass(slots=True, eq=False)
class _Replica:
    """One owned stream as Redis should hold it, and how much of that Redis confirmed."""

    record: StreamRecord
    ttl_s: float
    events: deque[_Kept]
    flushed: int = 0  # highest seq Redis confirmed
    trimmed: int = 0  # entries up to this seq were trimmed in Redis after a gap
    meta_done: bool = False
    end: tuple[str, int] | None = None  # (outcome, last seq) once the stream finished
    end_done: bool = False
    expires_at: float | None = None  # monotonic; set at the end
    ops: list[tuple[str, int]] = field(default_factory=list)  # in flight: (kind, seq)

    def dirty(self) -> bool:
        last = self.events[-1][_SEQ] if self.events else 0
        ended = self.end is not None and not self.end_done
        return not self.meta_done or last > self.flushed or ended


class RedisStore:
    replicates = True

    def __init__(self, url: str, *, max_events: int, max_connections: int) -> None:
        self.redis: Redis = redis_client(url, max_connections=max_connections)
        self.max_events = max_events
        self.instance = uuid.uuid4().hex
        self.up = True
        self.events_dropped = 0  # never reached Redis: fell off a backlog past its bound
        self.outages = 0
        self.resyncs = 0
        self._replicas: dict[str, _Replica] = {}
        self._dirty: dict[str, _Replica] = {}
        self._wake = anyio.Event()
        self._answering = anyio.Event()  # set by the heartbeat when Redis is back
        self._run_id: str | None = None
        self._tailer = Tailer(
            self.redis,
            self.instance,
            on_error=self._down,
            presence_ms=_PRESENCE_MS,
            owner_gone_s=_INSTANCE_MS / 1000,
        )

    # -- health, for /readyz and /metrics -------------------------------------------------

    @property
    def degraded(self) -> str | None:
        return None if self.up else "redis"

    def backlog(self) -> int:
        """Events kept here that Redis has not confirmed (all streams)."""
        total = 0
        for rep in self._replicas.values():
            if rep.events:
                last, first = rep.events[-1][_SEQ], rep.events[0][_SEQ]
                total += max(0, last - max(rep.flushed, first - 1))
        return total

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
        outages = CounterMetricFamily("firsttoken_redis_outages", "Times Redis became unreachable.")
        outages.add_metric([], self.outages)
        yield outages

    def _set_up(self, up: bool, error: BaseException | None = None) -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            log_event("redis.up", backlog=self.backlog())
        else:
            self.outages += 1
            log_event("redis.down", logging.ERROR, error=repr(error), backlog=self.backlog())

    def _down(self, error: BaseException) -> None:
        self._set_up(False, error)

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]) -> None:
        await self.redis.ping()  # fail at start, not at the first stream
        self._run_id = await self._server_run_id()
        await self._heartbeat_once()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._flush_forever)
                tg.start_soon(self._heartbeat)
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
                    except (RedisError, OSError, TimeoutError) as exc:
                        log_event("redis.final_flush_failed", logging.WARNING, error=repr(exc))
                await self.redis.aclose()

    # -- the owner's side -----------------------------------------------------------------

    async def register(self, record: StreamRecord, ttl_s: float) -> None:
        rep = _Replica(record, ttl_s, deque(maxlen=self.max_events))
        self._replicas[record.id] = rep
        if self.up:
            # Written before the stream is announced, so another instance can find it at once.
            try:
                with anyio.fail_after(_OP_TIMEOUT_S):
                    async with self.redis.pipeline(transaction=False) as pipe:
                        self._queue_meta(pipe, rep)
                        await pipe.execute()
                rep.meta_done = True
                return
            except (RedisError, OSError, TimeoutError) as exc:
                self._set_up(False, exc)
        self._mark(rep)  # the flusher writes it when Redis is back

    def replicate(self, stream_id: str, event: Event) -> None:
        rep = self._replicas.get(stream_id)
        if rep is None:
            return
        events = rep.events
        if len(events) == events.maxlen and events[0][_SEQ] > rep.flushed:
            self.events_dropped += 1  # the bound is reached before Redis took the oldest
        events.append((event.seq, event.wire, event.tokens))
        self._mark(rep)

    def finish(self, stream_id: str, outcome: str, last_seq: int, ttl_s: float) -> None:
        rep = self._replicas.get(stream_id)
        if rep is None:
            return
        rep.end = (outcome, last_seq)
        rep.ttl_s = ttl_s
        rep.expires_at = time.monotonic() + ttl_s
        self._mark(rep)

    def release(self, stream_id: str) -> None:
        """Keep only what Redis has not confirmed yet (it still has to go out)."""
        rep = self._replicas.get(stream_id)
        if rep is None:
            return
        events = rep.events
        while events and events[0][_SEQ] <= rep.flushed:
            events.popleft()

    def _mark(self, rep: _Replica) -> None:
        self._dirty[rep.record.id] = rep
        self._wake.set()

    def _queue_meta(self, pipe: Any, rep: _Replica) -> None:
        r = rep.record
        mapping = {
            "kind": r.kind,
            "digest": r.token_digest,
            "trace": r.trace_id,
            "model": r.model,
            "owner": self.instance,
        }
        if rep.end is not None:
            mapping["outcome"] = rep.end[0]
        pipe.hset(_meta(r.id), mapping=mapping)
        pipe.expire(_meta(r.id), int(rep.ttl_s + _LIVE_EXTRA_S))

    # -- the flusher ----------------------------------------------------------------------

    async def _flush_forever(self) -> None:
        delay = _RETRY_MIN_S
        while True:
            if self.up or not self._dirty:
                await self._wake.wait()
            self._wake = anyio.Event()
            self._expire()
            try:
                if not self.up:
                    await self._recover()
                while self._dirty:
                    await self._flush_batch()
            except (RedisError, OSError, TimeoutError) as exc:
                self._set_up(False, exc)
                # Back off, but go at once when the heartbeat finds Redis answering again.
                with anyio.move_on_after(delay):
                    await self._answering.wait()
                self._answering = anyio.Event()
                delay = min(_RETRY_MAX_S, delay * 2)
                continue
            self._set_up(True)
            delay = _RETRY_MIN_S

    async def _recover(self) -> None:
        """Redis answers again: if it restarted, it may hold none of our streams."""
        run_id = await self._server_run_id()
        await self._heartbeat_once()
        if run_id is None or run_id != self._run_id:  # None: INFO refused, so assume so
            self._run_id = run_id
            self.resyncs += 1
            for rep in self._replicas.values():
                # Redis holds nothing of it: everything kept goes again, from the first kept.
                rep.flushed = rep.trimmed = rep.events[0][_SEQ] - 1 if rep.events else 0
                rep.meta_done = rep.end_done = False
                self._dirty[rep.record.id] = rep
            log_event("redis.resync", streams=len(self._replicas))

    def _expire(self) -> None:
        now = time.monotonic()
        gone = [
            sid
            for sid, rep in self._replicas.items()
            if rep.expires_at is not None and rep.expires_at <= now
        ]
        for sid in gone:
            del self._replicas[sid]
            self._dirty.pop(sid, None)

    async def _flush_batch(self) -> None:
        batch: list[_Replica] = []
        commands = 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for sid in list(self._dirty):
                if commands >= _FLUSH_BATCH:
                    break
                rep = self._dirty.pop(sid)
                commands += self._queue(pipe, rep)
                batch.append(rep)
            try:
                results = await pipe.execute(raise_on_error=False)
            except BaseException:
                for rep in batch:  # nothing confirmed: all of it goes again
                    rep.ops.clear()
                    self._dirty.setdefault(rep.record.id, rep)
                raise
        self._confirm(batch, results)

    def _queue(self, pipe: Any, rep: _Replica) -> int:
        """Queue what Redis lacks of one stream; each command's meaning goes in `rep.ops`."""
        sid = rep.record.id
        ops = rep.ops
        ops.clear()
        if not rep.meta_done:
            self._queue_meta(pipe, rep)
            ops += [("meta", 0), ("meta-ttl", 0)]
        first = rep.events[0][_SEQ] if rep.events else rep.flushed + 1
        if first > rep.flushed + 1 and rep.trimmed < first - 1:
            # A gap: what Redis holds before it must not be stitched to what follows.
            pipe.xtrim(_events(sid), minid=f"{first}-0")
            ops.append(("trim", first - 1))
        for seq, wire, tokens in _unconfirmed(rep):
            pipe.xadd(
                _events(sid),
                {"w": wire, "t": tokens},
                id=f"{seq}-0",
                maxlen=self.max_events,
                approximate=True,
            )
            ops.append(("event", seq))
        if rep.end is not None and not rep.end_done:
            outcome, last_seq = rep.end
            pipe.xadd(_events(sid), {"end": outcome}, id=f"{last_seq}-1")
            pipe.hset(_meta(sid), "outcome", outcome)
            for key in (_events(sid), _meta(sid)):
                pipe.expire(key, max(1, int(rep.ttl_s)))
            ops += [("end", last_seq), ("outcome", 0), ("ttl", 0), ("ttl", 0)]
        else:
            pipe.expire(_events(sid), int(rep.ttl_s + _LIVE_EXTRA_S))
            ops.append(("ttl", 0))
        return len(ops)

    def _confirm(self, batch: list[_Replica], results: list[Any]) -> None:
        """Mark what Redis took; a stream with a failed command goes round again."""
        i = 0
        failed: BaseException | None = None
        for rep in batch:
            mine, i = results[i : i + len(rep.ops)], i + len(rep.ops)
            for (kind, seq), result in zip(rep.ops, mine, strict=True):
                if isinstance(result, ResponseError) and "equal or smaller" in str(result):
                    result = None  # already there: written before an interrupted reply
                if isinstance(result, BaseException):
                    failed = result
                    break
                if kind == "event":
                    rep.flushed = seq
                elif kind == "trim":
                    rep.trimmed = seq
                elif kind == "meta":
                    rep.meta_done = True
                elif kind == "end":
                    rep.end_done = True
            rep.ops.clear()
            if rep.dirty() and rep.record.id in self._replicas:
                self._dirty.setdefault(rep.record.id, rep)
        if failed is not None:  # e.g. OOM: Redis answers but takes nothing; back off
            raise RedisError(f"Redis refused a replication write: {failed!r}")

    # -- another instance's side ------------------------------------------------------------

    async def lookup(self, stream_id: str) -> StreamRecord | None:
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                meta = await self.redis.hgetall(_meta(stream_id))
        except (RedisError, OSError, TimeoutError) as exc:
            self._set_up(False, exc)
            raise _unavailable("streams of other instances cannot be found now") from None
        if not meta:
            return None
        m = {k.decode(): v.decode() for k, v in meta.items()}
        return StreamRecord(stream_id, m["kind"], m["digest"], m["trace"], m["model"])

    async def cancel(self, stream_id: str) -> str | None:
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                await self.redis.publish(_CANCEL, stream_id)
        except (RedisError, OSError, TimeoutError) as exc:
            self._set_up(False, exc)
            raise _unavailable("the cancel could not reach the stream's instance") from None
        with anyio.move_on_after(5):
            while True:
                try:
                    outcome = await self.redis.hget(_meta(stream_id), "outcome")
                except (RedisError, OSError):
                    outcome = None
                if outcome:
                    return outcome.decode()
                await anyio.sleep(0.02)
        return None

    async def has_remote_readers(self, stream_id: str) -> bool:
        try:
            with anyio.fail_after(_OP_TIMEOUT_S):
                return bool(await self.redis.exists(_readers(stream_id)))
        except (RedisError, OSError, TimeoutError):
            # Unknown while Redis is away: keep the stream (a reader may be there) rather
            # than abandon it; the buffer's bound still holds.
            return True

    async def tail(self, stream_id: str, after: int, log: EventLog) -> None:
        """Fill `log` (a mirror on this instance) with the events after `after`, then the live
        tail, until the owner closes the stream or is gone. Through a Redis outage it waits
        (the reader keeps its heartbeats) and goes on from where it was.

        The catch-up is this reader's own; the live tail is the shared one (`Tailer`)."""
        log.begin_at(after)
        key = _events(stream_id)
        entries = await self._retrying(
            lambda: self.redis.xrange(key, min=f"({after}-0" if after else "-", max="+")
        )
        if entries and after + 1 < (first := entry_id(entries[0][0])[0]):
            fail(log, "resume_expired", f"events up to {first - 1} are no longer kept")
            return
        last = entry_id(entries[-1][0]) if entries else (after, 0)
        if apply_entries(entries, log):
            return
        owner = await self._retrying(lambda: self.redis.hget(_meta(stream_id), "owner"))
        await self._tailer.follow(
            Follower(
                key=key,
                presence_key=_readers(stream_id),
                owner_key=f"ft:instance:{owner.decode()}" if owner else None,
                log=log,
                last=last,
            )
        )

    async def _retrying(self, call: Callable[[], Any]) -> Any:
        delay = _RETRY_MIN_S
        while True:
            try:
                return await call()
            except (RedisError, OSError) as exc:
                self._set_up(False, exc)
                await anyio.sleep(delay)
                delay = min(_RETRY_MAX_S, delay * 2)

    # -- liveness and cancels -------------------------------------------------------------

    async def _server_run_id(self) -> str | None:
        """Redis's `run_id`, new at every start; None where INFO is not allowed."""
        try:
            info = await self.redis.info("server")
        except ResponseError:  # e.g. a managed Redis that renamed INFO
            return None
        run_id = info.get("run_id")
        return str(run_id) if run_id is not None else None

    async def _heartbeat_once(self) -> None:
        await self.redis.set(f"ft:instance:{self.instance}", 1, px=_INSTANCE_MS)

    async def _heartbeat(self) -> None:
        while True:
            await anyio.sleep(1)
            self._expire()  # also when no stream is writing
            try:
                with anyio.fail_after(_OP_TIMEOUT_S * 2):
                    await self._heartbeat_once()
            except (RedisError, OSError, TimeoutError) as exc:
                self._set_up(False, exc)
                continue
            if not self.up:
                self._wake.set()  # the flusher recovers, and says so
                self._answering.set()

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
            except (RedisError, OSError) as exc:
                if not started:
                    raise
                self._set_up(False, exc)
                await anyio.sleep(_RETRY_MIN_S * 5)  # then subscribe again
            finally:
                with anyio.CancelScope(shield=True):
                    await pubsub.aclose()


def _unconfirmed(rep: _Replica) -> list[_Kept]:
    """The kept events after `flushed`, oldest first (walked from the new end: O(new))."""
    out: list[_Kept] = []
    for event in reversed(rep.events):
        if event[_SEQ] <= rep.flushed:
            break
        out.append(event)
    out.reverse()
    return out
