"""Structured logs: one JSON line per event, written once per turn of the event loop.

Stages call `log_event`; the server configures where lines go (`configure_logging`), the
operator's feed taps every event (`tap_log_events`), a worker tags its lines with its pid
(`add_log_field`)."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from firsttoken.telemetry.logsink import LineSink

__all__ = [
    "LogTap",
    "add_log_field",
    "configure_logging",
    "flush_logs",
    "log_enabled",
    "log_event",
    "tap_log_events",
]

_log_fields: dict[str, Any] = {}


def add_log_field(name: str, value: Any) -> None:
    """Every line from now on carries `name` (a worker's pid)."""
    _log_fields[name] = value


_logger = logging.getLogger("firsttoken")
# Set by configure_logging (the server): lines go straight to stdout's descriptor, a write per
# turn of the event loop (`LineSink`). Through `logging` a line cost ~40 µs (a LogRecord,
# getpid, a lock, a flush), three times per stream.
_sink: LineSink | None = None
_LEVELS = {level: logging.getLevelName(level).lower() for level in (10, 20, 30, 40, 50)}


def configure_logging(level: str = "info") -> None:
    global _sink
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    _logger.handlers[:] = [handler]
    _logger.setLevel(level.upper())
    _logger.propagate = False
    sys.stdout.flush()
    if _sink is not None:
        _sink.flush()
    _sink = LineSink(sys.stdout.fileno())


def flush_logs() -> None:
    """Write the lines still waiting for the end of the loop's turn (before the loop ends)."""
    if _sink is not None:
        _sink.flush()


atexit.register(flush_logs)
# A forked worker must not write its parent's pending lines a second time.
os.register_at_fork(before=flush_logs)


def log_enabled(level: int) -> bool:
    """Whether a line at `level` would be written: a caller checks it before building the
    fields of a line that is usually off (debug)."""
    return _logger.isEnabledFor(level)


LogTap = Callable[[str, int, dict[str, Any]], None]
_tap: LogTap | None = None


def tap_log_events(tap: LogTap | None) -> None:
    """Hand every `log_event` (at any level, logged or not) to `tap` too: the operator's
    feed (firsttoken/ops) sees errors, ejections and reloads as they are said. One slot: the
    last app built in a process holds it."""
    global _tap
    _tap = tap


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """One JSON line: {"ts", "level", "event", ...fields}."""
    if _tap is not None:
        _tap(event, level, fields)
    if _logger.isEnabledFor(level):
        record = {
            "ts": round(time.time(), 6),
            "level": _LEVELS.get(level) or logging.getLevelName(level).lower(),
            "event": event,
            **_log_fields,
            **fields,
        }
        if _sink is not None:
            _sink(orjson.dumps(record, default=str, option=orjson.OPT_APPEND_NEWLINE))
        else:
            _logger.log(level, orjson.dumps(record, default=str).decode())
