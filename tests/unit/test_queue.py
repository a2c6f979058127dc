"""The fair queue in front of a full target: priority first, then the key with the fewest
tokens in service per unit of weight; equal keys take turns."""

from __future__ import annotations

import asyncio

from firsttoken.routing.queue import FairQueue, Waiter

LOOP = asyncio.new_event_loop()


def waiter(key: str, cost: int = 100, priority: int = 0, weight: float = 1.0) -> Waiter:
    return Waiter(LOOP.create_future(), key=key, priority=priority, weight=weight, cost=cost)


def test_one_key_is_first_come_first_served() -> None:
    q = FairQueue()
    ws = [waiter("a") for _ in range(3)]
    for w in ws:
        q.push(w)
    assert [q.pop() for _ in range(3)] == ws and q.pop() is None and len(q) == 0


def test_higher_priority_goes_first_whatever_came_before() -> None:
    q = FairQueue()
    for key in ("a", "b", "c"):
        q.push(waiter(key))
    q.push(waiter("vip", priority=3))
    q.push(waiter("low", priority=-1))
    order = [q.pop().key for _ in range(5)]  # type: ignore[union-attr]
    assert order[0] == "vip" and order[-1] == "low"


def test_a_newcomer_takes_the_next_free_slots() -> None:
    # "flood" has 20 streams of 150 waiting; "steady" arrives with 4 a moment later.
    q = FairQueue()
    for _ in range(20):
        q.push(waiter("flood", 150))
    assert q.pop().key == "flood"  # type: ignore[union-attr]  # (a slot freed meanwhile)
    for _ in range(4):
        q.push(waiter("steady", 150))
    order = [q.pop().key for _ in range(8)]  # type: ignore[union-attr]
    # Steady's tags start at the line's time: its four go within the next eight, each
    # beside a flood request of the same tag, not behind the flood's 19.
    assert order.count("steady") == 4 and "steady" in order[:2]


def test_keys_share_by_tokens_not_by_requests() -> None:
    # "big" asks for 4x the tokens per request, and a stream holds its slot as long as it has
    # tokens to write: over time both keys get the same tokens, big a quarter of the requests.
    q = FairQueue()
    for _ in range(200):
        q.push(waiter("big", cost=400))
        q.push(waiter("small", cost=100))
    got = {"big": 0, "small": 0}
    for _ in range(250):
        w = q.pop()
        assert w is not None
        got[w.key] += w.cost
    assert abs(got["big"] - got["small"]) <= 400


def test_weights_share_by_weight() -> None:
    q = FairQueue()
    for _ in range(30):
        q.push(waiter("heavy", weight=3.0))
        q.push(waiter("light", weight=1.0))
    served = [q.pop() for _ in range(16)]  # nothing ends: 16 slots fill up
    keys = [w.key for w in served if w]
    assert keys.count("heavy") == 12 and keys.count("light") == 4


def test_remove_takes_a_leaver_out() -> None:
    q = FairQueue()
    a, b = waiter("a"), waiter("b")
    q.push(a)
    q.push(b)
    assert q.remove(a) and not q.remove(a)
    assert len(q) == 1 and q.pop() is b and q.pop() is None


def test_streams_that_took_free_slots_count_against_their_key() -> None:
    # flood filled the 4 free slots without waiting, then queued 20 more; steady arrives:
    # flood's running streams count, so steady's first request goes before any of flood's.
    q = FairQueue()
    for _ in range(4):
        q.charge("flood", 0, 1.0, 150)
    for _ in range(20):
        q.push(waiter("flood", 150))
    for _ in range(4):
        q.push(waiter("steady", 150))
    order = [q.pop().key for _ in range(8)]  # type: ignore[union-attr]
    assert order[0] == "steady" and order.count("steady") == 4
