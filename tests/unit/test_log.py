"""telemetry/log.py: one JSON line per event, the fields every line carries, the tap."""

from __future__ import annotations

import logging

import orjson
import pytest

from firsttoken.telemetry import log


def test_a_line_is_one_json_object_with_the_fields_every_line_carries(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(log, "_sink", None)  # through `logging`, as before configure_logging
    monkeypatch.setattr(log, "_log_fields", {})
    log.add_log_field("pid", 4242)
    with caplog.at_level(logging.INFO, logger="firsttoken"):
        log.log_event("stream.finished", stream="s1", tokens=3)
    (record,) = [orjson.loads(r.getMessage()) for r in caplog.records]
    assert record["event"] == "stream.finished" and record["level"] == "info"
    assert (record["pid"], record["stream"], record["tokens"]) == (4242, "s1", 3)


def test_a_line_below_the_level_is_not_written_but_is_tapped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(log, "_sink", None)
    heard: list[tuple[str, int]] = []
    log.tap_log_events(lambda event, level, fields: heard.append((event, level)))
    try:
        with caplog.at_level(logging.INFO, logger="firsttoken"):
            assert not log.log_enabled(logging.DEBUG)
            log.log_event("stream.first_token", logging.DEBUG, stream="x")
    finally:
        log.tap_log_events(None)
    assert caplog.records == []
    assert heard == [("stream.first_token", logging.DEBUG)]
