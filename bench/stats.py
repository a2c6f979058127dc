"""One run's figures: latency percentiles, throughput, CPU, and the token-exact check."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bench.decode import Decoded, decode
from bench.load import Capture

__all__ = ["RunStats", "Samples", "summarize"]

CLIENT_SATURATED = 0.9  # client CPU share of one core above which its figures are suspect


@dataclass(slots=True)
class Samples:
    """Raw distributions kept for the chart (not written to the JSON)."""

    added_ttft_ms: np.ndarray
    gaps_ms: np.ndarray


@dataclass(slots=True)
class RunStats:
    server: str
    workload: str
    concurrency: int
    streams: int
    completed: int = 0
    exact: int = 0  # streams whose text matched the engine's token-exact
    problems: dict[str, int] = field(default_factory=dict)
    ttft_ms_p50: float | None = None
    added_ttft_ms_p50: float | None = None
    added_ttft_ms_p99: float | None = None
    added_ttft_ms_max: float | None = None
    gap_ms_p50: float | None = None
    gap_ms_p99: float | None = None
    gap_ms_max: float | None = None
    tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    delivery: float = 0.0  # tokens/s ÷ what the engine's schedule would deliver (1.0 = on pace)
    server_cpu_s: float = 0.0
    server_cpu_share: float = 0.0  # of one core, over the run
    tokens_per_cpu_s: float | None = None
    client_cpu_share: float = 0.0
    client_saturated: bool = False
    client_lag_ms_p99: float | None = None  # the client's own event-loop stalls
    client_lag_ms_max: float | None = None
    others_cpu_share: float = 0.0  # the rest of the machine (other agents, the kernel), cores
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def summarize(
    server: str,
    workload: str,
    captures: Sequence[Capture],
    *,
    engine_ttft_ms: float,
    wall_s: float,
    server_cpu_s: float,
    client_cpu_s: float,
    machine_busy_s: float,
    ideal_window_s: float = 0.0,
) -> tuple[RunStats, list[Decoded], Samples]:
    stats = RunStats(server, workload, len(captures), len(captures))
    decoded = [decode(c) for c in captures]
    problems: Counter[str] = Counter()
    ttfts: list[float] = []
    gaps: list[np.ndarray] = []
    first_sent = min((c.t_sent for c in captures if c.t_sent), default=0.0)
    last_read = first_sent
    for cap, d in zip(captures, decoded, strict=True):
        expected = cap.spec.tokens()
        if d.problem and not cap.hung_up:
            problems[_kind(d.problem)] += 1
        received = d.received_tokens(expected)
        stats.tokens += received
        if cap.hung_up:
            ok = received == len(d.contents) and tuple(d.contents) == expected[:received]
        else:
            ok = d.done and tuple(d.contents) == expected
            stats.completed += d.done
        if ok:
            stats.exact += 1
        elif not d.problem:
            problems["text differs from the engine's"] += 1
        if d.times:
            ttfts.append((d.times[0] - cap.t_sent) * 1000)
            gaps.append(np.diff(np.asarray(d.times)) * 1000)
            last_read = max(last_read, d.times[-1])
    stats.problems = dict(problems)
    added = np.asarray(ttfts) - engine_ttft_ms
    gap_all = np.concatenate(gaps) if gaps else np.zeros(0)
    stats.ttft_ms_p50 = _pct(np.asarray(ttfts), 50)
    stats.added_ttft_ms_p50 = _pct(added, 50)
    stats.added_ttft_ms_p99 = _pct(added, 99)
    stats.added_ttft_ms_max = float(added.max()) if added.size else None
    stats.gap_ms_p50 = _pct(gap_all, 50)
    stats.gap_ms_p99 = _pct(gap_all, 99)
    stats.gap_ms_max = float(gap_all.max()) if gap_all.size else None
    stream_window = last_read - first_sent
    stats.wall_s = wall_s
    stats.tokens_per_s = stats.tokens / stream_window if stream_window > 0 else 0.0
    if ideal_window_s > 0 and stats.tokens_per_s:
        ideal = sum(len(c.spec.tokens()) for c in captures if not c.hung_up) / ideal_window_s
        stats.delivery = stats.tokens_per_s / ideal if ideal else 0.0
    stats.server_cpu_s = server_cpu_s
    stats.server_cpu_share = server_cpu_s / wall_s if wall_s else 0.0
    stats.tokens_per_cpu_s = stats.tokens / server_cpu_s if server_cpu_s > 0 else None
    stats.client_cpu_share = client_cpu_s / wall_s if wall_s else 0.0
    stats.client_saturated = stats.client_cpu_share > CLIENT_SATURATED
    others = machine_busy_s - server_cpu_s - client_cpu_s
    stats.others_cpu_share = max(0.0, others / wall_s) if wall_s else 0.0
    return stats, decoded, Samples(added, gap_all)


def _kind(problem: str) -> str:
    """Group similar problems (drop the variable tail) so the JSON stays short."""
    return problem.split(":", 1)[0][:80]


def loadavg() -> list[float]:
    """The machine's load averages (1, 5, 15 min), for a run's header; [] where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
