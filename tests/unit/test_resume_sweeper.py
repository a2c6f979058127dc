"""Dead instances and what their streams hold (`firsttoken/resume/sweeper.py`), on a fake
clock."""

from __future__ import annotations

from functools import partial

from firsttoken.resume.heartbeat import OWNER_GONE_S
from firsttoken.resume.runs import encode_run
from firsttoken.resume.sweeper import dead_instances, tokens_held
from tests.unit.clock import FakeClock


def test_an_instance_is_dead_once_its_key_was_missing_for_the_owner_gone_bound() -> None:
    clock = FakeClock()
    missing: dict[str, float] = {}
    look = partial(dead_instances, missing=missing, gone_s=OWNER_GONE_S)
    assert look(["a", "b"], [False, True], now=clock()) == []
    clock.advance(OWNER_GONE_S / 2)
    assert look(["a", "b"], [True, False], now=clock()) == []  # a back: a Redis restart
    clock.advance(OWNER_GONE_S / 2)
    assert look(["a", "b"], [False, False], now=clock()) == []
    clock.advance(OWNER_GONE_S / 2)
    assert look(["a", "b"], [False, False], now=clock()) == ["b"]  # once, then forgotten
    assert missing == {"a": clock() - OWNER_GONE_S / 2}
    assert look([], [], now=clock()) == [] and missing == {}  # another survivor took a


def entry(first: int, count: int, counts: dict[int, int] | None = None) -> tuple:
    wires = [b"e%d" % seq for seq in range(first, first + count)]
    fields = encode_run(first, wires, counts or {})
    raw = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}
    return (b"%d-0" % (first + count - 1), raw)


def test_the_tokens_held_are_counted_from_every_run_up_to_the_end() -> None:
    # A meta event (0 tokens), runs that overlap (one resent whole after a lost reply), an end.
    entries = [
        entry(1, 3, {1: 0}),
        entry(1, 5, {1: 0}),
        entry(6, 2, {7: 4}),
        (b"7-1", {b"end": b"x"}),
    ]
    assert tokens_held(entries) == (4 + 1 + 4, True)
    assert tokens_held(entries[2:]) == (5, False)  # its first runs trimmed: a part of it
    assert tokens_held([]) == (0, True)
