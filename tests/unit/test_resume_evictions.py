"""Whether Redis may evict our keys, and how many it did (`firsttoken/resume/evictions.py`)."""

from __future__ import annotations

import anyio

from firsttoken.redisclient import redis_client
from firsttoken.resume.evictions import EVERY, Evictions, values_of


def test_the_eviction_policy_is_read_from_one_node_or_every_master() -> None:
    assert values_of({b"maxmemory-policy": b"allkeys-lru"}, "maxmemory-policy") == {"allkeys-lru"}
    cluster = {
        "127.0.0.1:7000": {"maxmemory-policy": "noeviction"},
        "127.0.0.1:7001": {"maxmemory-policy": "volatile-lfu"},
    }
    assert values_of(cluster, "maxmemory-policy") == {"noeviction", "volatile-lfu"}


class Counted(Evictions):
    """Redis's evicted_keys at each look, as the test says; 3 after 15: it restarted."""

    def __init__(self, counts: list[int]) -> None:
        super().__init__(redis_client("redis://127.0.0.1:1/0", max_connections=1))
        self.counts = iter(counts)
        self.looks = 0

    async def evicted_keys(self) -> int:
        self.looks += 1
        return next(self.counts)


def test_evictions_are_counted_as_they_grow_and_across_a_redis_restart() -> None:
    e = Counted([15, 15, 3])
    e.seen = 10  # at start

    async def body() -> None:
        for _ in range(3):
            await e.count()

    anyio.run(body)
    assert e.evicted == 5 + 3


def test_evictions_are_looked_at_every_few_beats_and_only_under_a_policy_that_evicts() -> None:
    quiet = Counted([])  # noeviction: `seen` stays None, nothing is read

    async def beats(e: Counted, n: int) -> None:
        for _ in range(n):
            await e.on_beat()

    anyio.run(beats, quiet, EVERY * 3)
    assert quiet.looks == 0
    risky = Counted([11, 12])
    risky.seen = 10
    anyio.run(beats, risky, EVERY * 2)
    assert risky.looks == 2 and risky.evicted == 2
