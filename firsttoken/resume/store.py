"""Where streams are shared beyond this process: nowhere (memory) or Redis.

The local `EventLog` is always the live buffer that this instance's readers tail. A store
replicates it so that another instance can find the stream, replay and tail it, hear that a
reader is attached there, and ask the owner to cancel it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio
from anyio.abc import TaskStatus

from firsttoken.eventlog import EventLog
from firsttoken.formats.sse import event_id_of

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = [
    "LOST_AHEAD",
    "Claim",
    "EventStore",
    "MemoryStore",
    "Orphan",
    "Orphaned",
    "Resumed",
    "StreamRecord",
    "token_digest",
]


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StreamRecord:
    id: str
    format: str  # the API format ("native", "openai", ...): decides the connection preamble
    token_digest: str
    trace_id: str
    model: str
    # What another instance needs to continue the stream (its request, key and format; see
    # `api/takeover.py`), stored with it; None: it cannot be taken over.
    handover: bytes | None = None
    tenant: str = ""  # the key that created it: only that key reads a response back by id


LOST_AHEAD = (
    "this reader was sent events the shared store never got (their instance is gone), and "
    "the instance that took the stream over made others in their place"
)


@dataclass(slots=True, eq=False)
class Resumed:
    """A reader back with `id`, the id of the last event it was sent (`seq`): it may read on
    here only if the store's event `seq` carries that id. An owner's events reach its
    readers before the store (without `--durable`), and an instance that took the stream
    over from what the store held made its own events of those seqs, with other ids
    (`formats.sse.ids_from`): that reader is told `stream_lost`, never given them."""

    seq: int
    id: int
    checked: bool = False  # the store's event `seq` was seen, and carried `id`

    def matches(self, wire: bytes) -> bool:
        """Whether `wire`, the event `seq` as this instance has it, is the reader's."""
        self.checked = True
        return event_id_of(wire) in (self.id, None)


@dataclass(frozen=True, slots=True)
class Orphan:
    """A followed stream whose owner is gone: `owner` is the instance that was generating it."""

    owner: str


@dataclass(frozen=True, slots=True)
class Claim:
    """A stream this instance now owns: every later write carries `fence`; `events` are all
    Redis holds of it, from its first, as (seq, framed event, tokens)."""

    fence: int
    owner: str  # the instance it was taken from
    handover: bytes
    events: list[tuple[int, bytes, int]]
    # What the owners before billed of the answer, as they left it at their hand-over
    # (`let_go`'s `billed`): b"" when none did (a SIGKILLed owner never writes its record).
    billed: bytes = b""


@dataclass(frozen=True, slots=True)
class Orphaned:
    """A stream of a dead instance that no reader took over, ended in the store by the one
    survivor that swept it (`Sweeper.sweep`, `sweeper.py`): what is left to bill of it."""

    id: str
    trace_id: str
    handover: bytes  # the request stored with it (its key, prompt_tokens, holds)
    billed: bytes  # what its owners billed, as `Claim.billed` (b"": none did)
    tokens: int  # the tokens of the events the store holds of it: what its clients received
    complete: bool  # the store holds its events from its first (none trimmed)


# Bills an `Orphaned` stream (the API's: `Takeover.bill_orphaned`).
BillOrphaned = Callable[[Orphaned], Awaitable[None]]


