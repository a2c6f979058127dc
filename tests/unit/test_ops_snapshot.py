"""The operator's snapshot: quantiles as Prometheus computes them, windows over the ticks kept,
rates, broken service levels, targets and keys, on a fake clock and hand-made families."""

from __future__ import annotations

import time
from typing import Any

import pytest

from firsttoken.ops.snapshot import HISTORY, SLO, WINDOW_S, Snapshots, quantile
from firsttoken.telemetry.metrics import Metrics
from tests.unit.clock import FakeClock


def families(metrics: Metrics) -> list[Any]:
    return [
        [f.name, f.type, f.documentation, [[s.name, s.labels, s.value] for s in f.samples]]
        for f in metrics.registry.collect()
    ]


def test_quantile_interpolates_within_a_bucket_like_prometheus() -> None:
    bounds = [0.1, 0.2, 0.4, float("inf")]
    assert quantile(0.5, bounds, [0, 10, 10, 10]) == pytest.approx(0.15)
    assert quantile(0.99, bounds, [0, 0, 100, 100]) == pytest.approx(0.2 + 0.2 * 0.99)
    assert quantile(0.99, bounds, [0, 0, 0, 5]) == 0.4  # +Inf: the last finite bound
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_service_levels_over_now_and_fifteen_minutes_and_broken_marked() -> None:
    clock, metrics, snaps = FakeClock(), Metrics(), Snapshots()
    snaps.build(families(metrics), clock())
    for _ in range(100):
        metrics.ttft.observe(0.05)
        metrics.inter_chunk.observe(0.02)
    metrics.streams["completed"] += 100
    clock.advance(1)
    first = snaps.build(families(metrics), clock())
    assert first["slo"]["ttft_p99"]["now"] == first["slo"]["ttft_p99"]["15m"]
    assert 0.048 <= first["slo"]["ttft_p99"]["now"] <= 0.05
    assert first["slo"]["completion"]["now"] == 1.0
    assert first["broken"] == []
    # Twenty seconds later, slow first tokens and failures: broken now, and over 15 min.
    clock.advance(20)
    snaps.build(families(metrics), clock())
    for _ in range(10):
        metrics.ttft.observe(0.45)
    metrics.streams["error"] += 10
    clock.advance(1)
    late = snaps.build(families(metrics), clock())
    assert late["slo"]["ttft_p99"]["now"] > SLO["ttft_p99_s"]
    assert late["slo"]["ttft_p50"]["now"] > 0.4  # the window holds only the slow ones
    assert late["slo"]["ttft_p50"]["15m"] < 0.06  # the 15 minutes hold all of them
    assert late["slo"]["completion"]["now"] == 0.0
    assert round(late["slo"]["completion"]["15m"], 3) == round(100 / 110, 3)
    assert set(late["broken"]) == {"ttft_p99", "completion"}
    assert late["slo"]["inter_chunk_mean"]["15m"] == 0.02
    assert not late["slo"]["inter_chunk_mean"]["broken"]


def test_rates_traffic_by_route_and_keys() -> None:
    clock, snaps = FakeClock(), Snapshots()
    generated = {"n": 0}
    metrics = Metrics(tokens_generated=lambda: generated["n"])
    metrics.count_key_tokens("alice", (0, 0, 0, 0, 0))
    snaps.build(families(metrics), clock())
    for _ in range(10):
        metrics.stream_started("chat", "alice")
    metrics.stream_ended("chat", "alice")
    generated["n"] += 500
    metrics.tokens_sent += 400
    metrics.count_key_tokens("alice", (100, 200, 0, 0, 0))
    clock.advance(5)
    snap = snaps.build(families(metrics), clock())
    chat = snap["traffic"]["routes"]["chat"]
    assert chat == {"active": 9, "new_per_s": 2.0, "handoffs_per_min": 0.0}
    assert snap["traffic"]["tokens_generated_per_s"] == 100.0
    assert snap["traffic"]["tokens_undelivered_per_s"] == 20.0
    alice = snap["keys"]["alice"]
    assert alice["active"] == 9 and alice["tokens_per_min"] == 3600.0
    assert "spend" not in alice  # no firsttoken_key_spend family: no spend shown
    assert snap["point"]["active"] == {"chat": 9}
    assert snaps.history()[-1] is snap["point"]


def test_spend_shows_once_the_metric_exists() -> None:
    snap = Snapshots().build(
        [
            [
                "firsttoken_key_spend",
                "counter",
                "",
                [["firsttoken_key_spend_total", {"key": "a"}, 1.5]],
            ],
            [
                "firsttoken_key_active_streams",
                "gauge",
                "",
                [["firsttoken_key_active_streams", {"key": "a"}, 1]],
            ],
        ],
        1000.0,
    )
    assert snap["keys"]["a"]["spend"] == 1.5


