"""The line in front of a full target: higher priority first, and within a priority, deficit
round robin over keys, weighted by each key's `weight` and counted in tokens.

Counting tokens, not requests, is what keeps a key that asks for 24 long answers from taking
24 turns' worth of the engine while a key with 4 short ones waits: each key's turn buys
`QUANTUM × weight` tokens of credit, and a request goes when its key's credit covers what it
may cost (its prompt plus its `max_tokens`). The queue is per target and per process: the
slot it hands out is this process's (`max_concurrency` counts this process's streams), so a
shared queue would have to share the slots too, which Redis cannot do without a round trip
per token.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field

__all__ = ["QUANTUM", "FairQueue", "Waiter"]

QUANTUM = 512  # tokens of credit a key gets per turn, times its weight


@dataclass(eq=False, slots=True)
class Waiter:
    future: asyncio.Future[None]
    key: str = ""
    priority: int = 0
    weight: float = 1.0
    cost: int = 1  # tokens it may take: prompt + max_tokens (or a default)
    since: float = 0.0


@dataclass(slots=True)
class _Class:
    """One priority: each key's waiters in arrival order, in a ring of turns."""

    keys: OrderedDict[str, deque[Waiter]] = field(default_factory=OrderedDict)
    credit: dict[str, float] = field(default_factory=dict)


class FairQueue:
    __slots__ = ("_classes", "_count")

    def __init__(self) -> None:
        self._classes: dict[int, _Class] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, waiter: Waiter) -> None:
        cls = self._classes.get(waiter.priority)
        if cls is None:
            cls = self._classes[waiter.priority] = _Class()
        line = cls.keys.get(waiter.key)
        if line is None:
            line = cls.keys[waiter.key] = deque()
            cls.credit.setdefault(waiter.key, 0.0)
        line.append(waiter)
        self._count += 1

    def remove(self, waiter: Waiter) -> bool:
        """Take out a waiter that leaves (its client went, or it timed out)."""
        cls = self._classes.get(waiter.priority)
        line = cls.keys.get(waiter.key) if cls is not None else None
        if cls is None or line is None or waiter not in line:
            return False
        line.remove(waiter)
        self._count -= 1
        if not line:
            self._drop_key(cls, waiter.key, waiter.priority)
        return True

    def pop(self) -> Waiter | None:
        """The next waiter to serve, or None when nobody waits."""
        while self._classes:
            priority = max(self._classes)
            cls = self._classes[priority]
            waiter = self._next(cls, priority)
            if waiter is not None:
                return waiter
        return None

    def _next(self, cls: _Class, priority: int) -> Waiter | None:
        while cls.keys:
            key, line = next(iter(cls.keys.items()))
            head = line[0]
            if cls.credit[key] >= head.cost:
                line.popleft()
                self._count -= 1
                cls.credit[key] -= head.cost
                if not line:
                    self._drop_key(cls, key, priority)
                return head
            # Not enough credit: the key's turn ends with more of it, and the next key's begins.
            # Enough turns to cover the head at once, so a large request costs no spinning.
            turns = max(1, -(-(head.cost - cls.credit[key]) // (QUANTUM * head.weight)))
            if len(cls.keys) == 1:
                cls.credit[key] += turns * QUANTUM * head.weight
                continue
            cls.credit[key] += QUANTUM * head.weight
            cls.keys.move_to_end(key)
        return None

    def _drop_key(self, cls: _Class, key: str, priority: int) -> None:
        # A key that has nothing waiting keeps no credit (DRR: no saving up while idle).
        del cls.keys[key]
        del cls.credit[key]
        if not cls.keys:
            del self._classes[priority]
