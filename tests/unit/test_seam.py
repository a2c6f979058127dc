"""The seam's logic on the fake clock: the pace of the edge's held text, the time it has in
hand, and the hand-off decision by time, bounded by `after_tokens` and sentence ends."""

from __future__ import annotations

from firsttoken.generation import Delta, GenerationRequest
from firsttoken.routing.seam import EdgePacer, Seam, prefill_id, prefill_request
from tests.unit.clock import FakeClock


def drain(pacer: EdgePacer, clock: FakeClock, until: float) -> list[tuple[float, str]]:
    """Let the held deltas out as their times come, up to `until`: (time, text) each."""
    out: list[tuple[float, str]] = []
    while True:
        at = pacer.next_at(clock.now)
        if at is None or at > until:
            return out
        clock.now = max(clock.now, at)
        out.append((clock.now, pacer.take(clock.now).text))


def test_the_first_delta_leaves_at_once_and_the_rest_at_the_pace() -> None:
    clock = FakeClock(0.0)
    pacer = EdgePacer(0.05)
    for i in range(4):
        pacer.hold(Delta(f"t{i}"))
    times = [round(t, 6) for t, _ in drain(pacer, clock, until=10.0)]
    assert times == [0.0, 0.05, 0.1, 0.15]
    assert pacer.next_at(clock.now) is None


def test_a_meta_event_or_bare_finish_is_not_paced_but_keeps_its_place() -> None:
    clock = FakeClock(0.0)
    pacer = EdgePacer(0.05)
    pacer.hold(Delta("a"))
    pacer.hold(Delta(meta={"handoff": {}}))
    pacer.hold(Delta("b"))
    pacer.hold(Delta("", "stop"))
    out = drain(pacer, clock, until=10.0)
    assert [round(t, 6) for t, _ in out] == [0.0, 0.0, 0.05, 0.05]
    assert [text for _, text in out] == ["a", "", "b", ""]


def test_time_in_hand_counts_the_held_text_at_the_pace() -> None:
    clock = FakeClock(0.0)
    pacer = EdgePacer(0.05)
    assert pacer.in_hand(0.0) == 0.0
    pacer.hold(Delta("a"))
    drain(pacer, clock, until=0.0)  # "a" left at 0.0
    for i in range(3):
        pacer.hold(Delta(f"t{i}"))
    # The next leaves at 0.05, the third at 0.15: a center's delta by 0.2 keeps the pace.
    assert round(pacer.in_hand(0.0), 6) == 0.2
    assert round(pacer.in_hand(0.03), 6) == 0.17


def test_after_the_hand_off_the_held_text_is_spread_over_the_expected_delay() -> None:
    clock = FakeClock(0.0)
    pacer = EdgePacer(0.05)
    pacer.hold(Delta("a"))
    drain(pacer, clock, until=0.0)
    for i in range(3):
        pacer.hold(Delta(f"t{i}"))
    pacer.handed_off(0.1)  # the center is expected at 0.1: 3 tokens in 4 even gaps
    times = [round(t, 6) for t, _ in drain(pacer, clock, until=10.0)]
    assert times == [0.025, 0.05, 0.075]
    # Past the expected time (a late center) what is held is waited through at the pace.
    pacer.hold(Delta("x"))
    pacer.hold(Delta("y"))
    clock.now = 0.2
    assert [round(t, 6) for t, _ in drain(pacer, clock, until=10.0)] == [0.2, 0.25]


def test_released_everything_leaves_at_once() -> None:
    clock = FakeClock(0.0)
    pacer = EdgePacer(0.05)
    for i in range(5):
        pacer.hold(Delta(f"t{i}"))
    drain(pacer, clock, until=0.0)
    pacer.release()
    assert [t for t, _ in drain(pacer, clock, until=0.0)] == [0.0] * 4


