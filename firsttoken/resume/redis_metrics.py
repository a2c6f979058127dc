"""The Redis store's gauges and counters for /metrics, from the figures its parts keep."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["RedisFigures", "redis_metrics"]


@dataclass(slots=True, frozen=True)
class RedisFigures:
    up: bool
    backlog: int  # events kept here that Redis has not confirmed
    dropped: int  # events that never reached Redis
    kept: int  # streams replicated from here
    followed: int  # readers here of other instances' streams
    fenced: int
    swept: int
    outages: int
    evicted: int


def _one(family: GaugeMetricFamily | CounterMetricFamily, value: float) -> Metric:
    family.add_metric([], value)
    return family


def redis_metrics(f: RedisFigures) -> Iterator[Metric]:
    yield _one(GaugeMetricFamily("firsttoken_redis_up", "1 while the stream store answers."), f.up)
    yield _one(
        GaugeMetricFamily(
            "firsttoken_redis_backlog_events", "Events waiting to be replicated to Redis."
        ),
        f.backlog,
    )
    yield _one(
        CounterMetricFamily(
            "firsttoken_redis_events_dropped",
            "Events that never reached Redis: they fell off a stream's backlog bound.",
        ),
        f.dropped,
    )
    yield _one(
        GaugeMetricFamily(
            "firsttoken_redis_kept_streams", "Streams whose events are kept for replication."
        ),
        f.kept,
    )
    yield _one(
        GaugeMetricFamily(
            "firsttoken_redis_followed_streams",
            "Readers here of other instances' streams, served by the shared tail.",
        ),
        f.followed,
    )
    yield _one(
        CounterMetricFamily(
            "firsttoken_redis_fenced_writes",
            "Writes Redis refused because another instance had taken the stream over.",
        ),
        f.fenced,
    )
    yield _one(
        CounterMetricFamily(
            "firsttoken_redis_orphans_swept",
            "Streams of dead instances that no reader took over, ended and billed here.",
        ),
        f.swept,
    )
    yield _one(
        CounterMetricFamily("firsttoken_redis_outages", "Times Redis became unreachable."),
        f.outages,
    )
    yield _one(
        CounterMetricFamily(
            "firsttoken_redis_keys_evicted",
            "Keys Redis evicted (maxmemory-policy other than noeviction) since this instance "
            "started: any may have been a spend counter, a limit's or a stream's.",
        ),
        f.evicted,
    )
