"""The resume budget: bytes of finished buffers, in all and per key; past the bound, the
oldest of the key holding the most go first."""

from __future__ import annotations

from firsttoken.resume.budget import ResumeBudget


def test_under_the_bound_nothing_goes() -> None:
    budget = ResumeBudget(1000)
    assert budget.add("a", "alice", 400) == []
    assert budget.add("b", "bob", 600) == []
    assert budget.held == 1000 and budget.held_by("alice") == 400 and budget.dropped == 0


def test_past_the_bound_the_oldest_of_the_key_holding_the_most_go_first() -> None:
    budget = ResumeBudget(1000)
    for sid in "abc":
        budget.add(sid, "alice", 300)
    assert budget.add("d", "bob", 300) == ["a"]  # 1200 > 1000: alice holds 900, bob 300
    # 1400: bob holds 800 now, so his oldest goes; then alice's 600 is the most.
    assert budget.add("e", "bob", 500) == ["d", "b"]
    assert budget.held == 800 and budget.held_by("alice") == 300 and budget.dropped == 3
    assert budget.dropped_of == {"alice": 2, "bob": 1}


def test_one_key_alone_drops_its_oldest_first() -> None:
    budget = ResumeBudget(1000)
    for sid in "abcd":
        budget.add(sid, "", 300)
    assert budget.add("e", "", 300) == ["b"] and budget.held == 900  # "a" went at "d"


def test_an_abusive_key_never_pushes_out_anothers_buffers_while_it_holds_more() -> None:
    # mallory ends a stream nobody reads every tick; alice ends one she reads now and then:
    # alice's buffers are never dropped while mallory holds more than she does.
    budget = ResumeBudget(100_000)
    alice_dropped: list[str] = []
    for tick in range(2000):
        dropped = budget.add(f"m{tick}", "mallory", 5_000)
        if tick % 10 == 0:
            dropped += budget.add(f"a{tick}", "alice", 2_000)
        alice_dropped += [d for d in dropped if d.startswith("a")]
        if tick % 10 == 9 and tick >= 200:  # her buffers expire after 200 ticks (the TTL)
            budget.forget(f"a{tick - 199}")
        assert budget.held <= 100_000
    assert alice_dropped == [] and budget.dropped_of == {"mallory": budget.dropped}
    assert budget.held_by("alice") == 20 * 2_000  # the TTL's worth, all kept


def test_keys_holding_the_same_drop_the_oldest_buffer_first() -> None:
    budget = ResumeBudget(1000)
    budget.add("b1", "bob", 300)
    budget.add("a1", "alice", 300)
    budget.add("a2", "alice", 200)
    budget.add("b2", "bob", 200)
    assert budget.add("c1", "carol", 100) == ["b1"]  # 500 each: bob's b1 is the oldest


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


def test_live_streams_requests_count_until_they_end_and_push_finished_buffers_out() -> None:
    """With Redis a live stream's request is stored for a takeover: it counts in the bound
    while the stream runs, and finished buffers make room for it."""
    budget = ResumeBudget(1000)
    budget.add("done", "alice", 600)
    assert budget.store_request("live", "bob", 500)
    assert budget.held == 1100 and budget.requests == 500 and budget.held_by("bob") == 500
    assert budget.add("done-2", "alice", 100) == ["done"]  # the finished ones go, not "live"
    budget.end_request("live")
    budget.end_request("live")  # twice is harmless
    assert budget.held == 100 and budget.requests == 0 and budget.held_by("bob") == 0


def test_a_request_past_the_bound_is_not_stored() -> None:
    """60 streams of 1 MB prompts from one key would hold 60 MB in Redis: past the bound,
    server-wide or the key's own, a stream is stored without its request."""
    budget = ResumeBudget(2500, per_key={"mallory": 1500})
    assert budget.store_request("m1", "mallory", 1000)
    assert not budget.store_request("m2", "mallory", 1000)  # the key's 1500
    assert budget.store_request("a1", "alice", 1000)
    assert not budget.store_request("a2", "alice", 1000)  # the server's 2500
    assert budget.unstored == 2 and budget.requests == 2000
    budget.end_request("m1")
    assert budget.store_request("a2", "alice", 1000)
    metrics = {m.name: m.samples[0].value for m in budget.collect() if m.samples}
    assert metrics["firsttoken_resume_request_bytes"] == 2000
    assert metrics["firsttoken_resume_requests_unstored"] == 2


def test_a_key_holding_only_stored_requests_is_never_asked_for_a_buffer() -> None:
    """Its live streams' requests count against the bound, but only finished buffers can
    go: the fair share picks among keys that have one."""
    budget = ResumeBudget(1_000)
    assert budget.store_request("live", "mallory", 900)
    assert budget.add("done", "alice", 200) == ["done"]
    assert budget.held_by("mallory") == 900 and budget.held_by("alice") == 0
