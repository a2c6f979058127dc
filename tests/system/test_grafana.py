"""The Grafana dashboards (deploy/grafana/): every panel's PromQL returns data from a real
Prometheus scraping a real gateway under load (two workers, Redis, routes with a failing, a
queueing, a cutting and a handing-off target and prices, two keys, a SQLite usage ledger, an
OpenTelemetry collector that is away), each service-level threshold is the one its alert rule
uses, and the JSON decodes into Grafana's own dashboard models (the official Foundation SDK)
without losing a field.

Needs the Debian packages `prometheus` and `redis-server` (scripts/test installs them).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.redis_server import run_redis
from tests.servers import ROOT, parse_metrics, run_server, wait_for
from tests.system.test_slo_rules import RULES, run_prometheus, short_rules
from tests.upstreams import free_port, scripted_upstream

DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
# Metrics a panel may draw that a gateway exposes only once configured for them: their panels
# may be empty while the metric is absent from /metrics, and must have data once it is there.
NOT_YET: tuple[str, ...] = ()


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def as_prometheus_runs_it(expr: str) -> str:
    """Grafana's variables as the dashboards' defaults expand them, on the test's time scale."""
    return expr.replace('"$job"', '".+"').replace("$__rate_interval", "5s")


def test_dashboards_load_with_grafanas_own_models() -> None:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel
    from grafana_foundation_sdk.models.prometheus import Dataquery

    register_default_plugins()
    assert len(DASHBOARDS) == 2
    for path in DASHBOARDS:
        raw = json.loads(path.read_text())
        model = Dashboard.from_json(raw)
        assert model.panels and all(isinstance(p, Panel | RowPanel) for p in model.panels)
        for panel in model.panels:
            if isinstance(panel, Panel):
                assert panel.targets and all(isinstance(t, Dataquery) for t in panel.targets)
        # Every field we wrote is one the schema knows: it survives the models' round trip.
        again = json.loads(json.dumps(model, cls=JSONEncoder))
        assert _lost(raw, again) == [], path.name


def _lost(mine: Any, theirs: Any, path: str = "") -> list[str]:
    if isinstance(mine, dict):
        if not isinstance(theirs, dict):
            return [path]
        return [
            p
            for key, value in mine.items()
            for p in (
                [f"{path}.{key}"]
                if key not in theirs
                else _lost(value, theirs[key], f"{path}.{key}")
            )
        ]
    if isinstance(mine, list):
        if not isinstance(theirs, list) or len(mine) != len(theirs):
            return [path]
        return [
            p
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True))
            for p in _lost(a, b, f"{path}[{i}]")
        ]
    return [] if mine == theirs else [f"{path}: {mine!r} became {theirs!r}"]


def test_dashboards_are_laid_out_and_unique() -> None:
    uids = set()
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        uids.add(board["uid"])
        ids = [p["id"] for p in panels(board)]
        assert len(ids) == len(set(ids)), path.name
        cells: set[tuple[int, int]] = set()
        for panel in panels(board):
            pos = panel["gridPos"]
            assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
            mine = {
                (x, y)
                for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])
            }
            assert not mine & cells, f"{panel['title']} overlaps another panel"
            cells |= mine
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == "${datasource}"
    assert len(uids) == len(DASHBOARDS)


def _alert_thresholds() -> dict[str, float]:
    """Recorded series an alert compares with a number: {record name: threshold}."""
    out: dict[str, float] = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            found = re.fullmatch(r"\s*([\w:]+)\s*[<>]\s*([\d.]+)\s*", rule.get("expr", ""))
            if "alert" in rule and found:
                out[found[1]] = float(found[2])
    return out


def test_service_level_thresholds_are_the_alert_rules() -> None:
    thresholds = _alert_thresholds()
    assert set(thresholds) == {
        "job:firsttoken_ttft_seconds:p99_5m",
        "job:firsttoken_inter_chunk_seconds:mean_5m",
        "job:firsttoken_stream_completion:ratio_30m",
    }
    drawn: dict[str, int] = dict.fromkeys(thresholds, 0)
    for path in DASHBOARDS:
        for panel in panels(json.loads(path.read_text())):
            exprs = [t["expr"] for t in panel.get("targets", [])]
            for record, value in thresholds.items():
                if any(record in e for e in exprs):
                    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
                    assert value in [s["value"] for s in steps], panel["title"]
                    drawn[record] += 1
    assert all(count >= 2 for count in drawn.values()), drawn  # a stat and a time series


