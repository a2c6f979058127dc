"""A server-wide byte budget for event-stream bodies (`--max-stream-bytes-per-s`).

Writes are paced, never dropped or reordered: a writer that finds the budget spent stops
writing and waits in line; its stream's log holds what it has not sent, and the stream's
window pauses the engine as for any slow reader. Every tick the budget refills and the
waiting writers take turns in arrival order, one batch each, so many streams share the cap
fairly. Off by default: then no writer knows a pacer exists.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["Pacer"]

TICK_S = 0.01


class PacedWriter(Protocol):
    def resume_paced(self) -> None: ...


class Pacer:
    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.rate = bytes_per_s
        self.burst = max(bytes_per_s * TICK_S * 2, 16 * 1024)  # two ticks' worth, at least 16 KiB
        self._clock = clock
        self._budget = self.burst
        self._at = clock()
        self._waiting: deque[tuple[PacedWriter, float]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self.wait_s = 0.0  # time writers spent waiting, summed (the metric)

    def take(self, size: int) -> bool:
        """Spend `size` bytes if the budget is not spent; the last write may overdraw it."""
        self._refill()
        if self._budget <= 0:
            return False
        self._budget -= size
        return True

    def wait(self, writer: PacedWriter) -> None:
        """`writer` found the budget spent: it is resumed in its turn."""
        self._waiting.append((writer, self._clock()))
        self._arm()

    def forget(self, writer: PacedWriter) -> None:
        self._waiting = deque(w for w in self._waiting if w[0] is not writer)

    def _refill(self) -> None:
        now = self._clock()
        self._budget = min(self.burst, self._budget + (now - self._at) * self.rate)
        self._at = now

    def _arm(self) -> None:
        if self._timer is None and self._waiting:
            self._refill()
            delay = max(TICK_S, -self._budget / self.rate) if self._budget <= 0 else 0.0
            self._timer = asyncio.get_running_loop().call_later(delay, self._turns)

    def _turns(self) -> None:
        self._timer = None
        self._refill()
        now = self._clock()
        # Each waiting writer gets one turn, in arrival order, while there is budget; one
        # that still has more to send queues again at the back.
        for _ in range(len(self._waiting)):
            if self._budget <= 0:
                break
            writer, since = self._waiting.popleft()
            self.wait_s += now - since
            writer.resume_paced()
        self._arm()

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "firsttoken_pacing_wait_seconds",
            "Time event-stream writers waited for the --max-stream-bytes-per-s budget.",
        )
        family.add_metric([], self.wait_s)
        yield family
