"""The line in front of a full target: higher priority first; within a priority, fair
queuing by tokens between keys, weighted by each key's `weight`.

Counting tokens, not requests, is what keeps a key that asks for 24 long answers from holding
the engine while a key with 4 short ones waits. This is start-time fair queuing, the exact
form that deficit round robin approximates: each request gets a tag when it joins, its key's
last tag plus what it may cost (its prompt and `max_tokens`) ÷ the key's weight, never below
the line's current virtual time; the smallest tag goes next. A flood's 24 requests carry tags
far ahead, so a key that arrives later takes the next free slots until its tags catch up; over
time each key gets tokens in proportion to its weight, and no key saves up credit while idle.

The queue is per target and per process: the slots it hands out are this process's
(`max_concurrency` counts this process's streams), so a shared queue would have to share the
slots too, a Redis round trip per stream start and end.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

__all__ = ["FairQueue", "Waiter"]


@dataclass(eq=False, slots=True)
class Waiter:
    future: asyncio.Future[None]
    key: str = ""
    priority: int = 0
    weight: float = 1.0
    cost: int = 1  # tokens it may take: prompt + max_tokens (or a default)
    since: float = 0.0
    gone: bool = False  # left the line (lazily dropped from the heap)


@dataclass(slots=True)
class _Class:
    """One priority: waiters by tag, each key's last tag, and the line's virtual time."""

    heap: list[tuple[float, int, Waiter]] = field(default_factory=list)
    last: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    now: float = 0.0  # virtual time: the tag of the last waiter served


class FairQueue:
    __slots__ = ("_classes", "_count", "_order")

    def __init__(self) -> None:
        self._classes: dict[int, _Class] = {}
        self._count = 0
        self._order = itertools.count()  # ties go in arrival order

    def __len__(self) -> int:
        return self._count

    def push(self, waiter: Waiter) -> None:
        cls = self._classes.get(waiter.priority)
        if cls is None:
            cls = self._classes[waiter.priority] = _Class()
        start = max(cls.now, cls.last.get(waiter.key, 0.0))
        cls.last[waiter.key] = start + waiter.cost / waiter.weight
        cls.waiting[waiter.key] = cls.waiting.get(waiter.key, 0) + 1
        heapq.heappush(cls.heap, (start, next(self._order), waiter))
        self._count += 1

    def charge(self, key: str, priority: int, weight: float, cost: int) -> None:
        """A request took a free slot without waiting: it still counts against its key, so a
        key whose streams fill the target queues behind one that has none there."""
        cls = self._classes.get(priority)
        if cls is None:
            cls = self._classes[priority] = _Class()
        start = max(cls.now, cls.last.get(key, 0.0))
        cls.last[key] = start + cost / weight
        cls.now = start

    def remove(self, waiter: Waiter) -> bool:
        """Take out a waiter that leaves (its client went, or it timed out)."""
        cls = self._classes.get(waiter.priority)
        if waiter.gone or cls is None or not cls.waiting.get(waiter.key):
            return False
        waiter.gone = True
        self._count -= 1
        self._left(cls, waiter)
        return True

    def pop(self) -> Waiter | None:
        """The next waiter to serve, or None when nobody waits."""
        while self._classes:
            priority = max(self._classes)
            cls = self._classes[priority]
            while cls.heap:
                tag, _, waiter = heapq.heappop(cls.heap)
                if waiter.gone:
                    continue
                cls.now = max(cls.now, tag)
                self._count -= 1
                self._left(cls, waiter)
                return waiter
            del self._classes[priority]  # only charges were left: nobody waits here
        return None

    def _left(self, cls: _Class, waiter: Waiter) -> None:
        n = cls.waiting[waiter.key] - 1
        if n:
            cls.waiting[waiter.key] = n
            return
        # Nothing of this key waits: it keeps no tag (no saving up, no debt, while idle).
        del cls.waiting[waiter.key]
        del cls.last[waiter.key]
        if not cls.waiting:
            self._classes.pop(waiter.priority, None)
