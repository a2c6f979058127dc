"""The Redis store's /metrics families (`firsttoken/resume/redis_metrics.py`)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from firsttoken.resume.redis_metrics import RedisFigures, redis_metrics


def test_each_figure_is_one_family_and_the_counts_are_counters() -> None:
    figures = RedisFigures(
        up=True, backlog=1, dropped=2, kept=3, followed=4, fenced=5, swept=6, outages=7, evicted=8
    )
    families = {m.name: m for m in redis_metrics(figures)}
    values = {name: m.samples[0].value for name, m in families.items()}
    assert values == {
        "firsttoken_redis_up": 1,
        "firsttoken_redis_backlog_events": 1,
        "firsttoken_redis_events_dropped": 2,
        "firsttoken_redis_kept_streams": 3,
        "firsttoken_redis_followed_streams": 4,
        "firsttoken_redis_fenced_writes": 5,
        "firsttoken_redis_orphans_swept": 6,
        "firsttoken_redis_outages": 7,
        "firsttoken_redis_keys_evicted": 8,
    }
    counters = {n for n, m in families.items() if isinstance(m, CounterMetricFamily)}
    assert counters == {
        "firsttoken_redis_events_dropped",
        "firsttoken_redis_fenced_writes",
        "firsttoken_redis_orphans_swept",
        "firsttoken_redis_outages",
        "firsttoken_redis_keys_evicted",
    }
