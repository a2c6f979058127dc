"""The resume budget: bytes of finished buffers, in all and per key, oldest dropped first."""

from __future__ import annotations

from firsttoken.resume.budget import ResumeBudget


def test_under_the_bound_nothing_goes() -> None:
    budget = ResumeBudget(1000)
    assert budget.add("a", "alice", 400) == []
    assert budget.add("b", "bob", 600) == []
    assert budget.held == 1000 and budget.held_by("alice") == 400 and budget.dropped == 0


def test_past_the_bound_the_oldest_go_first() -> None:
    budget = ResumeBudget(1000)
    for sid in "abc":
        budget.add(sid, "alice", 300)
    assert budget.add("d", "bob", 300) == ["a"]  # 1200 > 1000: the oldest, whoever's it is
    assert budget.add("e", "bob", 500) == ["b", "c"]
    assert budget.held == 800 and budget.held_by("alice") == 0 and budget.dropped == 3


def test_a_buffer_larger_than_the_bound_drops_itself_last() -> None:
    budget = ResumeBudget(1000)
    budget.add("a", "alice", 100)
    assert budget.add("big", "alice", 5000) == ["a", "big"]
    assert budget.held == 0


def test_a_key_over_its_own_bound_drops_its_own_oldest_not_others() -> None:
    budget = ResumeBudget(10_000, per_key={"mallory": 500})
    budget.add("alice-1", "alice", 400)
    budget.add("m1", "mallory", 300)
    budget.add("alice-2", "alice", 400)
    assert budget.add("m2", "mallory", 300) == ["m1"]  # 600 > 500: mallory's oldest
    assert budget.held_by("mallory") == 300 and budget.held_by("alice") == 800
    assert budget.add("m3", "mallory", 300) == ["m2"]


def test_forgotten_buffers_count_no_more() -> None:
    budget = ResumeBudget(1000)
    budget.add("a", "alice", 600)
    budget.forget("a")  # expired
    budget.forget("a")  # twice is harmless
    assert budget.held == 0 and budget.held_by("alice") == 0
    assert budget.add("b", "alice", 1000) == []
    budget.add("b", "alice", 200)  # counted again (not twice)
    assert budget.held == 200