def test_after_tokens_is_the_latest_hand_off_whatever_the_time() -> None:
    seam = Seam(8, prefill=True)  # the center's readiness unknown
    assert not seam.hands_off(0.0, 7, in_hand=0.0, sentence_end=False)
    assert seam.hands_off(0.0, 8, in_hand=0.0, sentence_end=False)


def test_with_sentence_only_a_sentence_end_hands_off() -> None:
    seam = Seam(4, sentence=True)
    seam.ready(0.0)
    assert not seam.hands_off(1.0, 9, in_hand=5.0, sentence_end=False)
    assert seam.hands_off(1.0, 9, in_hand=0.0, sentence_end=True)
    assert seam.hands_off(1.0, 2, in_hand=0.0, sentence_end=True)  # ready, delay not known


def test_a_ready_center_of_unknown_delay_takes_over_at_the_next_boundary() -> None:
    seam = Seam(32)
    assert not seam.hands_off(0.1, 1, in_hand=0.0, sentence_end=False)  # not ready yet
    seam.ready(0.2)
    assert seam.hands_off(0.21, 2, in_hand=0.0, sentence_end=False)


def test_the_hand_off_waits_until_the_text_in_hand_covers_the_centers_delay() -> None:
    # Ready expected at 0.9 s (its usual prefill time), 0.1 s to a warm first token.
    seam = Seam(64, warm_s=0.1, expect_ready_at=0.9)
    assert seam.expected_first(0.3) == 1.0
    assert not seam.hands_off(0.3, 10, in_hand=0.6, sentence_end=False)  # 0.9 < 1.0
    assert seam.hands_off(0.3, 10, in_hand=0.7, sentence_end=False)
    # Once ready, only the warm delay is left to cover.
    seam.ready(0.5)
    assert seam.expected_first(0.6) == 0.7
    assert not seam.hands_off(0.6, 3, in_hand=0.05, sentence_end=False)
    assert seam.hands_off(0.6, 3, in_hand=0.1, sentence_end=False)


def test_without_a_prefill_the_centers_whole_delay_is_covered_or_the_count_decides() -> None:
    unknown = Seam(16, prefill=False)
    assert unknown.expected_first(0.0) is None
    assert not unknown.hands_off(0.0, 15, in_hand=99.0, sentence_end=False)
    known = Seam(16, prefill=False, warm_s=0.5)
    assert not known.hands_off(0.0, 3, in_hand=0.4, sentence_end=False)
    assert known.hands_off(0.0, 3, in_hand=0.5, sentence_end=False)


def test_the_prefill_asks_one_token_of_the_conversation_alone() -> None:
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_completion_tokens": 300,
        "stream_options": {"include_usage": True},
        "synthetic": {"ttft_ms": 900},
    }
    request = GenerationRequest(
        request_id="s1", prompt="user: hi", model="chat", max_tokens=300, body=body
    )
    prefill = prefill_request(request)
    assert prefill.request_id == prefill_id("s1") and prefill.max_tokens == 1
    assert len(prefill.request_id) == 32 and int(prefill.request_id, 16) >= 0
    assert prefill.body == {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 1,
        "synthetic": {"ttft_ms": 900},
    }
    assert request.body is body and body["max_completion_tokens"] == 300  # untouched


def test_a_ready_center_takes_over_when_the_edge_cannot_get_ahead_of_the_pace() -> None:
    seam = Seam(32, warm_s=0.4)
    seam.ready(1.0)
    # The edge writes a token every 80 ms against a 50 ms pace: nothing will be held back.
    assert seam.hands_off(1.1, 5, in_hand=0.0, sentence_end=False, edge_itl=0.08, pace_s=0.05)
    # One faster than the pace waits until what it holds covers the center's delay.
    assert not seam.hands_off(1.1, 5, in_hand=0.1, sentence_end=False, edge_itl=0.02, pace_s=0.05)
    # Not ready: no early hand-off, however slow the edge.
    waiting = Seam(32, warm_s=0.4, expect_ready_at=5.0)
    assert not waiting.hands_off(1.1, 5, 0.0, False, edge_itl=0.08, pace_s=0.05)
