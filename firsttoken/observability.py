"""Metrics and structured logs. Stages call into this module; it calls nobody.

Per-token metrics are plain integer arithmetic (no locks, no label lookups): the event loop is
single-threaded, and prometheus-client's own Histogram walks its buckets linearly under a lock.
The exposition format still comes from prometheus-client, at scrape time.
"""

from __future__ import annotations

import logging
import sys
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

__all__ = ["OUTCOMES", "Histogram", "Metrics", "configure_logging", "log_event"]

OUTCOMES = ("completed", "cancelled", "disconnected", "error", "rejected")


def _steps(start: float, stop: float, step: float) -> list[float]:
    n = round((stop - start) / step)
    return [round(start + step * i, 6) for i in range(1, n + 1)]


# Fine where people notice (a p50/p99 read off these is within 5%), coarse beyond.
TTFT_BUCKETS = (
    _steps(0.0, 0.1, 0.002)
    + _steps(0.1, 0.5, 0.005)
    + [0.6, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0]
)
INTER_CHUNK_BUCKETS = (
    _steps(0.0, 0.01, 0.0005)
    + _steps(0.01, 0.03, 0.001)
    + _steps(0.03, 0.1, 0.002)
    + [0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 15.0, 60.0]
)


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            cumulative.append((repr(bound), total))
        total += self.counts[-1]
        cumulative.append(("+Inf", total))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.sum)


class Metrics:
    """The server's counters and histograms, exported under the INTERFACE.md names."""

    def __init__(
        self,
        tokens_generated: Callable[[], int] = lambda: 0,
        engine_counter: Callable[[str], int] = lambda name: 0,
    ) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.inter_chunk = Histogram(INTER_CHUNK_BUCKETS)
        self.tokens_sent = 0
        self.active_streams = 0
        self.streams = dict.fromkeys(OUTCOMES, 0)
        self.shedding = dict.fromkeys(("ttft", "memory"), 0)  # the breaker has its own state
        self.breaker_state = "closed"
        self.memory_rss_bytes = 0
        self.tokens_generated = tokens_generated
        self.engine_counter = engine_counter  # e.g. "failovers" of the relay, "cache_hits"
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

    def collect(self) -> Iterator[Metric]:
        yield self.ttft.family("firsttoken_ttft_seconds", "Request accepted to first token sent.")
        yield self.inter_chunk.family(
            "firsttoken_inter_chunk_seconds", "Gap between consecutive content events sent."
        )
        yield _one(
            CounterMetricFamily,
            "firsttoken_tokens_generated",
            "Tokens the engine produced.",
            self.tokens_generated(),
        )
        yield _one(
            CounterMetricFamily,
            "firsttoken_tokens_sent",
            "Tokens written to clients.",
            self.tokens_sent,
        )
        for attr, name, doc in (
            ("failovers", "firsttoken_relay_failovers", "Streams moved to another upstream."),
            ("cache_hits", "firsttoken_cache_hits", "Answers served from the prompt cache."),
            ("canned_hits", "firsttoken_canned_answers", "Greetings served canned answers."),
        ):
            yield _one(CounterMetricFamily, name, doc, self.engine_counter(attr))
        yield _labelled(
            CounterMetricFamily,
            "firsttoken_streams",
            "Streams by outcome.",
            "outcome",
            self.streams,
        )
        yield _one(
            GaugeMetricFamily,
            "firsttoken_active_streams",
            "Streams generating now.",
            self.active_streams,
        )
        shedding = {**self.shedding, "breaker": int(self.breaker_state != "closed")}
        yield _labelled(
            GaugeMetricFamily,
            "firsttoken_shedding",
            "1 while new streams are refused, by trigger.",
            "reason",
            shedding,
        )
        states = {s: int(s == self.breaker_state) for s in ("closed", "open", "half_open")}
        yield _labelled(
            GaugeMetricFamily,
            "firsttoken_breaker_state",
            "Circuit breaker: 1 for the current state.",
            "state",
            states,
        )
        yield _one(
            GaugeMetricFamily,
            "firsttoken_memory_rss_bytes",
            "Resident memory of the process.",
            self.memory_rss_bytes,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _one(kind: type[Metric], name: str, doc: str, value: float) -> Metric:
    family = kind(name, doc)
    family.add_metric([], value)  # type: ignore[attr-defined]
    return family


def _labelled(
    kind: type[Metric], name: str, doc: str, label: str, values: dict[str, int]
) -> Metric:
    family = kind(name, doc, labels=[label])  # type: ignore[call-arg]
    for key, value in values.items():
        family.add_metric([key], value)  # type: ignore[attr-defined]
    return family


_logger = logging.getLogger("firsttoken")


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    _logger.handlers[:] = [handler]
    _logger.setLevel(level.upper())
    _logger.propagate = False


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """One JSON line: {"ts", "level", "event", ...fields}."""
    if _logger.isEnabledFor(level):
        record = {
            "ts": round(time.time(), 6),
            "level": logging.getLevelName(level).lower(),
            "event": event,
            **fields,
        }
        _logger.log(level, orjson.dumps(record, default=str).decode())
