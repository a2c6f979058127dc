"""What the operator's view needs that the data plane keeps anyway, read at scrape time.

Each target's streams in flight against its `max_concurrency`, its usual first-token time,
and each key's limits (streams, tokens per minute). Nothing is counted per token or per
stream here: these are attributes the router and the keys file already hold, read when
/metrics (or the operator's feed) collects, so they are shared across workers like every
other collector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

__all__ = ["LimitGauges"]


class _KeyLimits(Protocol):
    """What these gauges read of an `admission.keys.ApiKey`."""

    @property
    def name(self) -> str: ...
    @property
    def max_streams(self) -> int | None: ...
    @property
    def tokens_per_minute(self) -> int | None: ...


class LimitGauges:
    """Targets' in-flight counts and limits, keys' limits."""

    def __init__(
        self,
        targets: Callable[[], Iterable[object]],  # routes.target.Target, read by attribute
        keys: Callable[[], Iterable[_KeyLimits]],
        max_streams_per_key: int,
    ) -> None:
        # Callables, read at each collect: a reload swaps the targets and keys whole.
        self.targets = targets
        self.keys = keys
        self.max_streams_per_key = max_streams_per_key

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "firsttoken_target_in_flight", "Streams a target serves now.", labels=["target"]
        )
        limit = GaugeMetricFamily(
            "firsttoken_target_max_concurrency",
            "A target's max_concurrency (targets without one are not listed).",
            labels=["target"],
        )
        first = GaugeMetricFamily(
            "firsttoken_target_first_token_seconds",
            "A target's usual time to first token (moving average of its recent streams).",
            labels=["target"],
        )
        for target in self.targets():
            name = str(getattr(target, "name", ""))
            in_flight.add_metric([name], getattr(target, "outstanding", 0))
            config = getattr(target, "config", None)
            most = getattr(config, "max_concurrency", None)
            if most is not None:
                limit.add_metric([name], most)
            usual = getattr(target, "first_token_s", None)
            if usual is not None:
                first.add_metric([name], usual)
        yield in_flight
        yield limit
        yield first
        streams = GaugeMetricFamily(
            "firsttoken_key_max_streams",
            "A key's limit on streams at once (0: none).",
            labels=["key"],
        )
        tokens = GaugeMetricFamily(
            "firsttoken_key_tokens_per_minute_limit",
            "A key's tokens_per_minute budget (keys without one are not listed).",
            labels=["key"],
        )
        for key in self.keys():
            streams.add_metric([key.name], key.max_streams or self.max_streams_per_key)
            if key.tokens_per_minute is not None:
                tokens.add_metric([key.name], key.tokens_per_minute)
        yield streams
        yield tokens
