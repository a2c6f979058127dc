"""In-memory event log: one per stream, appended by the producer, read by its readers.

Readers are told of each event as it is appended (`LogReader.deliver`), in the producer's
own call: a caught-up reader writes it to its socket right there, so a token costs no task
wakeup. A reader that is behind (a resume replay, a paused socket) ignores the news and reads
`after(cursor)` when it can write again.
"""

from __future__ import annotations

import asyncio
import sys
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

__all__ = ["Event", "EventLog", "LogReader", "ResumeExpired"]


class Event(NamedTuple):
    seq: int
    wire: bytes  # the framed SSE event, ready for the socket
    tokens: int  # content tokens it carries (0 for role/finish/meta/error/[DONE])


_ONES: dict[int, int] = {}  # no event with a count other than 1
_EVENT_OVERHEAD = sys.getsizeof(b"") + 8  # a bytes object's header, and its slot in the list


def _pair_index(pairs: list[int], seq: int) -> int:
    """Where the first (seq, tokens) pair at or after `seq` starts (pairs in seq order)."""
    return 2 * bisect_left(range(len(pairs) // 2), seq, key=lambda k: pairs[2 * k])


class ResumeExpired(Exception):
    """The reader asked for events the log no longer holds."""


class LogReader(Protocol):
    cursor: int  # the last seq this reader has written

    def deliver(self, seq: int, wire: bytes, tokens: int) -> None: ...

    def log_closed(self) -> None: ...

    def catch_up(self) -> None: ...

    def move_to(self, stream: Any) -> None:
        """Read another stream's log from this reader's cursor on (a takeover)."""
        ...


class EventLog:
    """Events numbered 1, 2, 3...; the oldest are dropped past `max_events`."""

    __slots__ = (
        "_corked",
        "_counts",
        "_floor",
        "_waiters",
        "_wires",
        "_wires_seq",
        "capacity",
        "closed",
        "last_seq",
        "limit",
        "on_append",
        "on_room",
        "readers",
        "window",
    )

    def __init__(self, max_events: int = 8192, window: int | None = None) -> None:
        # Framed bytes only, not an object per event: a token allocates nothing the cyclic
        # garbage collector has to track (at 500 streams its passes cost ~9% of the CPU).
        # Token counts are 1 for almost every event; only the others are written down, as
        # flat (seq, tokens) pairs in seq order: a dict with one entry (a chat stream's
        # opening) would cost a waiting stream 224 bytes, this list 72.
        # A list, trimmed in slices, rather than a deque: a deque's first block costs ~600
        # bytes, which ten thousand waiting streams would each pay for one or two events.
        self._wires: list[bytes] = []
        self._wires_seq = 1  # the seq of _wires[0]
        self._counts: list[int] | None = None
        self.readers: list[LogReader] = []
        # Backpressure: the producer may run at most `window` events ahead of the slowest
        # attached reader; with none attached, until the buffer holds `max_events` unread.
        self.capacity = max_events
        self.window = min(window or max_events, max_events)
        self._floor = 0
        self.on_room: Callable[[], None] | None = None  # the producer, paused for room
        self._waiters: list[asyncio.Future[None]] | None = None  # made by the first wait()
        self.last_seq = 0
        # `--durable`: readers see events up to this seq only (what Redis confirmed); None:
        # every event, as it is appended.
        self.limit: int | None = None
        self.closed = False
        self._corked = False
        # Called by the next append, once: the Redis store learns that a stream has events
        # to write, and sets it again when its flusher takes them. A token costs it nothing.
        self.on_append: Callable[[], None] | None = None

    def begin_at(self, seq: int) -> None:
        """Continue a stream after its event `seq` (a mirror whose reader resumes there: the
        events up to it are not ours to hold). Only on an empty log."""
        assert not self._wires and not self.last_seq, "begin_at on a log that has events"
        self.last_seq = self._floor = seq
        self._wires_seq = seq + 1

    def shown_all(self) -> bool:
        """Closed, and readers may read every event (`--durable`: Redis confirmed them). A
        method, not a property: a property's getter costs a stream ~0.1 µs more a read."""
        return self.closed and (self.limit is None or self.limit >= self.last_seq)

    @property
    def next_seq(self) -> int:
        return self.last_seq + 1

    @property
    def first_seq(self) -> int:
        return max(self._wires_seq, self.last_seq - self.capacity + 1)

    def append(self, wire: bytes, tokens: int = 0) -> int:
        self.last_seq = seq = self.last_seq + 1
        wires = self._wires
        wires.append(wire)
        if len(wires) > self.capacity + (self.capacity >> 3):
            self._trim()
        if tokens != 1:
            if self._counts is None:
                self._counts = [seq, tokens]
            else:
                self._counts += (seq, tokens)
        if self.on_append is not None:
            notify, self.on_append = self.on_append, None
            notify()
        if not self._corked and self.limit is None:
            for reader in self.readers:
                reader.deliver(seq, wire, tokens)
        if self._waiters:
            self._wake()
        return seq

    def close(self) -> None:
        self.closed = True
        if not self._corked and self.shown_all():
            for reader in list(self.readers):
                reader.log_closed()
        self._wake()

    def end_at(self, seq: int) -> None:
        """Let the events after `seq` go, unread: another instance made the stream's events
        from there on (a takeover). A reader already past it keeps what it had."""
        if seq >= self.last_seq:
            return
        keep = seq + 1 - self._wires_seq
        if keep <= 0:
            self._wires = []
            self._wires_seq = seq + 1
        else:
            del self._wires[keep:]
        self.last_seq = seq
        pairs = self._counts
        if pairs:
            del pairs[_pair_index(pairs, seq + 1) :]
            if not pairs:
                self._counts = None
        if self.limit is not None and self.limit > seq:
            self.limit = seq

    def cork(self) -> None:
        """Hold deliveries back, so what is appended next leaves in one write per reader
        (the last token with the closing events)."""
        self._corked = True

    def hold(self, seq: int) -> None:
        """Show readers the events up to `seq` only, from now on (`--durable`: what Redis
        confirmed); raising it writes the newly confirmed events to the caught-up readers."""
        if self.limit is not None and seq <= self.limit:
            return
        self.limit = seq
        if self._corked:
            return
        done = self.closed and seq >= self.last_seq
        for reader in list(self.readers):
            reader.catch_up()
            if done:
                reader.log_closed()

    def unhold(self) -> None:
        """Show readers every event again, as it is appended (`--durable` while Redis is
        away: the owner lets its readers go on rather than wait for the store)."""
        limit = self.limit
        if limit is None:
            return
        self.limit = None
        if self._corked:
            return
        done = self.closed and limit < self.last_seq  # else they were told at the close
        for reader in list(self.readers):
            reader.catch_up()
            if done:
                reader.log_closed()

    def hold_from_next(self) -> None:
        """Hold back what is appended from now on (`--durable`, Redis back): what is there
        was shown already, and its readers told of the close if it is closed."""
        if self.limit is None:
            self.limit = self.last_seq

    def uncork(self) -> None:
        self._corked = False
        done = self.shown_all()
        for reader in list(self.readers):
            reader.catch_up()
            if done:
                reader.log_closed()

    def after(self, seq: int, limit: int | None = None) -> list[Event]:
        """Events with a sequence number above `seq` (none if the reader is caught up)."""
        last = self.last_seq if self.limit is None else min(self.limit, self.last_seq)
        if seq >= last:
            return []
        first = self.first_seq
        if seq + 1 < first:
            raise ResumeExpired(f"events up to {first - 1} are no longer kept")
        start = seq + 1 - first
        offset = first - self._wires_seq  # events kept past the bound until the next trim
        count = last - first + 1
        stop = count if limit is None else min(count, start + limit)
        wires = self._wires
        counts = self._counts_between(first + start, first + stop)
        return [
            Event(first + i, wires[offset + i], counts.get(first + i, 1))
            for i in range(start, stop)
        ]

    def wire(self, seq: int) -> bytes | None:
        """Event `seq` as framed, if kept (shown to readers or not)."""
        if seq < self.first_seq or seq > self.last_seq:
            return None
        return self._wires[seq - self._wires_seq]

    def run_after(self, seq: int) -> tuple[int, list[bytes], dict[int, int]]:
        """The kept events after `seq`, as one run: (its first seq, the wires, the counts
        other than 1 by seq). The wires are the log's own bytes, not copies."""
        first = max(seq + 1, self.first_seq)
        offset = first - self._wires_seq
        wires = self._wires[offset : offset + max(0, self.last_seq - first + 1)]
        return first, wires, self._counts_between(first, self.last_seq + 1)

    def detached_after(self, seq: int) -> EventLog:
        """A new log holding only the kept events after `seq` (the Redis store keeps what it
        has still to write once this log drops its events)."""
        first, wires, counts = self.run_after(seq)
        log = EventLog(self.capacity, self.window)
        log.begin_at(first - 1)
        for i, wire in enumerate(wires):
            log.append(wire, counts.get(first + i, 1))
        return log

    def nbytes(self) -> int:
        """What the kept events cost in memory (what the resume budget counts, once, at the
        end): their bytes, and each one's object header and list slot."""
        wires = self._wires
        return sum(map(len, wires)) + len(wires) * _EVENT_OVERHEAD

    def drop(self) -> None:
        """Let go of every kept event (a finished stream's buffer, for the resume budget): a
        reader that asks for any of them gets `ResumeExpired`, as if they had expired."""
        self._wires = []
        self._wires_seq = self.last_seq + 1
        self._counts = None

    def _counts_between(self, lo: int, hi: int) -> dict[int, int]:
        """The counts other than 1 of events lo..hi-1. A coalesced stream has one per event:
        a replay batch finds its first by bisection, not by reading the whole log's."""
        pairs = self._counts
        if not pairs or pairs[-2] < lo:  # most runs of a chat stream: its opening is older
            return _ONES
        i = _pair_index(pairs, lo)
        found: dict[int, int] = {}
        while i < len(pairs) and pairs[i] < hi:
            found[pairs[i]] = pairs[i + 1]
            i += 2
        return found

    def _trim(self) -> None:
        """Drop what is past `capacity`, an eighth of it at a time (amortised O(1))."""
        drop = len(self._wires) - self.capacity
        del self._wires[:drop]
        self._wires_seq += drop
        pairs = self._counts
        if pairs:
            del pairs[: _pair_index(pairs, self._wires_seq)]
            if not pairs:
                self._counts = None

    # -- readers and backpressure ----------------------------------------------------------

    def attach(self, reader: LogReader) -> None:
        self.readers.append(reader)

    def detach(self, reader: LogReader) -> None:
        if reader in self.readers:
            self.readers.remove(reader)
            self._floor = max(self._floor, reader.cursor)
            self.advanced()

    def advanced(self) -> None:
        """A reader moved its cursor: let a producer paused for room go on."""
        if self.on_room is not None and self.has_room():
            resume, self.on_room = self.on_room, None
            resume()

    def has_room(self) -> bool:
        readers = self.readers
        last = self.last_seq
        if self.limit is not None:  # readers are judged on what they may read
            if last - self.limit >= self.capacity:
                return False
            last = self.limit
        if len(readers) == 1:
            return last - readers[0].cursor < self.window
        if readers:
            return last - min(r.cursor for r in readers) < self.window
        # Nobody reading (the grace window): generate into the buffer until it is full.
        return self.last_seq - self._floor < self.capacity

    def release_floor(self) -> None:
        """Count everything so far as read (a reader elsewhere reads it from Redis)."""
        self._floor = self.last_seq
        self.advanced()

    # -- waiting (mirrors, and handlers that need to know whether anything is there) -------

    async def wait(self, seq: int) -> None:
        """Return once there is an event after `seq` or the log closes."""
        if seq < self.last_seq or self.closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        await waiter

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)