class EventStore(Protocol):
    instance: str  # this process, as the store names it to other instances
    replicates: bool  # other instances read what it holds (Redis), or none do (memory)
    # Told of each stream another instance took over while this one still generated it: the
    # last event of it the store holds from this one, and whether a reader here may hold
    # events past it that were released as confirmed (`--durable` while the store was away).
    on_fenced: Callable[[str, int, bool], None]
    # Bills the streams of a dead instance that nobody took over (None: they are left as
    # they are), once they had `orphan_grace_s` for a reader to come back and take them over.
    on_orphaned: BillOrphaned | None
    orphan_grace_s: float
    orphan_ttl_s: float  # how long a swept stream stays known, ended

    @property
    def degraded(self) -> str | None:
        """What /readyz reports degraded ("redis" while Redis is away); None: nothing."""
        ...

    def collect(self) -> Iterator[Metric]:
        """Its gauges and counters for /metrics."""
        ...

    async def run(
        self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]
    ) -> None: ...

    def open(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        """A new stream of this instance: replicate its log from now. Its id is handed out
        at once: the store writes its record soon after, and another instance's `lookup`
        waits for it a while."""
        ...

    def finish(self, stream_id: str, outcome: str, last_seq: int, ttl_s: float) -> None: ...

    async def lookup(self, stream_id: str) -> StreamRecord | None:
        """Another instance's stream `stream_id`; None for one the store does not know
        (after waiting a while for a record that may be on its way)."""
        ...

    async def cancel(self, stream_id: str) -> str | None: ...

    async def delete(self, stream_id: str) -> None:
        """Forget an ended stream before its TTL, on every instance that would find it here
        (`DELETE /v1/responses/{id}`)."""
        ...

    async def has_remote_readers(self, stream_id: str) -> bool: ...

    async def tail(
        self, stream_id: str, after: int, log: EventLog, resumed: Resumed | None = None
    ) -> Orphan | None:
        """Fill a mirror's log until the stream ends there; an `Orphan` when its owner is
        gone and it may be taken over. `resumed`: its reader's last event, which the store's
        of that seq must match (else `stream_lost`)."""
        ...

    async def claim(self, stream_id: str, owner: str, after: int) -> Claim | str:
        """Take over an orphaned stream whose reader is at `after`: one instance wins. Else
        why not: "moved" (another instance has it; follow it), "ended", "gone", "lost" (the
        reader saw events the store does not hold), "refused" (not to be taken over)."""
        ...

    def adopt(self, record: StreamRecord, ttl_s: float, log: EventLog, fence: int) -> None:
        """Replicate a stream taken over, whose log holds what the store has, from now on."""
        ...

    def let_go(self, stream_id: str, *, flush: bool, billed: bytes = b"") -> bool:
        """Stop replicating a stream this instance no longer generates: after writing what
        the store lacks (`flush`: a hand-over), with `billed` (what the answer's owners have
        billed so far, for the one that takes it over: `Claim.billed`), or at once (another
        instance took it). False when it was not replicated here any more (fenced: the
        instance that took it over bills all that the store holds)."""
        ...

    async def hand_over(self, stream_ids: Collection[str]) -> None:
        """A drain let `stream_ids` go to other instances: once the store holds what they
        wrote, let readers elsewhere take them over at once (not when this process exits)."""
        ...

    def release(self, stream_id: str) -> None:
        """The stream's log is about to drop its events (the resume budget): what another
        instance reads from the shared store stays."""
        ...


class MemoryStore:
    """One process: nothing to share."""

    replicates = False
    instance = ""
    degraded: str | None = None
    on_orphaned: BillOrphaned | None = None
    orphan_grace_s = 0.0
    orphan_ttl_s = 0.0

    def collect(self) -> Iterator[Metric]:
        return iter(())

    def __init__(self) -> None:
        self.on_fenced: Callable[[str, int, bool], None] = lambda stream_id, kept, lost: None

    async def run(self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]) -> None:
        task_status.started()
        await anyio.sleep_forever()

    def open(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        return None

    def finish(self, stream_id: str, outcome: str, last_seq: int, ttl_s: float) -> None:
        return None

    async def lookup(self, stream_id: str) -> StreamRecord | None:
        return None

    async def tail(
        self, stream_id: str, after: int, log: EventLog, resumed: Resumed | None = None
    ) -> Orphan | None:
        log.close()
        return None

    async def claim(self, stream_id: str, owner: str, after: int) -> Claim | str:
        return "refused"

    def adopt(self, record: StreamRecord, ttl_s: float, log: EventLog, fence: int) -> None:
        return None

    def let_go(self, stream_id: str, *, flush: bool, billed: bytes = b"") -> bool:
        return False

    async def hand_over(self, stream_ids: Collection[str]) -> None:
        return None

    async def cancel(self, stream_id: str) -> str | None:
        return None

    async def delete(self, stream_id: str) -> None:
        return None

    async def has_remote_readers(self, stream_id: str) -> bool:
        return False

    def release(self, stream_id: str) -> None:
        return None
