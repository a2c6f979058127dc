"""The operator's view of the server, built once a second from its own metrics.

`Snapshots.build(families, now)` reads the metric families (this worker's, or every
worker's merged as /metrics merges them) and returns one JSON-ready dict: the service levels
now (the last `NOW_S` seconds) and over the last 15 minutes against their targets, traffic by
route, each target, each key, the breaker and the shedder, Redis/OpenTelemetry/ledger.
It keeps the cumulative values of the last 15 minutes (one tick a second) to turn counters
into rates and histograms into quantiles over a window, and the charts' points for the same
15 minutes, so a page that opens (or reconnects) draws them at once.

Cost: one pass over the families and a few hundred floats kept per tick, whatever the
number of streams or subscribers (measured: `tests/unit/test_ops_snapshot.py` builds one).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SLO", "Family", "Snapshots", "quantile"]

# [name, type, help, [[sample name, labels, value], ...]], as telemetry.metrics.WorkerShare has it.
Family = list[Any]

# The service levels and the thresholds of deploy/prometheus/firsttoken.rules.yml.
SLO = {
    "ttft_p99_s": 0.3,  # FirsttokenTTFTHigh: TTFT p99 > 300 ms
    "inter_chunk_mean_s": 0.08,  # FirsttokenInterTokenSlow: mean inter-token > 80 ms
    "completion": 0.995,  # FirsttokenStreamCompletionLow: completed < 99.5 %
}
NOW_S = 10.0  # "now": the service levels over the last 10 seconds
WINDOW_S = 900.0  # and over the last 15 minutes
RATE_S = 5.0  # per-second rates over the last 5 seconds
MINUTE_S = 60.0
HISTORY = 900  # chart points kept (one a second)
MAX_ERRORS = 20


@dataclass(slots=True)
class _Tick:
    ts: float
    counters: dict[str, float]
    ttft: array[float]
    inter_chunk: array[float]


def _priced_in(s: _Samples) -> dict[str, str]:
    """The spend counters' label for the currency priced in now (a reload may have changed
    it: what was spent in another is not added in); none before the ledger says."""
    for labels, _ in s.by_name.get("firsttoken_currency", ()):
        if "currency" in labels:
            return {"currency": labels["currency"]}
    return {}


class _Samples:
    """The families' samples by sample name."""

    def __init__(self, families: Iterable[Family]) -> None:
        self.by_name: dict[str, list[tuple[Mapping[str, str], float]]] = {}
        self.names: set[str] = set()
        for name, _kind, _doc, samples in families:
            self.names.add(name)
            for sample, labels, value in samples:
                self.by_name.setdefault(sample, []).append((labels, float(value)))

    def has(self, family: str) -> bool:
        return family in self.names

    def one(self, sample: str, default: float = 0.0, **match: str) -> float:
        for labels, value in self.by_name.get(sample, ()):
            if all(labels.get(k) == v for k, v in match.items()):
                return value
        return default

    def total(self, sample: str, **match: str) -> float:
        return sum(
            value
            for labels, value in self.by_name.get(sample, ())
            if all(labels.get(k) == v for k, v in match.items())
        )

    def by(self, sample: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in self.by_name.get(sample, ()):
            if label in labels and all(labels.get(k) == v for k, v in match.items()):
                out[labels[label]] = out.get(labels[label], 0.0) + value
        return out

    def buckets(self, family: str) -> tuple[list[float], array[float]]:
        """A histogram's upper bounds and cumulative counts (summed over other labels)."""
        counts: dict[float, float] = {}
        for labels, value in self.by_name.get(family + "_bucket", ()):
            bound = float(labels["le"])
            counts[bound] = counts.get(bound, 0.0) + value
        bounds = sorted(counts)
        return bounds, array("d", (counts[b] for b in bounds))


def quantile(q: float, bounds: list[float], cumulative: Iterable[float]) -> float | None:
    """`histogram_quantile` as Prometheus computes it (linear within a bucket; the last
    finite bound for the +Inf bucket); None without observations."""
    counts = list(cumulative)
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


class Snapshots:
    """Builds each second's snapshot and keeps what the windows and charts need."""

    def __init__(self, ledger: bool = False) -> None:
        self.ledger = ledger  # --usage-db given: the ledger is a dependency to show
        self.ticks: deque[_Tick] = deque()
        self.points: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.ttft_bounds: list[float] = []
        self.inter_chunk_bounds: list[float] = []
        self._found: dict[tuple[float, float], _Tick | None] = {}
        self._stamps: list[float] = []  # the ticks' times, for bisect (rebuilt once a build)

    def build(
        self,
        families: Iterable[Family],
        now: float,
        errors: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        s = _Samples(families)
        self._found.clear()
        self._stamps = []
        counters = self._counters(s)
        self.ttft_bounds, ttft = s.buckets("firsttoken_ttft_seconds")
        self.inter_chunk_bounds, inter_chunk = s.buckets("firsttoken_inter_chunk_seconds")
        tick = _Tick(now, counters, ttft, inter_chunk)
        self.ticks.append(tick)
        while self.ticks and self.ticks[0].ts < now - WINDOW_S - 1.5:
            self.ticks.popleft()
        workers = max(1, round(s.total("firsttoken_breaker_state")))
        slo = self._service_levels(tick, counters)
        traffic = self._traffic(s, tick)
        snapshot: dict[str, Any] = {
            "ts": round(now, 3),
            "workers": workers,
            "slo": slo,
            "broken": [name for name, level in slo.items() if level.get("broken")],
            "traffic": traffic,
            "targets": self._targets(s, tick, workers),
            "keys": self._keys(s, tick),
            "errors": (errors or [])[-MAX_ERRORS:],
            "breaker": max(
                ("closed", "half_open", "open"),
                key=lambda state: (s.one("firsttoken_breaker_state", state=state) > 0, state),
            )
            if s.total("firsttoken_breaker_state", state="closed") < workers
            else "closed",
            "shedding": {
                reason: value > 0 for reason, value in s.by("firsttoken_shedding", "reason").items()
            },
            "outcomes": s.by("firsttoken_streams_total", "outcome"),
            "deps": self._dependencies(s, tick),
            "reloads": s.by("firsttoken_config_reloads_total", "result"),
        }
        point = {
            "ts": snapshot["ts"],
            "ttft_p50": slo["ttft_p50"]["now"],
            "ttft_p99": slo["ttft_p99"]["now"],
            "itl_p50": slo["inter_chunk_p50"]["now"],
            "itl_p99": slo["inter_chunk_p99"]["now"],
            "completion": slo["completion"]["now"],
            "active": {r: v["active"] for r, v in traffic["routes"].items()},
            "new_per_s": {r: v["new_per_s"] for r, v in traffic["routes"].items()},
            "generated_per_s": traffic["tokens_generated_per_s"],
            "sent_per_s": traffic["tokens_sent_per_s"],
            "undelivered_per_s": traffic["tokens_undelivered_per_s"],
            "in_flight": {t: v["in_flight"] for t, v in snapshot["targets"].items()},
            "queued": {t: v["queue"] for t, v in snapshot["targets"].items()},
        }
        self.points.append(point)
        snapshot["point"] = point
        return snapshot

    def history(self) -> list[dict[str, Any]]:
        return list(self.points)

    # -- reading -------------------------------------------------------------------------

    def _counters(self, s: _Samples) -> dict[str, float]:
        out = {
            "generated": s.total("firsttoken_tokens_generated_total"),
            "sent": s.total("firsttoken_tokens_sent_total"),
            "inter_chunk_sum": s.total("firsttoken_inter_chunk_seconds_sum"),
            "inter_chunk_count": s.total("firsttoken_inter_chunk_seconds_count"),
            "streams": s.total("firsttoken_route_streams_total"),
        }
        for outcome, value in s.by("firsttoken_streams_total", "outcome").items():
            out[f"outcome:{outcome}"] = value
        for route, value in s.by("firsttoken_route_streams_total", "route").items():
            out[f"route:{route}"] = value
        for route, value in s.by("firsttoken_handoffs_total", "route").items():
            out[f"route_handoffs:{route}"] = value
        for labels, value in s.by_name.get("firsttoken_target_failovers_total", ()):
            kind = "splices" if labels.get("phase") == "mid_stream" else "failovers"
            key = f"{kind}:{labels.get('target')}"
            out[key] = out.get(key, 0.0) + value
        for target, value in s.by("firsttoken_target_handoffs_total", "target").items():
            out[f"handoffs:{target}"] = value
        for target, value in s.by("firsttoken_queue_wait_seconds_sum", "target").items():
            out[f"wait_sum:{target}"] = value
        for target, value in s.by("firsttoken_queue_wait_seconds_count", "target").items():
            out[f"wait_count:{target}"] = value
        for labels, value in s.by_name.get("firsttoken_key_tokens_total", ()):
            if labels.get("kind") in ("prompt", "completion"):
                key = f"key_tokens:{labels.get('key')}"
                out[key] = out.get(key, 0.0) + value
        for key, value in s.by("firsttoken_key_spend_total", "key", **_priced_in(s)).items():
            out[f"spend:{key}"] = value
        out["otel_dropped"] = s.total("firsttoken_otel_dropped_total")
        out["ledger_queued"] = s.total("firsttoken_usage_records_queued")
        out["ledger_dropped"] = s.total("firsttoken_usage_records_dropped_total")
        return out

    def _since(self, now: float, seconds: float) -> _Tick | None:
        """The oldest tick within `seconds` of `now` (None: only `now`'s own); a handful of
        windows, each looked up once per build."""
        key = (now, seconds)
        if key not in self._found:
            if len(self._stamps) != len(self.ticks):
                self._stamps = [tick.ts for tick in self.ticks]
            at = bisect_left(self._stamps, now - seconds - 0.5)
            last = len(self.ticks) - 1
            self._found[key] = self.ticks[at] if at < last else None
        return self._found[key]

    def _rate(self, tick: _Tick, name: str, seconds: float, per: float = 1.0) -> float:
        before = self._since(tick.ts, seconds)
        if before is None or tick.ts <= before.ts:
            return 0.0
        delta = tick.counters.get(name, 0.0) - before.counters.get(name, 0.0)
        return round(max(0.0, delta) / (tick.ts - before.ts) * per, 3)

    def _service_levels(self, tick: _Tick, counters: dict[str, float]) -> dict[str, Any]:
        levels: dict[str, Any] = {}
        for label, seconds in (("now", NOW_S), ("15m", WINDOW_S)):
            before = self._since(tick.ts, seconds)
            for name, bounds, now_counts, then in (
                ("ttft", self.ttft_bounds, tick.ttft, before.ttft if before else None),
                (
                    "inter_chunk",
                    self.inter_chunk_bounds,
                    tick.inter_chunk,
                    before.inter_chunk if before else None,
                ),
            ):
                delta = _minus(now_counts, then) if then is not None else None
                for q in (50, 99):
                    value = None if delta is None else quantile(q / 100, bounds, delta)
                    level = levels.setdefault(f"{name}_p{q}", {})
                    level[label] = None if value is None else round(value, 5)
            was = before.counters if before is not None else None
            done = _delta(counters, was, "outcome:completed")
            failed = _delta(counters, was, "outcome:error")
            gaps = _delta(counters, was, "inter_chunk_count")
            gap_time = _delta(counters, was, "inter_chunk_sum")
            levels.setdefault("completion", {})[label] = (
                round(done / (done + failed), 5)
                if done is not None and failed is not None and done + failed > 0
                else None
            )
            levels.setdefault("inter_chunk_mean", {})[label] = (
                round(gap_time / gaps, 5) if gaps and gap_time is not None else None
            )
        levels["ttft_p99"]["target"] = SLO["ttft_p99_s"]
        levels["inter_chunk_mean"]["target"] = SLO["inter_chunk_mean_s"]
        levels["completion"]["target"] = SLO["completion"]
        for name, worse in (("ttft_p99", 1), ("inter_chunk_mean", 1), ("completion", -1)):
            level = levels[name]
            level["broken"] = any(
                level[w] is not None and (level[w] - level["target"]) * worse > 0
                for w in ("now", "15m")
            )
        return levels

    def _traffic(self, s: _Samples, tick: _Tick) -> dict[str, Any]:
        routes: dict[str, Any] = {}
        active = s.by("firsttoken_route_active_streams", "route")
        for route in sorted(set(active) | set(s.by("firsttoken_route_streams_total", "route"))):
            routes[route] = {
                "active": int(active.get(route, 0)),
                "new_per_s": self._rate(tick, f"route:{route}", RATE_S),
                "handoffs_per_min": self._rate(tick, f"route_handoffs:{route}", MINUTE_S, 60),
            }
        generated = self._rate(tick, "generated", RATE_S)
        sent = self._rate(tick, "sent", RATE_S)
        return {
            "active": int(s.total("firsttoken_active_streams")),
            "new_per_s": self._rate(tick, "streams", RATE_S),
            "tokens_generated_per_s": generated,
            "tokens_sent_per_s": sent,
            # Generated and never written: mostly tokens made after a reader left.
            "tokens_undelivered_per_s": round(max(0.0, generated - sent), 3),
            "routes": routes,
        }

    def _targets(self, s: _Samples, tick: _Tick, workers: int) -> dict[str, Any]:
        up = s.by("firsttoken_target_up", "target")
        probe = s.by("firsttoken_target_probe_in_seconds", "target")
        in_flight = s.by("firsttoken_target_in_flight", "target")
        limit = s.by("firsttoken_target_max_concurrency", "target")
        queue = s.by("firsttoken_queue_length", "target")
        first = s.by("firsttoken_target_first_token_seconds", "target")
        out: dict[str, Any] = {}
        for name in sorted(up):
            waited = self._rate(tick, f"wait_count:{name}", MINUTE_S)
            wait_s = self._rate(tick, f"wait_sum:{name}", MINUTE_S)
            out[name] = {
                # Under --workers a gauge is the sum over workers: up when every worker says so.
                "up": up[name] >= workers,
                "probe_in_s": round(probe.get(name, 0.0) / workers, 1) or None,
                "in_flight": int(in_flight.get(name, 0)),
                "max_concurrency": int(limit[name]) if name in limit else None,
                "queue": int(queue.get(name, 0)),
                "queue_wait_s": round(wait_s / waited, 4) if waited else None,
                "failovers_per_min": self._rate(tick, f"failovers:{name}", MINUTE_S, 60),
                "splices_per_min": self._rate(tick, f"splices:{name}", MINUTE_S, 60),
                "handoffs_per_min": self._rate(tick, f"handoffs:{name}", MINUTE_S, 60),
                "first_token_s": round(first[name] / workers, 4) if name in first else None,
            }
        return out

    def _keys(self, s: _Samples, tick: _Tick) -> dict[str, Any]:
        active = s.by("firsttoken_key_active_streams", "key")
        limit = s.by("firsttoken_key_max_streams", "key")
        budget = s.by("firsttoken_key_tokens_per_minute_limit", "key")
        spend = s.by("firsttoken_key_spend_total", "key", **_priced_in(s))
        amounts = s.by("firsttoken_key_budget_amount", "key")
        periods = {
            labels["key"]: labels.get("per", "")
            for labels, _ in s.by_name.get("firsttoken_key_budget_amount", ())
            if "key" in labels
        }
        spent = s.by("firsttoken_key_budget_spent", "key")
        names = (
            set(active) | set(limit) | set(spend) | set(s.by("firsttoken_key_tokens_total", "key"))
        )
        # Spend once prices exist: a route with a cost, or a key that spent something.
        costs = s.by("firsttoken_cost_per_million_tokens", "route").values()
        priced = s.has("firsttoken_key_spend") and (any(costs) or any(spend.values()))
        out: dict[str, Any] = {}
        for name in sorted(names):
            out[name] = {
                "active": int(active.get(name, 0)),
                "max_streams": int(limit[name]) if name in limit else None,
                "tokens_per_min": self._rate(tick, f"key_tokens:{name}", MINUTE_S, 60),
                "tokens_per_min_limit": int(budget[name]) if name in budget else None,
            }
            if priced:
                # Since this process started; the budget's own period is `budget.spent`.
                out[name]["spend"] = spend.get(name, 0.0)
                out[name]["spend_per_min"] = self._rate(tick, f"spend:{name}", MINUTE_S, 60)
            if name in amounts:
                used = spent.get(name, 0.0)
                out[name]["budget"] = {
                    "amount": amounts[name],
                    "per": periods.get(name, ""),
                    "spent": used,
                    "left": max(0.0, amounts[name] - used),
                }
        return out

    def _dependencies(self, s: _Samples, tick: _Tick) -> dict[str, str | None]:
        """Each dependency: "up", "away", or None where it is not configured."""
        redis = None
        if s.has("firsttoken_redis_up"):
            redis = "up" if s.total("firsttoken_redis_up") > 0 else "away"
        otel = None
        if s.has("firsttoken_otel_dropped"):  # spans dropped in the last 30 s: away
            otel = "away" if self._rate(tick, "otel_dropped", 30.0) > 0 else "up"
        ledger = None
        if self.ledger:  # away: writes refused now, records waiting all of the last 10 s, or
            # dropped in the last 30 (under --workers: any worker's)
            refused = any(v == 0 for _, v in s.by_name.get("firsttoken_usage_db_up", ()))
            recent = [t for t in self.ticks if t.ts >= tick.ts - NOW_S]
            stuck = len(recent) > 1 and all(t.counters.get("ledger_queued", 0) > 0 for t in recent)
            dropped = self._rate(tick, "ledger_dropped", 30.0) > 0
            ledger = "away" if refused or stuck or dropped else "up"
        return {"redis": redis, "otel": otel, "ledger": ledger}


def _minus(now: array[float], then: array[float]) -> list[float]:
    if len(now) != len(then):
        return list(now)
    return [a - b for a, b in zip(now, then, strict=True)]


def _delta(now: dict[str, float], then: dict[str, float] | None, name: str) -> float | None:
    if then is None:
        return None
    return max(0.0, now.get(name, 0.0) - then.get(name, 0.0))
