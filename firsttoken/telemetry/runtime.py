"""Process gauges read at scrape time: event-loop tasks and open file descriptors.

What a soak watches for growth (a task or a socket left behind per stream), at no per-request
cost: both are counted only when /metrics is read.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

__all__ = ["RuntimeCollector"]


class RuntimeCollector:
    def collect(self) -> Iterator[Metric]:
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # no running loop (a scrape from another thread)
            tasks = 0
        family = GaugeMetricFamily("firsttoken_event_loop_tasks", "asyncio tasks alive.")
        family.add_metric([], tasks)
        yield family
        try:
            fds = len(os.listdir("/proc/self/fd"))
        except OSError:  # not Linux, or out of descriptors right now
            return
        family = GaugeMetricFamily("firsttoken_open_fds", "Open file descriptors.")
        family.add_metric([], fds)
        yield family
