"""The log lines the operator's feed forwards as they happen, and the last errors.

`telemetry.log.log_event` hands every line to `LogTap.heard` (`tap_log_events`): a few dict
lookups for the lines nobody watches (most of them: `stream.finished` of a completed stream),
and for the others a small dict kept or queued. Nothing here is per token.

What it keeps:
- the last errors (a stream that ended with `event: error`, a 5xx refusal), each with its
  code, route, target (the last target that failed the stream, from `route.target_failed`),
  key and trace id;
- failovers and hand-offs per target (`firsttoken_target_failovers_total{target, phase}`,
  `firsttoken_target_handoffs_total{target}`): the route's own counters are per route;
- for the feed, the lines worth showing live (`FORWARDED`, and any warning or worse), at most
  `MAX_FORWARD_PER_S` a second: past that they are counted, not sent.

Under --workers each worker writes its last errors to the shared metrics directory (at most
once a second, when they changed), so the worker that serves the feed shows every worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["FORWARDED", "LogTap", "read_errors"]

# Lines forwarded whatever their level (warnings and errors always are).
FORWARDED = frozenset(
    {
        "route.failover",
        "route.splice",
        "route.handoff",
        "redis.up",
        "otel.export_recovered",
        "shed.stop",
        "worker.start",
    }
)
RECENT_ERRORS = 50
MAX_FORWARD_PER_S = 50
STREAM_TARGETS = 4096  # streams whose failed target is remembered until they end
ERRORS_PREFIX = "ops-errors-"  # each worker's file in the metrics directory (not w*.json)


class LogTap:
    """Errors and live lines from the log; failover counts per target."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        share: tuple[Path, str] | None = None,
    ) -> None:
        self.clock = clock
        self.errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)
        self.failovers: dict[tuple[str, str], int] = {}
        self.handoffs: dict[str, int] = {}
        self.listener: Callable[[dict[str, Any]], None] | None = None
        self.dropped = 0  # lines not forwarded: over MAX_FORWARD_PER_S
        self._failed_at: OrderedDict[str, str] = OrderedDict()  # stream id -> target
        self._second = 0
        self._sent_this_second = 0
        self._share = share
        self._flush_due = False
        self._lock = threading.Lock()  # lines come from export threads too (otel)

    def heard(self, event: str, level: int, fields: dict[str, Any]) -> None:
        """One log line (`telemetry.metrics.LogTap`)."""
        if event == "stream.finished":
            if fields.get("outcome") != "error":
                if self._failed_at:  # a stream that failed over and then ended well
                    self._failed_at.pop(str(fields.get("stream")), None)
                return
            self._error(event, level, fields)
            return
        if event.startswith("route."):
            self._route(event, fields)
        elif event == "request.failed" or event == "request.crashed":
            self._error(event, level, fields)
            return
        if level >= logging.WARNING or event in FORWARDED:
            self._forward(event, level, fields)

    def _route(self, event: str, fields: dict[str, Any]) -> None:
        if event == "route.target_failed":
            stream = str(fields.get("stream"))
            self._failed_at[stream] = str(fields.get("target"))
            self._failed_at.move_to_end(stream)
            if len(self._failed_at) > STREAM_TARGETS:
                self._failed_at.popitem(last=False)
        elif event in ("route.failover", "route.splice"):
            key = (str(fields.get("from")), str(fields.get("phase")))
            self.failovers[key] = self.failovers.get(key, 0) + 1
        elif event == "route.handoff":
            source = str(fields.get("from"))
            self.handoffs[source] = self.handoffs.get(source, 0) + 1

    def _error(self, event: str, level: int, fields: dict[str, Any]) -> None:
        stream = fields.get("stream")
        error = {
            "ts": round(self.clock(), 3),
            "code": fields.get("error_code") or fields.get("code") or "internal_error",
            "route": fields.get("model"),
            "target": self._failed_at.pop(str(stream), None) if stream else None,
            "key": fields.get("key"),
            "trace_id": fields.get("trace_id"),
            "stream": stream,
            "status": fields.get("status"),
        }
        if self._share is not None:
            error["pid"] = os.getpid()
        with self._lock:
            self.errors.append(error)
        self._shared_soon()
        self._forward(event, max(level, logging.WARNING), {**fields, **_named(error)})

    def _forward(self, event: str, level: int, fields: dict[str, Any]) -> None:
        listener = self.listener
        if listener is None:
            return
        now = int(self.clock())
        if now != self._second:
            self._second, self._sent_this_second = now, 0
        if self._sent_this_second >= MAX_FORWARD_PER_S:
            self.dropped += 1
            return
        self._sent_this_second += 1
        level_name = logging.getLevelName(level).lower()
        listener({"ts": round(self.clock(), 3), "level": level_name, "event": event, **fields})

    def recent_errors(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.errors)

    # -- under --workers: every worker's errors, through the metrics directory ------------

    def _shared_soon(self) -> None:
        if self._share is None or self._flush_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # said from a thread: the next error on the loop writes it
            return
        self._flush_due = True
        loop.call_later(1.0, self._write_shared)

    def _write_shared(self) -> None:
        self._flush_due = False
        if self._share is None:
            return
        directory, name = self._share
        path = directory / f"{ERRORS_PREFIX}{name}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        with contextlib.suppress(OSError):
            tmp.write_bytes(orjson.dumps(self.recent_errors(), default=str))
            os.replace(tmp, path)

    # -- metrics ---------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        failovers = CounterMetricFamily(
            "firsttoken_target_failovers",
            "Streams a target failed that went on elsewhere, by phase (mid_stream: a splice).",
            labels=["target", "phase"],
        )
        for (target, phase), count in list(self.failovers.items()):
            failovers.add_metric([target, phase], count)
        yield failovers
        handoffs = CounterMetricFamily(
            "firsttoken_target_handoffs",
            "Answers a hand-off target began and handed to its route's targets.",
            labels=["target"],
        )
        for target, count in list(self.handoffs.items()):
            handoffs.add_metric([target], count)
        yield handoffs


def _named(error: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in error.items() if v is not None and k != "ts"}


def read_errors(directory: Path) -> list[dict[str, Any]]:
    """Every worker's last errors, newest last."""
    errors: list[dict[str, Any]] = []
    for path in directory.glob(f"{ERRORS_PREFIX}*.json"):
        with contextlib.suppress(OSError, orjson.JSONDecodeError):
            errors.extend(orjson.loads(path.read_bytes()))
    errors.sort(key=lambda e: e.get("ts", 0))
    return errors[-RECENT_ERRORS:]
