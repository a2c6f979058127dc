"""Load shedding: a circuit breaker on engine errors, a TTFT guard, and a memory guard.

Each trigger is independent, has its own metric and log line, and while any holds, new
streams get 503 with Retry-After and /readyz answers 503 so a load balancer routes around us.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path

import anyio

from firsttoken.config import Settings
from firsttoken.telemetry.log import log_event
from firsttoken.telemetry.metrics import Metrics

__all__ = ["BreakerState", "LoadShedder", "memory_limit_bytes", "rss_bytes"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def memory_limit_bytes(spec: str) -> int:
    """'2G', '512M', '1073741824', or 'auto' (cgroup v2/v1 limit, else total RAM)."""
    if spec != "auto":
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", spec.strip().upper())
        if not m:
            raise ValueError(f"memory limit {spec!r}: use bytes or a K/M/G/T suffix")
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_statm: tuple[int, int] | None = None  # (pid, descriptor)


def rss_bytes() -> int:
    # One descriptor per process, re-read: at the open-file limit a fresh open would fail
    # (and a worker forked after the open must not read its parent's figure).
    global _statm
    if _statm is None or _statm[0] != os.getpid():
        _statm = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
    return int(os.pread(_statm[1], 256, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"  # one probe stream decides


class LoadShedder:
    CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.s = settings
        self.metrics = metrics
        self.memory_limit = memory_limit_bytes(settings.memory_limit)
        self.breaker = self.CLOSED
        self._opened_at = 0.0
        self._probing = False  # half-open: one admitted stream is the probe
        self._outcomes: deque[tuple[float, bool]] = deque()  # (when, failed)
        self._failures = 0  # failed outcomes in the window, kept as they come and go
        self._ttfts: deque[tuple[float, float]] = deque()
        self._ttft_checked = 0.0
        self.reasons: set[str] = set()
        self.draining = False  # SIGTERM: new streams go elsewhere, running ones finish

    # Signals from streams.

    def record_outcome(self, failed: bool) -> None:
        """A stream that ran ended (completed or engine error). While the breaker is open or
        probing, only the probe's outcome counts (`probe_done`)."""
        now = time.monotonic()
        if self.breaker != self.CLOSED:
            return
        outcomes = self._outcomes
        outcomes.append((now, failed))
        self._failures += failed
        if outcomes[0][0] < now - self.s.breaker_window_s:  # else none is past the window
            self._trim_outcomes(now)
        total = len(outcomes)
        if total >= self.s.breaker_min_streams:
            if self._failures / total > self.s.breaker_error_rate:
                self._set_breaker(self.OPEN, now)

    def take_probe(self) -> bool:
        """Half-open: the stream admitted now becomes the probe (True), unless one is out."""
        if self.breaker != self.HALF_OPEN or self._probing:
            return False
        self._probing = True
        return True

    def probe_done(self, ran: bool, failed: bool) -> None:
        """The probe ended. If it ran to an outcome, that decides the breaker; if it never
        did (refused later, its client left, cancelled), the slot goes back for another."""
        self._probing = False
        if self.breaker != self.HALF_OPEN or not ran:
            return
        now = time.monotonic()
        self._set_breaker(self.OPEN if failed else self.CLOSED, now)
        if not failed:
            self._outcomes.clear()
            self._failures = 0

    def record_ttft(self, seconds: float) -> None:
        if self.s.ttft_slo_ms <= 0:
            return  # the guard is off: nothing reads them (`_update_ttft`)
        now = time.monotonic()
        ttfts = self._ttfts
        ttfts.append((now, seconds))
        if ttfts[0][0] < now - self.s.breaker_window_s:  # else none is past the window
            self._trim(ttfts, now)

    # Decisions.

    def refusal(self) -> tuple[str, str, float] | None:
        """(code, message, retry_after_s) while new streams must be refused, else None."""
        now = time.monotonic()
        if self.draining:
            return "server_draining", "the server is shutting down; retry on another instance", 5.0
        if self.breaker is not self.CLOSED:  # asked per new stream: closed, one check
            if self.breaker == self.OPEN and now - self._opened_at >= self.s.breaker_open_s:
                self._set_breaker(self.HALF_OPEN, now)
                self._probing = False
            if self.breaker == self.OPEN:
                wait = self.s.breaker_open_s - (now - self._opened_at)
                return "engine_unavailable", "the engine is failing; the breaker is open", wait
            if self.breaker == self.HALF_OPEN and self._probing:  # one probe at a time decides
                return "engine_unavailable", "the breaker is probing the engine", 1.0
        self._update_ttft(now)
        if not self.reasons:
            return None
        if "ttft" in self.reasons:
            return "overloaded", f"TTFT p99 is over {self.s.ttft_slo_ms:.0f} ms", 5.0
        if "memory" in self.reasons:
            return "overloaded", "memory is over its limit", 5.0
        return None

    @property
    def shedding(self) -> bool:
        self._update_ttft(time.monotonic())
        return bool(self.reasons) or self.breaker != self.CLOSED or self.draining

    async def watch_memory(
        self, end_oldest: Callable[[], bool], interval_s: float = 0.25, calm_s: float = 1.0
    ) -> None:
        """Refuse new streams and end the oldest ones while RSS is over the threshold.

        Read every `interval_s` once RSS is past half the threshold, every `calm_s` below it:
        an idle server wakes once a second for it, and crossing the other half takes far
        longer than a second (admission adds streams of ~12 KiB each)."""
        threshold = self.memory_limit * self.s.memory_shed_fraction
        while True:
            try:
                rss = rss_bytes()
            except OSError:  # e.g. out of file descriptors: keep the last reading
                rss = self.metrics.memory_rss_bytes
            self.metrics.memory_rss_bytes = rss
            over = rss > threshold
            self._set_reason("memory", over, rss_bytes=rss, threshold_bytes=int(threshold))
            if over:
                end_oldest()
            await anyio.sleep(interval_s if rss > threshold / 2 else calm_s)

    # Internals.

    def _update_ttft(self, now: float) -> None:
        # Sorting the window costs O(n log n): at most ten times a second, not per admission.
        if self.s.ttft_slo_ms <= 0 or now - self._ttft_checked < 0.1:
            return
        self._ttft_checked = now
        self._trim(self._ttfts, now)
        values = sorted(v for _, v in self._ttfts)
        over = False
        if len(values) >= self.s.breaker_min_streams:
            p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
            over = p99 * 1000 > self.s.ttft_slo_ms
        self._set_reason("ttft", over)

    def _trim_outcomes(self, now: float) -> None:
        horizon = now - self.s.breaker_window_s
        outcomes = self._outcomes
        while outcomes and outcomes[0][0] < horizon:
            self._failures -= outcomes.popleft()[1]

    def _trim(self, window: deque[tuple[float, float]], now: float) -> None:
        horizon = now - self.s.breaker_window_s
        while window and window[0][0] < horizon:
            window.popleft()

    def _set_breaker(self, state: BreakerState, now: float) -> None:
        if state == self.breaker:
            return
        self.breaker = state
        if state == self.OPEN:
            self._opened_at = now
        self.metrics.breaker_state = state.value
        log_event("shed.breaker", logging.WARNING, state=state)

    def _set_reason(self, reason: str, on: bool, **fields: object) -> None:
        if on == (reason in self.reasons):
            return
        if on:
            self.reasons.add(reason)
        else:
            self.reasons.discard(reason)
        self.metrics.shedding[reason] = int(on)
        log_event("shed.start" if on else "shed.stop", logging.WARNING, reason=reason, **fields)
