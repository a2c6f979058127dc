"""The fair queue in front of a full target: priority first, then deficit round robin over
keys by weight, counted in tokens."""

from __future__ import annotations

import asyncio

from firsttoken.routes.queue import QUANTUM, FairQueue, Waiter

LOOP = asyncio.new_event_loop()


def waiter(key: str, cost: int = 100, priority: int = 0, weight: float = 1.0) -> Waiter:
    return Waiter(LOOP.create_future(), key=key, priority=priority, weight=weight, cost=cost)


def drain(q: FairQueue) -> list[str]:
    out = []
    while (w := q.pop()) is not None:
        out.append(w.key)
    return out


def test_one_key_is_first_come_first_served() -> None:
    q = FairQueue()
    ws = [waiter("a", cost=10 * QUANTUM) for _ in range(3)]  # bigger than a turn's credit
    for w in ws:
        q.push(w)
    assert [q.pop() for _ in range(3)] == ws and q.pop() is None and len(q) == 0


def test_higher_priority_goes_first_whatever_came_before() -> None:
    q = FairQueue()
    for key in ("a", "b", "c"):
        q.push(waiter(key))
    q.push(waiter("vip", priority=3))
    q.push(waiter("low", priority=-1))
    assert drain(q)[0] == "vip" and drain(q) == []


def test_keys_share_by_tokens_not_by_requests() -> None:
    # "big" asks for 4x the tokens per request: with equal weights it gets a quarter of the
    # requests, the same tokens.
    q = FairQueue()
    for _ in range(40):
        q.push(waiter("big", cost=400))
        q.push(waiter("small", cost=100))
    served = [q.pop() for _ in range(30)]
    tokens = {k: sum(w.cost for w in served if w and w.key == k) for k in ("big", "small")}
    assert abs(tokens["big"] - tokens["small"]) <= 2 * QUANTUM


def test_a_key_that_empties_keeps_no_credit() -> None:
    q = FairQueue()
    q.push(waiter("a", cost=1))
    assert q.pop() is not None  # a's turn bought QUANTUM, it spent 1
    q.push(waiter("b", cost=QUANTUM))
    q.push(waiter("a", cost=QUANTUM))
    # a saved nothing from its last turn: b, who arrived first, goes first.
    assert drain(q) == ["b", "a"]


def test_remove_takes_a_leaver_out() -> None:
    q = FairQueue()
    a, b = waiter("a"), waiter("b")
    q.push(a)
    q.push(b)
    assert q.remove(a) and not q.remove(a)
    assert len(q) == 1 and drain(q) == ["b"]
