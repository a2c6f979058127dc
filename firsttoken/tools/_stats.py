"""Small, dependency-free statistics for latency figures."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile", "summary"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values_s: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99/max/mean in milliseconds, from values in seconds."""
    ms = [v * 1000.0 for v in values_s]
    return {
        "p50": _round(percentile(ms, 50)),
        "p90": _round(percentile(ms, 90)),
        "p99": _round(percentile(ms, 99)),
        "max": _round(max(ms) if ms else None),
        "mean": _round(sum(ms) / len(ms) if ms else None),
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
