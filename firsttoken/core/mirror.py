"""A mirror: a stream another instance generates, read here.

Its producer is not an engine but a tail of the shared store (Redis): the events the owner
replicates are appended to the mirror's own log, and this instance's readers read that log as
they read any other. It knows the resume token only by its digest, and cancelling it asks the
owner through the store. When the owner is gone, the tail asks the registry to take the stream
over, which hands the mirror's readers to the stream it continues here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio

from firsttoken.core.stream import BaseStream, Events, Keeper, Outcome
from firsttoken.eventlog import EventLog
from firsttoken.formats.rebuild import error_events
from firsttoken.generation import EngineError, GenerationRequest
from firsttoken.resume import EventStore, Orphan, Resumed, StreamRecord
from firsttoken.resume.tailer import fail

__all__ = ["Mirror", "TakeOver"]

# The registry's: True once the mirror's readers have their answer, False to follow again.
TakeOver = Callable[["Mirror", Orphan], Awaitable[bool]]
_FOLLOW_AGAIN_S = 5.0  # how long a takeover may find the stream nowhere before it is lost


class Mirror(BaseStream):
    """A stream another instance generates, as this instance's readers read it."""

    # ended_there: True once the store said the stream ended (its end marker, or an error
    # event): a log closed otherwise (handed over, its tail stopped) is cut here, not the
    # stream's end. resumed: its reader's last event, to check against the store's.
    # successor: the stream continued here once this instance took it over; a reader that
    # comes to the mirror after that (it found the mirror before) reads it instead.
    __slots__ = ("ended_there", "resumed", "successor")

    # Nothing renders here: the owner's renderer made every event (the API layer asks).
    renderer = None

    def __init__(self, record: StreamRecord, *, max_events: int) -> None:
        request = GenerationRequest(
            request_id=record.id, prompt="", model=record.model, tenant=record.tenant
        )
        super().__init__(request, record.format, record.trace_id, EventLog(max_events))
        self.token_digest = record.token_digest
        self.ended_there = False
        self.resumed: Resumed | None = None
        self.successor: BaseStream | None = None

    @property
    def ended(self) -> bool:
        return self.outcome is not None or self.log.closed

    def error_events(self, code: str, message: str) -> Events:
        return error_events(self.format, code, message)

    def stop(self, reason: Outcome, error: EngineError | None = None) -> None:
        """Stop tailing (the owner's generation is the owner's to stop)."""
        if self.generation is not None:
            self.generation.cancel()

    def move(self) -> None:
        """Stop tailing without an end: its readers come back with Last-Event-ID on
        another instance (this one is on its way out)."""
        if self.generation is not None:
            self.generation.cancel()
        self.outcome = Outcome.MOVED
        self.log.close()

    async def cancel(self, store: EventStore) -> str:
        """Ask its owner, through the store, to stop it."""
        return await store.cancel(self.id) or "cancelling"

    def last_reader_left(self, keeper: Keeper) -> None:
        self.stop(Outcome.DISCONNECTED)  # the owner keeps the grace; the tail stops

    def follow(self, store: EventStore, after: int, take_over: TakeOver | None = None) -> _Tail:
        """The producer: a tail of the store from `after`, run by the caller's task group."""
        tail = _Tail(self, store, after, take_over)
        self.generation = tail
        return tail


class _Tail:
    """The mirror's producer (a `Generation`): it has no pace to pause, only an end."""

    def __init__(
        self, mirror: Mirror, store: EventStore, after: int, take_over: TakeOver | None
    ) -> None:
        self.mirror = mirror
        self.store = store
        self.after = after
        self.take_over = take_over
        self.scope = anyio.CancelScope()

    async def run(self) -> None:
        log = self.mirror.log
        with self.scope:
            since: float | None = None
            while True:
                orphan = await self.store.tail(self.mirror.id, self.after, log, self.mirror.resumed)
                if log.closed:  # by the store: the stream's end, or its error event
                    self.mirror.ended_there = self.mirror.outcome is None
                    break
                if orphan is None or self.take_over is None:
                    break
                if await self.take_over(self.mirror, orphan):
                    return  # its readers read the stream continued here (or were told)
                # Another instance has it, or the store could not say: follow it again.
                now = time.monotonic()
                since = since or now
                if now - since > _FOLLOW_AGAIN_S:
                    fail(log, "stream_lost", "the instance generating this stream is gone")
                    self.mirror.ended_there = True
                    break
                await anyio.sleep(0.05)
        if not log.closed:
            log.close()

    def resume(self) -> None:
        return None

    def cancel(self) -> None:
        self.scope.cancel()