def test_targets_under_workers_read_sums_as_the_whole_server() -> None:
    """Merged gauges are sums over workers: up only when every worker says so, averages
    divided by the number of workers (counted from the breaker gauge, one per worker)."""

    def gauge(name: str, value: float, **labels: str) -> list[Any]:
        return [name, "gauge", "", [[name, labels, value]]]

    snap = Snapshots().build(
        [
            [
                "firsttoken_breaker_state",
                "gauge",
                "",
                [
                    ["firsttoken_breaker_state", {"state": "closed"}, 2],
                    ["firsttoken_breaker_state", {"state": "open"}, 0],
                ],
            ],
            gauge("firsttoken_target_up", 1, target="gpu"),
            gauge("firsttoken_target_in_flight", 7, target="gpu"),
            gauge("firsttoken_target_max_concurrency", 8, target="gpu"),
            gauge("firsttoken_target_first_token_seconds", 0.5, target="gpu"),
            gauge("firsttoken_target_probe_in_seconds", 20, target="gpu"),
        ],
        1000.0,
    )
    assert snap["workers"] == 2
    gpu = snap["targets"]["gpu"]
    assert gpu["up"] is False  # one of two workers ejected it
    assert gpu["in_flight"] == 7 and gpu["max_concurrency"] == 8
    assert gpu["first_token_s"] == 0.25 and gpu["probe_in_s"] == 10.0
    assert snap["breaker"] == "closed"


def test_history_is_bounded_and_old_ticks_go() -> None:
    clock, metrics, snaps = FakeClock(), Metrics(), Snapshots()
    for _ in range(HISTORY + 50):
        snaps.build(families(metrics), clock())
        clock.advance(1)
    assert len(snaps.history()) == HISTORY
    assert snaps.ticks[-1].ts - snaps.ticks[0].ts <= WINDOW_S + 1.5


def test_a_snapshot_costs_little() -> None:
    """Built once a second whatever the load: well under a millisecond's tenth of it."""
    metrics, snaps = Metrics(), Snapshots()
    for i in range(20):
        metrics.stream_started(f"route-{i}", f"key-{i}")
        metrics.count_key_tokens(f"key-{i}", (1, 2, 3, 4, 0))
    for i in range(1000):
        metrics.ttft.observe(i / 1000)
    fams = families(metrics)
    started = time.perf_counter()
    for i in range(100):
        snaps.build(fams, 1000.0 + i)
    per_build = (time.perf_counter() - started) / 100
    assert per_build < 0.01  # 1 % of a core at one a second; ~1 ms measured


def test_spend_hidden_while_nothing_has_a_price() -> None:
    """The ledger counts every key's spend from the start, at 0, and every route's cost per
    million tokens, 0 without prices: no price, no column."""
    spend = "firsttoken_key_spend_total"
    cost = "firsttoken_cost_per_million_tokens"

    def families(route_cost: float) -> list[Any]:
        return [
            ["firsttoken_key_spend", "counter", "", [[spend, {"key": "a"}, 0.0]]],
            [cost, "gauge", "", [[cost, {"route": "r"}, route_cost]]],
        ]

    assert "spend" not in Snapshots().build(families(0.0), 1000.0)["keys"]["a"]
    assert Snapshots().build(families(1.0), 1000.0)["keys"]["a"]["spend"] == 0.0


def test_the_ledger_is_away_while_its_records_wait() -> None:
    def queued(n: float) -> list[Any]:
        name = "firsttoken_usage_records_queued"
        return [[name, "gauge", "", [[name, {}, n]]]]

    clock, snaps = FakeClock(), Snapshots(ledger=True)
    assert Snapshots().build(queued(0), clock())["deps"]["ledger"] is None  # no --usage-db
    for n in (0, 5, 0):  # a batch waits a moment, then goes: up
        state = snaps.build(queued(n), clock())["deps"]["ledger"]
        clock.advance(1)
    assert state == "up"
    for _ in range(12):  # records waiting for ten seconds and more: away
        state = snaps.build(queued(40), clock())["deps"]["ledger"]
        clock.advance(1)
    assert state == "away"


def test_the_ledger_is_away_at_once_while_its_database_refuses_writes() -> None:
    def up(value: float) -> list[Any]:
        name = "firsttoken_usage_db_up"
        return [[name, "gauge", "", [[name, {}, value]]]]

    clock, snaps = FakeClock(), Snapshots(ledger=True)
    assert snaps.build(up(1), clock())["deps"]["ledger"] == "up"
    clock.advance(1)
    assert snaps.build(up(0), clock())["deps"]["ledger"] == "away"  # no 10 s wait


def test_spend_is_in_the_currency_priced_in_now_and_the_budget_shows_what_is_left() -> None:
    snap = Snapshots().build(
        [
            [
                "firsttoken_key_spend",
                "counter",
                "",
                [
                    ["firsttoken_key_spend_total", {"key": "a", "currency": "USD"}, 7.0],
                    ["firsttoken_key_spend_total", {"key": "a", "currency": "EUR"}, 1.5],
                ],
            ],
            ["firsttoken_currency", "gauge", "", [["firsttoken_currency", {"currency": "EUR"}, 1]]],
            [
                "firsttoken_key_budget_amount",
                "gauge",
                "",
                [["firsttoken_key_budget_amount", {"key": "a", "per": "day"}, 10.0]],
            ],
            [
                "firsttoken_key_budget_spent",
                "gauge",
                "",
                [["firsttoken_key_budget_spent", {"key": "a", "per": "day"}, 4.0]],
            ],
        ],
        1000.0,
    )
    a = snap["keys"]["a"]
    assert a["spend"] == 1.5  # the dollars spent before a reload are not added in
    assert a["budget"] == {"amount": 10.0, "per": "day", "spent": 4.0, "left": 6.0}
