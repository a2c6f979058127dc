"""The streams this instance owns, as Redis should hold them, and how much of that it confirmed.

Nothing here is called per token: a stream's log tells `Replicas.mark` once that it has new
events (`EventLog.on_append`, set to the replica's `wanted`), and the flusher (`flusher.py`)
takes the dirty streams from here, writes them, and sets `on_append` again. A stream stays
here until it ended and its TTL ran out (`expire`, on the clock passed in), or another
instance took it over (`forget`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial

import anyio

from firsttoken.eventlog import EventLog
from firsttoken.redisclient import resp_arg
from firsttoken.resume.redis_keys import events_key, meta_key
from firsttoken.resume.store import StreamRecord

__all__ = ["Replica", "Replicas", "ahead"]


def _nothing() -> None:
    return None


@dataclass(slots=True, eq=False)
class Replica:
    """One owned stream as Redis should hold it, and how much of that Redis confirmed.

    Its events are its log's (`EventLog.run_after`): nothing is copied or called per token.
    The log tells the store once that it has new events (`on_append`, set to `wanted`), and
    the flusher asks it again each time it takes the stream's run. Once the log lets its
    events go (the resume budget), `Replicas.release` leaves this a log of what Redis still
    lacks."""

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
    queued: bool = False  # in the dirty set
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
        nothing left to continue; its end deletes one stored before, `flusher.py`)."""
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

    def unsent(self) -> None:
        """The write in flight confirmed nothing of it: all of it goes again."""
        self.sent = 0
        self.end_sent = False
        self.billed_sent = False


def ahead(rep: Replica) -> bool:
    """Whether a reader here was shown events Redis had not confirmed (`durable`: only once
    released, or after a restart lost what it had): another instance that took the stream
    over continues from no further than what Redis confirmed, so such a reader, moved there,
    would read another text."""
    return any(reader.cursor > rep.flushed for reader in rep.log.readers)


class Replicas:
    """The owned streams by id, the dirty ones (for the flusher, woken by `wake`), and a heap
    of when the ended ones are forgotten. `clock` is monotonic (a fake one in tests)."""

    def __init__(
        self, *, flush_interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.flush_interval_s = flush_interval_s
        self.clock = clock
        self.by_id: dict[str, Replica] = {}
        self.dirty: dict[str, Replica] = {}
        self.wake = anyio.Event()  # set when a stream becomes dirty; the flusher renews it
        self.events_dropped = 0  # never reached Redis: fell off a backlog past its bound
        self._expiry: list[tuple[float, str]] = []  # (expires_at, id) of ended ones
        self._later: list[Replica] = []  # ended ones to write again, the newest last

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self.by_id

    def __getitem__(self, stream_id: str) -> Replica:
        return self.by_id[stream_id]

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.by_id.values())

    def get(self, stream_id: str) -> Replica | None:
        return self.by_id.get(stream_id)

    def add(self, record: StreamRecord, ttl_s: float, log: EventLog, *, hold: bool) -> Replica:
        """Replicate `log` from now. `hold` (`durable`, Redis answering): its readers see only
        what Redis has, which is what the log holds now (a takeover's prefix) at first."""
        key, meta = events_key(record.id), meta_key(record.id)
        rep = Replica(
            record,
            ttl_s,
            key,
            meta,
            log,
            key_arg=resp_arg(key.encode()),
            meta_arg=resp_arg(meta.encode()),
        )
        rep.wanted = partial(self.mark, rep)
        log.on_append = rep.wanted
        if hold:
            log.hold(log.last_seq)
        self.by_id[record.id] = rep
        return rep

    def mark(self, rep: Replica) -> None:
        if not rep.queued:
            rep.queued = True
            self.dirty[rep.record.id] = rep
            self.wake.set()

    def take(self, most: int) -> list[Replica]:
        """Up to `most` dirty streams, no longer dirty: what comes after the run about to be
        taken of each marks it again."""
        batch: list[Replica] = []
        for sid in list(self.dirty):
            if len(batch) >= most:
                break
            rep = self.dirty.pop(sid)
            rep.queued = False
            rep.log.on_append = rep.wanted
            batch.append(rep)
        return batch

    def mark_later(self, reps: list[Replica]) -> None:
        """Ended streams to write again after a Redis restart (`mark_some`), the newest first:
        the likeliest to be resumed."""
        self._later = reps

    def mark_some(self, events: int) -> int:
        """Mark for the next flush the next of the `mark_later` streams, up to about `events`
        of their events (one stream at least); returns how many are left."""
        later = self._later
        while later and events > 0:
            rep = later.pop()
            if self.by_id.get(rep.record.id) is rep:  # not forgotten since
                events -= rep.unconfirmed() + 1
                self.mark(rep)
        return len(later)

    def forget(self, stream_id: str, rep: Replica) -> None:
        del self.by_id[stream_id]
        self.dirty.pop(stream_id, None)
        rep.log.on_append = None
        rep.wanted = _nothing  # it holds `rep`: no cycle left for the collector

    def finish(self, rep: Replica, outcome: str, last_seq: int, ttl_s: float) -> None:
        rep.end = (outcome, last_seq)
        rep.ttl_s = ttl_s
        self._expire_at(rep, self.clock() + ttl_s)
        self.mark(rep)

    def let_go(self, rep: Replica, billed: bytes) -> None:
        """Handed over: written to its last event (and `billed` with it), then forgotten at
        the first expiry after that write."""
        rep.billed = billed
        self._expire_at(rep, self.clock())
        self.mark(rep)

    def _expire_at(self, rep: Replica, at: float) -> None:
        rep.expires_at = at
        heapq.heappush(self._expiry, (at, rep.record.id))

    def release(self, stream_id: str) -> None:
        """The stream's log is about to let its events go: keep those Redis has not
        confirmed yet (they still have to go out)."""
        rep = self.by_id.get(stream_id)
        if rep is not None:
            rep.log = rep.log.detached_after(rep.flushed)

    def expire(self) -> None:
        """Forget the ended streams whose TTL ran out (one let go with events still to
        write is looked at again a flush later)."""
        now = self.clock()
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, sid = heapq.heappop(expiry)
            rep = self.by_id.get(sid)
            if rep is None or rep.expires_at is None or rep.expires_at > now:
                continue
            if rep.end is None and rep.dirty():  # let go, with events still to write
                heapq.heappush(expiry, (now + self.flush_interval_s, sid))
                continue
            self.forget(sid, rep)

    def backlog(self) -> int:
        """Events kept here that Redis has not confirmed (all streams)."""
        return sum(rep.unconfirmed() for rep in self.by_id.values())

    def count_lost(self, rep: Replica) -> None:
        self.events_dropped += rep.newly_lost()

    def count_all_lost(self) -> int:
        """`events_dropped`, with what fell off any stream's bound so far (live while Redis
        is away, not only at its return)."""
        for rep in self.by_id.values():
            self.events_dropped += rep.newly_lost()
        return self.events_dropped
