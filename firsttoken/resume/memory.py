"""In-memory event log: one per stream, appended by the producer, tailed by readers."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Event", "EventLog", "ResumeExpired"]


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    wire: bytes  # the framed SSE event, ready for the socket
    tokens: int  # content tokens it carries (0 for role/finish/meta/error/[DONE])


class ResumeExpired(Exception):
    """The reader asked for events the log no longer holds."""


class EventLog:
    """Events numbered 1, 2, 3...; the oldest are dropped past `max_events`."""

    def __init__(self, max_events: int = 8192, window: int | None = None) -> None:
        self._events: deque[Event] = deque(maxlen=max_events)
        self._waiters: list[asyncio.Future[None]] = []
        # Backpressure: the producer may run at most `window` events ahead of the slowest
        # attached reader; with none attached, until the buffer holds `max_events` unread.
        self.capacity = max_events
        self.window = min(window or max_events, max_events)
        self._cursors: dict[object, int] = {}
        self._floor = 0
        self._room: asyncio.Future[None] | None = None
        self.last_seq = 0
        self.closed = False
        self.replica: Callable[[Event], None] | None = None  # e.g. the Redis store's queue

    @property
    def next_seq(self) -> int:
        return self.last_seq + 1

    @property
    def first_seq(self) -> int:
        return self._events[0].seq if self._events else self.last_seq + 1

    def append(self, wire: bytes, tokens: int = 0) -> None:
        self.last_seq += 1
        event = Event(self.last_seq, wire, tokens)
        self._events.append(event)
        if self.replica is not None:
            self.replica(event)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def after(self, seq: int) -> list[Event]:
        """Events with a sequence number above `seq` (none if the reader is caught up)."""
        if seq >= self.last_seq:
            return []
        first = self.first_seq
        if seq + 1 < first:
            raise ResumeExpired(f"events up to {first - 1} are no longer kept")
        start = seq + 1 - first
        if start == 0:
            return list(self._events)
        return [self._events[i] for i in range(start, len(self._events))]

    async def wait(self, seq: int) -> None:
        """Return once there is an event after `seq`, the log closes, or `nudge()` is called."""
        if seq < self.last_seq or self.closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    def track(self, reader: object, seq: int) -> None:
        self._cursors[reader] = seq

    def advance(self, reader: object, seq: int) -> None:
        self._cursors[reader] = seq
        if self._room is not None and self.has_room():
            self._release_room()

    def untrack(self, reader: object) -> None:
        seq = self._cursors.pop(reader, 0)
        self._floor = max(self._floor, seq)
        if self._room is not None and self.has_room():
            self._release_room()

    def has_room(self) -> bool:
        if self._cursors:
            return self.last_seq - min(self._cursors.values()) < self.window
        # Nobody reading (the grace window): generate into the buffer until it is full.
        return self.last_seq - self._floor < self.capacity

    async def room(self) -> None:
        """Wait until the readers have caught up enough for the producer to go on."""
        while not self.has_room():
            self._room = asyncio.get_running_loop().create_future()
            await self._room

    def _release_room(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def nudge(self) -> None:
        """Wake the readers (e.g. a heartbeat is due)."""
        self._wake()

    def _wake(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
