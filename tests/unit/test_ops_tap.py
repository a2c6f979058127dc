"""The log tap: last errors with their target, failovers per target, lines forwarded live
(capped per second), and the hook in `telemetry.log.log_event`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from firsttoken.ops.tap import MAX_FORWARD_PER_S, RECENT_ERRORS, LogTap, read_errors
from firsttoken.telemetry import log as observability
from tests.unit.clock import FakeClock


def finished(stream: str, outcome: str, **extra: Any) -> dict[str, Any]:
    return {
        "stream": stream,
        "trace_id": f"trace-{stream}",
        "key": "bob",
        "model": "chat",
        "outcome": outcome,
        "error_code": "upstream_truncated" if outcome == "error" else None,
        **extra,
    }


def test_an_errored_stream_is_kept_with_the_target_that_failed_it() -> None:
    tap = LogTap(FakeClock())
    failed = {"stream": "s1", "route": "chat", "target": "gpu-cut", "code": "upstream_truncated"}
    tap.heard("route.target_failed", logging.WARNING, failed)
    tap.heard("stream.finished", logging.INFO, finished("s1", "error"))
    tap.heard("stream.finished", logging.INFO, finished("s2", "completed"))
    [error] = tap.recent_errors()
    assert error["code"] == "upstream_truncated"
    assert (error["route"], error["target"], error["key"]) == ("chat", "gpu-cut", "bob")
    assert error["trace_id"] == "trace-s1"


def test_failovers_splices_and_handoffs_counted_per_target() -> None:
    tap = LogTap(FakeClock())
    tap.heard("route.failover", logging.INFO, {"from": "a", "to": "b", "phase": "connect"})
    tap.heard("route.splice", logging.INFO, {"from": "a", "to": "b", "phase": "mid_stream"})
    tap.heard("route.splice", logging.INFO, {"from": "a", "to": "b", "phase": "mid_stream"})
    tap.heard("route.handoff", logging.INFO, {"from": "edge", "to": "b"})
    samples = {
        (s.name, tuple(sorted(s.labels.values()))): s.value
        for family in tap.collect()
        for s in family.samples
    }
    assert samples["firsttoken_target_failovers_total", ("a", "connect")] == 1
    assert samples["firsttoken_target_failovers_total", ("a", "mid_stream")] == 2
    assert samples["firsttoken_target_handoffs_total", ("edge",)] == 1


def test_lines_forwarded_live_are_capped_per_second() -> None:
    clock = FakeClock()
    tap = LogTap(clock)
    heard: list[dict[str, Any]] = []
    tap.heard("shed.start", logging.WARNING, {"reason": "ttft"})  # nobody listens: nothing
    tap.listener = heard.append
    tap.heard("stream.finished", logging.INFO, finished("s0", "completed"))  # not worth it
    tap.heard("route.failover", logging.INFO, {"from": "a", "phase": "connect"})
    assert [h["event"] for h in heard] == ["route.failover"]
    for _ in range(MAX_FORWARD_PER_S * 2):
        tap.heard("shed.start", logging.WARNING, {"reason": "ttft"})
    assert len(heard) == MAX_FORWARD_PER_S and tap.dropped == MAX_FORWARD_PER_S + 1
    clock.advance(1)
    tap.heard("shed.stop", logging.WARNING, {"reason": "ttft"})
    assert heard[-1]["event"] == "shed.stop"


def test_errors_are_bounded() -> None:
    tap = LogTap(FakeClock())
    for i in range(RECENT_ERRORS + 10):
        tap.heard("stream.finished", logging.INFO, finished(f"s{i}", "error"))
    errors = tap.recent_errors()
    assert len(errors) == RECENT_ERRORS and errors[-1]["stream"] == f"s{RECENT_ERRORS + 9}"


def test_under_workers_errors_go_through_the_shared_directory(tmp_path: Path) -> None:
    tap = LogTap(FakeClock(), share=(tmp_path, "w1"))
    tap.heard("request.failed", logging.WARNING, {"code": "internal_error", "status": 500})
    tap._write_shared()  # what the loop's timer runs a second later
    [error] = read_errors(tmp_path)
    assert error["code"] == "internal_error" and error["status"] == 500
    assert not list(tmp_path.glob("w*.json"))  # never mistaken for a worker's metrics


def test_log_event_hands_every_line_to_the_tap_whatever_the_level() -> None:
    heard: list[tuple[str, int]] = []
    observability.tap_log_events(lambda event, level, fields: heard.append((event, level)))
    try:
        observability.log_event("stream.first_token", logging.DEBUG, stream="x")
    finally:
        observability.tap_log_events(None)
    observability.log_event("after", logging.INFO)
    assert heard == [("stream.first_token", logging.DEBUG)]
