from __future__ import annotations

from bench.report import _workers, _workers_note, kept_pace
from bench.servers import SUBJECT, WORKERS2

PACE = 40.0  # tokens/s per stream at the engine's pace


def step(server: str, streams: int, delivery: float) -> dict[str, object]:
    """A saturation row with only the keys `_workers` and `kept_pace` read."""
    return {
        "server": server,
        "concurrency": streams,
        "tokens_per_s": streams * PACE * delivery,
        "delivery": delivery,
        "exact": streams,
        "streams": streams,
    }


def test_the_ratio_is_capacity_over_capacity_not_one_step() -> None:
    # One process falls behind at 1,000 and delivers a little more at 2,000; two workers keep
    # pace at 1,000 and fall behind at 2,000. Read at 1,000 (the highest step --workers 2 kept
    # pace) the ratio would be 40,000 / 30,000; each one's highest is 68,000 / 40,000.
    sat = [
        step(SUBJECT, 500, 1.0),
        step(WORKERS2, 500, 1.0),
        step(SUBJECT, 1000, 0.75),
        step(WORKERS2, 1000, 1.0),
        step(SUBJECT, 2000, 0.5),
        step(WORKERS2, 2000, 0.85),
    ]
    w = _workers(sat)
    assert w is not None
    assert (w["at_streams"], w["w2_tokens_per_s"]) == (2000, 68_000)
    assert (w["w1_at_streams"], w["w1_tokens_per_s"]) == (2000, 40_000)
    assert w["tokens_per_s"] == 68_000 / 40_000
    assert w["w2_saturated"] and w["w1_saturated"] and not w["w2_kept_pace"]
    note = _workers_note(w)
    assert "lower bound" not in note and "never saturated" not in note


def test_each_peak_is_where_that_server_delivered_most() -> None:
    # One process's peak is at 1,000, before its throughput sagged at 2,000.
    sat = [
        step(SUBJECT, 1000, 0.8),
        step(SUBJECT, 2000, 0.3),
        step(WORKERS2, 1000, 1.0),
        step(WORKERS2, 2000, 0.8),
    ]
    w = _workers(sat)
    assert w is not None
    assert (w["w1_at_streams"], w["w1_tokens_per_s"]) == (1000, 32_000)
    assert w["tokens_per_s"] == 64_000 / 32_000


def test_workers2_never_behind_gives_a_lower_bound() -> None:
    sat = [
        step(SUBJECT, 1000, 0.95),
        step(WORKERS2, 1000, 1.0),
        step(SUBJECT, 2000, 0.5),
        step(WORKERS2, 2000, 0.92),
    ]
    w = _workers(sat)
    assert w is not None
    assert kept_pace(sat[-1]) and w["w2_kept_pace"]
    assert not w["w2_saturated"] and w["w1_saturated"]
    assert (w["at_streams"], w["tokens_per_s"]) == (2000, 73_600 / 40_000)
    note = _workers_note(w)
    assert "kept pace at every step: its capacity is at least 73,600 tokens/s" in note
    assert "the ratio is a lower bound" in note and "never saturated" not in note


def test_one_process_never_behind_is_not_meaningful() -> None:
    sat = [
        step(SUBJECT, 1000, 1.0),
        step(WORKERS2, 1000, 1.0),
        step(SUBJECT, 2000, 0.95),
        step(WORKERS2, 2000, 0.8),
    ]
    w = _workers(sat)
    assert w is not None
    assert not w["w1_saturated"] and w["w2_saturated"]
    assert "one process was never saturated" in _workers_note(w)


def test_a_failed_stream_counts_as_falling_behind() -> None:
    failed = {**step(SUBJECT, 1000, 1.0), "exact": 999}
    w = _workers([failed, step(WORKERS2, 1000, 0.8)])
    assert w is not None and w["w1_saturated"]


def test_no_ratio_without_both_servers() -> None:
    assert _workers([step(SUBJECT, 1000, 0.5)]) is None
    assert _workers([step(WORKERS2, 1000, 0.5)]) is None