def routes(tmp: Path, upstream: str) -> Path:
    path = tmp / "routes.toml"
    path.write_text(
        f"""
currency = "USD"

[targets.gpu-down]
kind = "openai"
url = "http://127.0.0.1:{free_port()}/v1"
connect_timeout_s = 1

[targets.gpu-a]
kind = "synthetic"
max_concurrency = 2
ttft_ms = 20
itl_ms = 20
price = {{ prompt = 0.50, completion = 1.50 }}

[targets.edge]
kind = "synthetic"
ttft_ms = 20
itl_ms = 20

[targets.gpu-cut]
kind = "openai"
url = "{upstream}/v1"
model = "cut-chunked"
continuation = "vllm"

[models.chat]
targets = ["gpu-down", "gpu-a"]

[models.cut]
targets = ["gpu-cut", "gpu-a"]
max_splices = 1

[models.handoff]
targets = ["gpu-a"]
handoff = {{ from = "edge", after_tokens = 3 }}
"""
    )
    return path


def keys(tmp: Path) -> Path:
    path = tmp / "keys.toml"
    path.write_text(
        '[[keys]]\nname = "alice"\nkey = "sk-alice"\nmax_streams = 20\n'
        'tokens_per_minute = 1000000\n[[keys]]\nname = "bob"\nkey = "sk-bob"\n'
    )
    return path


def _load(url: str, stop: threading.Event, key: str, model: str) -> None:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "grafana"}],
    }
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {key}"}) as client:
        while not stop.is_set():
            try:
                client.post(url + "/v1/chat/completions", json=body)
            except httpx.TransportError:
                time.sleep(0.1)


def test_every_panel_returns_data_from_a_real_prometheus(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(short_rules(RULES.read_text(), window="10s"))
    stop = threading.Event()
    with ExitStack() as stack:
        redis = stack.enter_context(run_redis())
        upstream = stack.enter_context(scripted_upstream())
        server = stack.enter_context(
            run_server(
                "--workers",
                "2",
                "--redis",
                redis,
                "--routes",
                str(routes(tmp_path, upstream.url)),
                "--api-keys",
                str(keys(tmp_path)),
                "--otlp-endpoint",
                f"http://127.0.0.1:{free_port()}",  # away: spans dropped
                "--usage-db",
                f"sqlite:///{tmp_path / 'usage.db'}",
                "--rate-limit-per-s",
                "0",
                "--breaker-error-rate",
                "1",
            )
        )
        prom = stack.enter_context(run_prometheus(tmp_path, f"127.0.0.1:{server.port}", rules))
        plan = [("sk-alice", "chat")] * 4 + [("sk-bob", "cut"), ("sk-bob", "handoff")]
        threads = [
            threading.Thread(target=_load, args=(server.url, stop, *p), daemon=True) for p in plan
        ]
        for t in threads:
            t.start()
        try:
            exposed = parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)
            absent = [m for m in NOT_YET if not any(k.startswith(m) for k in exposed)]
            wanted = [
                (title, expr)
                for path in DASHBOARDS
                for title, expr in queries(json.loads(path.read_text()))
                if not any(m in expr for m in absent)
            ]
            assert len(wanted) >= 40
            empty: list[str] = []

            def all_have_data() -> bool:
                empty[:] = [
                    f"{title}: {expr}"
                    for title, expr in wanted
                    if not _query(prom, as_prometheus_runs_it(expr))
                ]
                return not empty

            try:
                wait_for(all_have_data, timeout=90, interval=2)
            except TimeoutError:
                pytest.fail("panels without data:\n" + "\n".join(empty))
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)


def _query(prometheus: str, expr: str) -> list[Any]:
    answer = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])
