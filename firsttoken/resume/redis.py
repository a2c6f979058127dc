"""Redis store: streams shared by every gateway instance that points at the same Redis.

Keys (the `{id}` hash tag keeps one stream's keys in one Redis Cluster slot):
  ft:{id}:meta     hash: kind, digest (sha256 of the resume token), trace, model, owner, outcome
  ft:{id}:events   Redis Stream; entry id `<seq>-0` carries the framed event (`w`) and its
                   token count (`t`); a final `<last seq>-1` entry with `end` closes it
  ft:{id}:readers  set with a short expiry while another instance has a reader attached
  ft:instance:<n>  the owner's liveness, refreshed every second
  ft:cancel        pub/sub channel: stream ids to stop, heard by the owner
Writes from the per-token path are queued and flushed in pipelined batches by one task.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskStatus
from redis.asyncio import Redis

from firsttoken.errors import error_body
from firsttoken.observability import log_event
from firsttoken.resume.memory import Event, EventLog
from firsttoken.resume.store import StreamRecord
from firsttoken.sse import encode_event

__all__ = ["RedisStore"]

_CANCEL = "ft:cancel"
_LIVE_EXTRA_S = 3600  # a live stream's keys outlast any sane answer; the TTL applies at the end
_PRESENCE_MS = 3000
_INSTANCE_MS = 5000


def _meta(stream_id: str) -> str:
    return f"ft:{{{stream_id}}}:meta"


def _events(stream_id: str) -> str:
    return f"ft:{{{stream_id}}}:events"


def _readers(stream_id: str) -> str:
    return f"ft:{{{stream_id}}}:readers"


class RedisStore:
    replicates = True

    def __init__(self, url: str, *, max_events: int) -> None:
        self.redis: Redis = Redis.from_url(url)
        self.max_events = max_events
        self.instance = uuid.uuid4().hex
        self._pending: list[tuple[Any, ...]] = []
        self._wake = anyio.Event()

    async def run(self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]) -> None:
        await self.redis.ping()  # fail at start, not at the first stream
        await self._heartbeat_once()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._flush_forever)
                tg.start_soon(self._heartbeat)
                await tg.start(self._listen_cancels, on_cancel)
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await self.redis.aclose()

    async def register(self, record: StreamRecord, ttl_s: float) -> None:
        ttl = int(ttl_s + _LIVE_EXTRA_S)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(
                _meta(record.id),
                mapping={
                    "kind": record.kind,
                    "digest": record.token_digest,
                    "trace": record.trace_id,
                    "model": record.model,
                    "owner": self.instance,
                },
            )
            pipe.expire(_meta(record.id), ttl)
            await pipe.execute()

    def replicate(self, stream_id: str, event: Event) -> None:
        self._pending.append(("event", stream_id, event))
        self._wake.set()

    def finish(self, stream_id: str, outcome: str, last_seq: int, ttl_s: float) -> None:
        self._pending.append(("end", stream_id, outcome, last_seq, ttl_s))
        self._wake.set()

    async def lookup(self, stream_id: str) -> StreamRecord | None:
        meta = await self.redis.hgetall(_meta(stream_id))
        if not meta:
            return None
        m = {k.decode(): v.decode() for k, v in meta.items()}
        return StreamRecord(stream_id, m["kind"], m["digest"], m["trace"], m["model"])

    async def cancel(self, stream_id: str) -> str | None:
        await self.redis.publish(_CANCEL, stream_id)
        with anyio.move_on_after(5):
            while True:
                outcome = await self.redis.hget(_meta(stream_id), "outcome")
                if outcome:
                    return outcome.decode()
                await anyio.sleep(0.02)
        return None

    async def has_remote_readers(self, stream_id: str) -> bool:
        return bool(await self.redis.exists(_readers(stream_id)))

    async def tail(self, stream_id: str, after: int, log: EventLog) -> None:
        """Fill `log` (a mirror on this instance) with the events after `after`, then the live
        tail, until the owner closes the stream or is gone."""
        log.last_seq = after
        key = _events(stream_id)
        entries = await self.redis.xrange(key, min=f"({after}-0" if after else "-", max="+")
        if entries and after + 1 < _seq(entries[0][0]):
            first = _seq(entries[0][0])
            log.append(
                encode_event(
                    log.next_seq,
                    error_body("resume_expired", f"events up to {first - 1} are no longer kept"),
                    "error",
                )
            )
            log.close()
            return
        last_id = entries[-1][0] if entries else f"{after}-0"
        if self._apply(entries, log):
            return
        owner = await self.redis.hget(_meta(stream_id), "owner")
        while True:
            await self.redis.set(_readers(stream_id), self.instance, px=_PRESENCE_MS)
            found = await self.redis.xread({key: last_id}, block=1000, count=1000)
            if found:
                batch = found[0][1]
                last_id = batch[-1][0]
                if self._apply(batch, log):
                    return
            elif owner and not await self.redis.exists(f"ft:instance:{owner.decode()}"):
                log.append(
                    encode_event(
                        log.next_seq,
                        error_body("stream_lost", "the instance generating this stream is gone"),
                        "error",
                    )
                )
                log.close()
                return

    @staticmethod
    def _apply(entries: list[Any], log: EventLog) -> bool:
        """Append entries to the mirror log; True once the end marker is seen."""
        for _, fields in entries:
            if b"end" in fields:
                log.close()
                return True
            log.append(fields[b"w"], int(fields.get(b"t", 0)))
        return False

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            pending, self._pending = self._pending, []
            try:
                await self._flush(pending)
            except Exception as exc:  # Redis down: local streams go on; resume elsewhere won't
                log_event(
                    "redis.flush_failed", logging.ERROR, error=repr(exc), dropped=len(pending)
                )

    async def _flush(self, pending: list[tuple[Any, ...]]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            touched: set[str] = set()
            for op in pending:
                if op[0] == "event":
                    _, stream_id, event = op
                    pipe.xadd(
                        _events(stream_id),
                        {"w": event.wire, "t": event.tokens},
                        id=f"{event.seq}-0",
                        maxlen=self.max_events,
                        approximate=True,
                    )
                    touched.add(stream_id)
                else:
                    _, stream_id, outcome, last_seq, ttl_s = op
                    pipe.xadd(_events(stream_id), {"end": outcome}, id=f"{last_seq}-1")
                    pipe.hset(_meta(stream_id), "outcome", outcome)
                    for key in (_events(stream_id), _meta(stream_id)):
                        pipe.expire(key, max(1, int(ttl_s)))
                    touched.discard(stream_id)
            for stream_id in touched:
                pipe.expire(_events(stream_id), _LIVE_EXTRA_S)
            await pipe.execute()

    async def _heartbeat_once(self) -> None:
        await self.redis.set(f"ft:instance:{self.instance}", 1, px=_INSTANCE_MS)

    async def _heartbeat(self) -> None:
        while True:
            await anyio.sleep(1)
            try:
                await self._heartbeat_once()
            except Exception as exc:
                log_event("redis.heartbeat_failed", logging.WARNING, error=repr(exc))

    async def _listen_cancels(
        self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]
    ) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(_CANCEL)
        task_status.started()
        try:
            async for message in pubsub.listen():
                if message and message.get("type") == "message":
                    on_cancel(message["data"].decode())
        finally:
            with anyio.CancelScope(shield=True):
                await pubsub.aclose()


def _seq(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])
