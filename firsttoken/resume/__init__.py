"""The resume buffer: every event of a stream, kept for readers that come back."""

from firsttoken.eventlog import Event, EventLog, LogReader, ResumeExpired
from firsttoken.resume.store import (
    LOST_AHEAD,
    Claim,
    EventStore,
    MemoryStore,
    Orphan,
    Orphaned,
    Resumed,
    StreamRecord,
    token_digest,
)

__all__ = [
    "LOST_AHEAD",
    "Claim",
    "Event",
    "EventLog",
    "EventStore",
    "LogReader",
    "MemoryStore",
    "Orphan",
    "Orphaned",
    "ResumeExpired",
    "Resumed",
    "StreamRecord",
    "open_store",
    "token_digest",
]


def open_store(
    redis_url: str | None,
    *,
    max_events: int,
    max_connections: int,
    cluster: bool = False,
    flush_interval_s: float = 0.05,
    durable: bool = False,
) -> EventStore:
    if not redis_url:
        return MemoryStore()
    from firsttoken.resume.redis import RedisStore

    return RedisStore(
        redis_url,
        max_events=max_events,
        max_connections=max_connections,
        cluster=cluster,
        flush_interval_s=flush_interval_s,
        durable=durable,
    )
