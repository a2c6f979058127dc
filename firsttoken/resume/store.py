"""Where streams are shared beyond this process: nowhere (memory) or Redis.

The local `EventLog` is always the live buffer that this instance's readers tail. A store
replicates it so that another instance can find the stream, replay and tail it, hear that a
reader is attached there, and ask the owner to cancel it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

from firsttoken.eventlog import EventLog

__all__ = ["EventStore", "MemoryStore", "StreamRecord", "token_digest"]


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StreamRecord:
    id: str
    kind: str  # "native" | "openai": decides the connection preamble
    token_digest: str
    trace_id: str
    model: str


class EventStore(Protocol):
    async def run(
        self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]
    ) -> None: ...

    async def register(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        """`open`, then `registered`."""
        ...

    def open(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        """A new stream of this instance: replicate its log from now (its first event may
        come before `registered` returns)."""
        ...

    async def registered(self, stream_id: str) -> None:
        """Return once another instance can find the stream (before its id is handed out)."""
        ...

    def finish(self, stream_id: str, outcome: str, last_seq: int, ttl_s: float) -> None: ...

    async def lookup(self, stream_id: str) -> StreamRecord | None: ...

    async def tail(self, stream_id: str, after: int, log: EventLog) -> None: ...

    async def cancel(self, stream_id: str) -> str | None: ...

    async def has_remote_readers(self, stream_id: str) -> bool: ...

    def release(self, stream_id: str) -> None:
        """The stream's log is about to drop its events (the resume budget): what another
        instance reads from the shared store stays."""
        ...


class MemoryStore:
    """One process: nothing to share."""

    replicates = False

    async def run(self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]) -> None:
        task_status.started()
        await anyio.sleep_forever()

    async def register(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        return None

    def open(self, record: StreamRecord, ttl_s: float, log: EventLog) -> None:
        return None

    async def registered(self, stream_id: str) -> None:
        return None

    def finish(self, stream_id: str, outcome: str, last_seq: int, ttl_s: float) -> None:
        return None

    async def lookup(self, stream_id: str) -> StreamRecord | None:
        return None

    async def tail(self, stream_id: str, after: int, log: EventLog) -> None:
        log.close()

    async def cancel(self, stream_id: str) -> str | None:
        return None

    async def has_remote_readers(self, stream_id: str) -> bool:
        return False

    def release(self, stream_id: str) -> None:
        return None
