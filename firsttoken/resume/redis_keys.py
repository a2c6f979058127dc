"""Where a stream's keys live in Redis: in one of 16 hash-tagged groups.

Redis Cluster runs a command only if every key it names is in one slot, and a key's hash tag
(the text between its first `{` and the next `}`) alone decides the slot. So one stream's keys
share its group's tag, and so do the streams that one command touches: those the owner writes
in one Lua call, and those one lane of the shared tail reads with one `XREAD`. A group is a
slot. The 16 tags are chosen so that their slots fall in 16 equal parts of the slot space: a
cluster whose masters split the slots evenly (as `redis-cli --cluster create` does) serves
16/N groups on each of its N masters. The same layout serves a single Redis.
"""

from __future__ import annotations

import zlib

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

__all__ = [
    "GROUPS",
    "TAGS",
    "events_key",
    "group_of",
    "meta_key",
    "owned_key",
    "readers_key",
    "tag_of",
]

GROUPS = 16


def _tags() -> tuple[str, ...]:
    width = REDIS_CLUSTER_HASH_SLOTS // GROUPS
    tags = []
    for part in range(GROUPS):
        k = 0
        # Near the middle of its part: a split a little off the equal one moves no group.
        middle = part * width + width // 2
        while abs(key_slot(f"ft{part}.{k}".encode()) - middle) > width // 4:
            k += 1
        tags.append(f"ft{part}.{k}")
    return tuple(tags)


TAGS = _tags()


def group_of(stream_id: str) -> str:
    """The stream's tag: the same on every instance (crc32 of its id)."""
    return TAGS[zlib.crc32(stream_id.encode()) % GROUPS]


def meta_key(stream_id: str) -> str:
    return f"ft:{{{group_of(stream_id)}}}:{stream_id}:meta"


def events_key(stream_id: str) -> str:
    return f"ft:{{{group_of(stream_id)}}}:{stream_id}:events"


def readers_key(stream_id: str) -> str:
    return f"ft:{{{group_of(stream_id)}}}:{stream_id}:readers"


def owned_key(tag: str, instance: str) -> str:
    """The set of the streams of group `tag` that `instance` owns and has not ended: what a
    survivor bills if that instance dies (`sweeper.py`). Its members are added and removed
    by the Lua calls that write the metas and ends (`metas.py`, `flusher.py`), in the same slot."""
    return f"ft:{{{tag}}}:owned:{instance}"


def tag_of(key: str) -> str:
    """The hash tag of one of the keys above."""
    return key[key.index("{") + 1 : key.index("}")]
