"""The Redis key layout (`firsttoken/resume/redis_keys.py`): one slot per group, groups spread."""

from __future__ import annotations

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from firsttoken.resume.redis_keys import (
    GROUPS,
    TAGS,
    events_key,
    group_of,
    meta_key,
    readers_key,
    tag_of,
)


def test_a_streams_keys_share_one_slot_and_its_groups() -> None:
    for sid in ("a", "f2e33cc51c1c316e8b7d17d93f2186a1", "x" * 64):
        keys = (meta_key(sid), events_key(sid), readers_key(sid))
        assert {tag_of(k) for k in keys} == {group_of(sid)}
        assert len({key_slot(k.encode()) for k in keys}) == 1
        assert key_slot(keys[0].encode()) == key_slot(group_of(sid).encode())


def test_the_groups_fall_in_equal_parts_of_the_slot_space() -> None:
    width = REDIS_CLUSTER_HASH_SLOTS // GROUPS
    assert [key_slot(t.encode()) // width for t in TAGS] == list(range(GROUPS))
    # Three masters splitting the slots evenly (redis-cli --cluster create) get 5-6 each.
    split = REDIS_CLUSTER_HASH_SLOTS // 3 + 1
    per_master = [sum(key_slot(t.encode()) // split == m for t in TAGS) for m in range(3)]
    assert sorted(per_master) == [5, 5, 6]


def test_streams_spread_over_every_group() -> None:
    seen = [group_of(f"{i:032x}") for i in range(1600)]
    counts = [seen.count(tag) for tag in TAGS]
    assert min(counts) > 60 and max(counts) < 140, counts
