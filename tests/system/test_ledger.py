"""Prices, money budgets and the usage ledger, against the real server.

What every client was told (its usage) times the routes file's prices is what the ledger
holds and what `firsttoken_key_spend_total` says, to the last decimal; a key over its budget
gets 429 `budget_exceeded` on every API; keys racing for the last cent go over by at most one
reservation; the ledger survives a restart and (PostgreSQL) a database stopped under load.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.postgres_server import PostgresServer
from tests.servers import ROOT, Server, run_server, wait_for
from tests.upstreams import VLLM_CACHED_USAGE, scripted_upstream

ADMIN = "admin-secret"
M = Decimal(10**6)
EDGE = {"prompt": Decimal("0.1"), "completion": Decimal("0.2")}
CENTER = {
    "prompt": Decimal("0.5"),
    "completion": Decimal("1.5"),
    "reasoning": Decimal("3"),
}
VLLM = {"prompt": Decimal("0.4"), "completion": Decimal("1.2"), "cached_prompt": Decimal("0.04")}
GOLD = {"prompt": Decimal(0), "completion": Decimal("10000")}  # a cent a token
TEN = {"prompt": Decimal(1), "completion": Decimal(10)}

ROUTES = """
currency = "EUR"
[targets.edge]
kind = "synthetic"
ttft_ms = 2
itl_ms = 0
price = {{ prompt = 0.1, completion = 0.2 }}
[targets.center]
kind = "synthetic"
ttft_ms = 2
itl_ms = 0
price = {{ prompt = 0.50, completion = 1.50, reasoning = 3 }}
[targets.gold]
kind = "synthetic"
ttft_ms = 2
itl_ms = 1
price = {{ prompt = 0, completion = 10000 }}
[targets.ten]
kind = "synthetic"
ttft_ms = 2
itl_ms = 0
price = {{ prompt = 1, completion = 10 }}
{vllm}
[models.plain]
targets = ["center"]
[models.chat]
targets = ["center"]
handoff = {{ from = "edge", after_tokens = 5, prefill = false, pace_ms = 0 }}  # at exactly 5
[models.warm]
targets = ["center"]
handoff = {{ from = "edge", after_tokens = 5 }}  # with the center's prefill
[models.gold]
targets = ["gold"]
[models.ten]
targets = ["ten"]
{vllm_route}
"""
VLLM_TARGET = """
[targets.vllm]
kind = "openai"
url = "{url}"
model = "vllm-cached"
price = {{ prompt = 0.4, completion = 1.2, cached_prompt = 0.04 }}
"""
KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"
budget = { amount = 1000, per = "month" }
[[keys]]
name = "bob"
key = "sk-bob"
[[keys]]
name = "broke"
key = "sk-broke"
budget = { amount = 0, per = "day" }
[[keys]]
name = "racer"
key = "sk-racer"
budget = { amount = 0.05, per = "total" }
[[keys]]
name = "cent"
key = "sk-cent"
max_streams = 5
budget = { amount = 0.01, per = "day" }
"""


def write_config(tmp: Path, upstream: str | None = None) -> tuple[Path, Path]:
    routes, keys = tmp / "routes.toml", tmp / "keys.toml"
    vllm = VLLM_TARGET.format(url=upstream) if upstream else ""
    route = '[models.cached]\ntargets = ["vllm"]\n' if upstream else ""
    routes.write_text(ROUTES.format(vllm=vllm, vllm_route=route))
    keys.write_text(KEYS)
    return routes, keys


def serve(routes: Path, keys: Path, db: str, *extra: str) -> Any:
    return run_server(
        "--routes",
        str(routes),
        "--api-keys",
        str(keys),
        "--usage-db",
        db,
        "--admin-key-env",
        "LEDGER_ADMIN",
        "--rate-limit-per-s",
        "0",
        *extra,
        env={"LEDGER_ADMIN": ADMIN},
    )


def cost(
    prices: dict[str, Decimal], prompt: int, completion: int, reasoning: int = 0, cached: int = 0
) -> Decimal:
    fresh = prompt - cached
    return (
        fresh * prices["prompt"]
        + cached * prices.get("cached_prompt", prices["prompt"])
        + (completion - reasoning) * prices["completion"]
        + reasoning * prices.get("reasoning", prices["completion"])
    ) / M


def spend(server: Server, key: str) -> Decimal:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        # One currency per test (the routes file's): its series.
        if line.startswith("firsttoken_key_spend_total{") and f'key="{key}"}}' in line:
            return Decimal(line.split()[-1])
    return Decimal(0)


def usage(server: Server, **params: str) -> dict[str, Any]:
    r = httpx.get(
        server.v1 + "/usage",
        params=params,
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r.json()


def post(server: Server, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        server.v1 + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30
    )


def sse_data(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


MSG = [{"role": "user", "content": "what does a ledger hold"}]


def client_costs(server: Server, key: str, upstream: bool) -> Decimal:
    """Requests on every API, streamed and whole, spliced (a hand-off) or not, with reasoning
    and (from an OpenAI-compatible upstream) cached prompt tokens: what each client was told,
    priced as the routes file says."""
    total = Decimal(0)
    # Chat Completions, whole, with reasoning: all at the center.
    r = post(
        server,
        "/chat/completions",
        key,
        {
            "model": "plain",
            "messages": MSG,
            "max_tokens": 12,
            "synthetic": {"reasoning_tokens": 4},
        },
    )
    u = r.json()["usage"]
    reasoning = u["completion_tokens_details"]["reasoning_tokens"]
    assert reasoning == 4
    total += cost(CENTER, u["prompt_tokens"], u["completion_tokens"], reasoning)
    # Chat Completions, streamed, handed off after 5 tokens: 5 at the edge, the rest center.
    r = post(
        server,
        "/chat/completions",
        key,
        {
            "model": "chat",
            "messages": MSG,
            "max_tokens": 20,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    u = [c for c in sse_data(r.text) if c.get("usage")][-1]["usage"]
    total += cost(EDGE, u["prompt_tokens"], 5) + cost(CENTER, 0, u["completion_tokens"] - 5)
    # Responses, streamed.
    r = post(
        server,
        "/responses",
        key,
        {
            "model": "plain",
            "input": "what does a ledger hold",
            "max_output_tokens": 9,
            "stream": True,
        },
    )
    ends = ("response.completed", "response.incomplete")
    done = [e for e in sse_data(r.text) if e.get("type") in ends][-1]
    u = done["response"]["usage"]
    total += cost(CENTER, u["input_tokens"], u["output_tokens"])
    # Anthropic Messages, streamed, handed off.
    r = post(
        server,
        "/messages",
        key,
        {
            "model": "chat",
            "max_tokens": 15,
            "messages": MSG,
            "stream": True,
        },
    )
    events = sse_data(r.text)
    prompt = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    out = [e for e in events if e["type"] == "message_delta"][-1]["usage"]
    total += cost(EDGE, prompt["input_tokens"], 5) + cost(CENTER, 0, out["output_tokens"] - 5)
    # Native, cancelled after a few tokens on the slow, dear target: pays what was generated.
    r = post(server, "/streams", key, {"model": "plain", "prompt": "hello", "max_tokens": 7})
    created = r.json()
    with httpx.stream(
        "GET",
        server.url + created["events_url"],
        headers={"authorization": f"Bearer {created['resume_token']}"},
        timeout=30,
    ) as events_response:
        text = events_response.read().decode()
    meta = [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: {") and "usage" in line
    ]
    u = meta[-1]["usage"]
    total += cost(CENTER, u["prompt_tokens"], u["completion_tokens"])
    if upstream:
        r = post(server, "/chat/completions", key, {"model": "cached", "messages": MSG})
        u = r.json()["usage"]
        assert u["prompt_tokens_details"]["cached_tokens"] == 24
        total += cost(
            VLLM,
            u["prompt_tokens"],
            u["completion_tokens"],
            cached=u["prompt_tokens_details"]["cached_tokens"],
        )
        assert u["prompt_tokens"] == VLLM_CACHED_USAGE["prompt_tokens"]
    return total


@pytest.fixture
def sqlite_server(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    with scripted_upstream() as up:
        routes, keys = write_config(tmp_path, up.url)
        db = tmp_path / "usage.db"
        with serve(routes, keys, f"sqlite:///{db}") as server:
            yield server, db


def test_the_ledger_the_counter_and_the_clients_usage_agree_to_the_last_decimal(
    sqlite_server: tuple[Server, Path],
) -> None:
    server, db = sqlite_server
    expected = client_costs(server, "sk-alice", upstream=True)
    wait_for(lambda: spend(server, "alice") > 0)
    report: dict[str, Any] = {}

    def written() -> bool:
        report.update(usage(server, by="key"))
        return report["total"]["requests"] == 6

    wait_for(written, timeout=5)
    assert report["currency"] == "EUR"
    assert Decimal(report["total"]["cost"]) == expected
    assert spend(server, "alice") == expected  # a float there, exact at this size
    # The command reads the same file the same way.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "firsttoken",
            "usage",
            "--usage-db",
            f"sqlite:///{db}",
            "--format",
            "json",
            "--by",
            "target",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    by_target = json.loads(out.stdout)
    assert Decimal(by_target["total"]["cost"]) == expected
    assert {r["target"] for r in by_target["rows"]} == {"edge", "center", "vllm"}
    cached = next(r for r in by_target["rows"] if r["target"] == "vllm")
    assert cached["cached_tokens"] == 24


def test_a_key_over_its_budget_gets_429_budget_exceeded_on_every_api(
    sqlite_server: tuple[Server, Path],
) -> None:
    server, _ = sqlite_server
    for path, body in [
        ("/chat/completions", {"model": "plain", "messages": MSG}),
        ("/chat/completions", {"model": "plain", "messages": MSG, "stream": True}),
        ("/completions", {"model": "plain", "prompt": "hi"}),
        ("/responses", {"model": "plain", "input": "hi", "stream": True}),
        ("/messages", {"model": "plain", "max_tokens": 5, "messages": MSG}),
        ("/streams", {"model": "plain", "prompt": "hi"}),
    ]:
        r = post(server, path, "sk-broke", body)
        assert r.status_code == 429, (path, r.text)
        if path == "/messages":  # Anthropic's error shape has a type, not a code
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert "spent its budget" in r.json()["error"]["message"]
        else:
            assert r.json()["error"]["code"] == "budget_exceeded"
        assert 0 < int(r.headers["retry-after"]) <= 86400  # to the next UTC midnight
    assert post(
        server, "/chat/completions", "sk-bob", {"model": "plain", "messages": MSG}
    ).is_success


def test_fifty_requests_racing_for_the_last_cent_go_over_by_at_most_one_reservation(
    sqlite_server: tuple[Server, Path],
) -> None:
    server, _ = sqlite_server
    # 4 cents of the 5 spent (a cent a token): 1 cent left.
    first = post(
        server,
        "/chat/completions",
        "sk-racer",
        {
            "model": "gold",
            "messages": MSG,
            "max_tokens": 4,
        },
    )
    assert first.json()["usage"]["completion_tokens"] == 4
    wait_for(lambda: spend(server, "racer") == Decimal("0.04"))
    body = {"model": "gold", "messages": MSG, "max_tokens": 3}  # each holds 3 cents
    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        answers = list(
            pool.map(lambda _: post(server, "/chat/completions", "sk-racer", body), range(50))
        )
    codes = [a.status_code for a in answers]
    assert codes.count(200) == 1 and codes.count(429) == 49
    wait_for(lambda: spend(server, "racer") == Decimal("0.07"))
    assert spend(server, "racer") - Decimal("0.05") <= Decimal("0.03")  # one reservation


# No max_tokens, and answers of 20,000 tokens (10 a million: 0.20 each) on a key with 0.01.
OPEN_ENDED = {"model": "ten", "messages": MSG, "synthetic": {"answer_tokens": 20_000}}


def five_open_ended_answers(servers: tuple[Server, ...]) -> list[httpx.Response]:
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        return list(
            pool.map(
                lambda i: post(
                    servers[i % len(servers)], "/chat/completions", "sk-cent", OPEN_ENDED
                ),
                range(5),
            )
        )


def test_answers_that_name_no_max_tokens_stop_at_what_the_budget_buys(
    sqlite_server: tuple[Server, Path],
) -> None:
    server, _ = sqlite_server
    answers = five_open_ended_answers((server,))
    done = [a.json() for a in answers if a.status_code == 200]
    assert done, [a.text for a in answers]
    for answer in done:  # cut where the money ran out, as a max_tokens would cut it
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] < 1024
    billed = sum(
        cost(TEN, a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]) for a in done
    )
    wait_for(lambda: spend(server, "cent") == billed)
    assert billed <= Decimal("0.01")


def test_usage_needs_the_admin_key_and_checks_its_filters(
    sqlite_server: tuple[Server, Path],
) -> None:
    server, _ = sqlite_server
    # A keys file: without a key of its own (or the admin's), 401 as on every API.
    assert httpx.get(server.v1 + "/usage").status_code == 401
    # With a trailing slash too: no redirect that would tell a prober the path is there.
    for path in ("/usage/", "/admin/events/"):
        slashed = httpx.get(server.v1 + path)
        assert slashed.status_code == 404 and "location" not in slashed.headers, path
    anyone = httpx.get(server.v1 + "/usage", headers={"authorization": "Bearer sk-nobody"})
    assert anyone.status_code == 401
    bad = httpx.get(
        server.v1 + "/usage",
        params={"by": "colour"},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "by"
    assert usage(server, since="1h", by="day")["rows"] == []


def own_usage(server: Server, key: str, **params: str) -> httpx.Response:
    return httpx.get(
        server.v1 + "/usage", params=params, headers={"authorization": f"Bearer {key}"}
    )


def test_a_key_reads_its_own_usage_and_budget_and_never_anothers(
    sqlite_server: tuple[Server, Path],
) -> None:
    server, _ = sqlite_server
    for key in ("sk-alice", "sk-bob"):
        assert post(server, "/chat/completions", key, {"model": "plain", "messages": MSG})
    wait_for(lambda: usage(server)["total"]["requests"] == 2, timeout=5)
    mine = own_usage(server, "sk-alice", by="route")
    assert mine.status_code == 200, mine.text
    report = mine.json()
    assert report["key"] == "alice" and report["total"]["requests"] == 1
    assert [(r["route"], r["currency"]) for r in report["rows"]] == [("plain", "EUR")]
    spent = Decimal(report["total"]["cost"])
    assert spent > 0
    budget = report["budget"]
    assert budget["amount"] == "1000" and budget["per"] == "month"
    assert budget["currency"] == "EUR" and Decimal(budget["spent"]) == spent
    assert Decimal(budget["left"]) == 1000 - spent
    by_key = own_usage(server, "sk-bob").json()
    assert [r["key"] for r in by_key["rows"]] == ["bob"] and "budget" not in by_key
    refused = own_usage(server, "sk-alice", by="target")  # targets are the operator's
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "by"
    # The budgets as metrics: the amount and this period's spend, by key.
    metrics = server.metrics()
    assert metrics['firsttoken_key_budget_amount{key="alice",per="month"}'] == 1000
    assert Decimal(str(metrics['firsttoken_key_budget_spent{key="alice",per="month"}'])) == spent
    assert metrics['firsttoken_key_budget_amount{key="racer",per="total"}'] == 0.05
    assert 'firsttoken_key_budget_amount{key="bob",per="month"}' not in metrics


def test_the_hand_offs_prefill_is_billed_at_the_centers_prices(
    sqlite_server: tuple[Server, Path],
) -> None:
    server, _ = sqlite_server
    r = post(server, "/chat/completions", "sk-bob", {"model": "warm", "messages": MSG})
    assert r.status_code == 200, r.text
    told = r.json()["usage"]
    wait_for(lambda: usage(server)["total"]["requests"] == 1, timeout=5)
    rows = {row["target"]: row for row in usage(server, by="target")["rows"]}
    assert set(rows) == {"edge", "center"}
    center, edge = rows["center"], rows["edge"]
    # The center read the prompt once more (the prefill) and wrote one token more.
    assert center["prompt_tokens"] == edge["prompt_tokens"] == told["prompt_tokens"]
    assert edge["completion_tokens"] + center["completion_tokens"] == told["completion_tokens"] + 1
    assert Decimal(center["cost"]) == cost(
        CENTER, center["prompt_tokens"], center["completion_tokens"]
    )
    assert Decimal(usage(server)["total"]["cost"]) == Decimal(edge["cost"]) + Decimal(
        center["cost"]
    )


def test_a_budget_holds_across_a_restart_from_the_ledger(tmp_path: Path) -> None:
    routes, keys = write_config(tmp_path)
    db = f"sqlite:///{tmp_path / 'usage.db'}"
    with serve(routes, keys, db) as server:
        post(
            server,
            "/chat/completions",
            "sk-racer",
            {
                "model": "gold",
                "messages": MSG,
                "max_tokens": 6,
            },
        )
        wait_for(lambda: usage(server)["total"]["requests"] == 1)
    with serve(routes, keys, db) as again:

        def refused() -> bool:
            r = post(
                again,
                "/chat/completions",
                "sk-racer",
                {
                    "model": "gold",
                    "messages": MSG,
                    "max_tokens": 1,
                },
            )
            return r.status_code == 429

        wait_for(refused, timeout=10)  # 6 cents of 5 spent before the restart
        # What the budget's period spent, across the restart (the spend counter counts from
        # this process's start: 0 here).
        metrics = again.metrics()
        assert metrics['firsttoken_key_budget_spent{key="racer",per="total"}'] >= 0.06
        assert metrics.get('firsttoken_key_spend_total{currency="EUR",key="racer"}', 0) == 0
        mine = own_usage(again, "sk-racer").json()
        assert mine["budget"]["left"] == "0" and Decimal(mine["budget"]["spent"]) >= Decimal("0.06")


def test_a_currency_change_is_refused_while_a_key_has_a_budget_and_never_mixed(
    tmp_path: Path,
) -> None:
    routes, keys = write_config(tmp_path)
    with serve(routes, keys, f"sqlite:///{tmp_path / 'usage.db'}") as server:
        body = {"model": "plain", "messages": MSG}
        assert post(server, "/chat/completions", "sk-bob", body).is_success
        routes.write_text(routes.read_text().replace('currency = "EUR"', 'currency = "USD"'))
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: reload_said(server, "config.reload_failed"), timeout=5)
        (failed,) = reload_said(server, "config.reload_failed")
        assert "currency: EUR -> USD while key 'alice' has a budget" in failed["error"]
        assert usage(server)["currency"] == "EUR"  # nothing changed
        keys.write_text('[[keys]]\nname = "bob"\nkey = "sk-bob"\n')  # no budget left
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: reload_said(server, "config.reloaded"), timeout=5)
        assert post(server, "/chat/completions", "sk-bob", body).is_success
        wait_for(lambda: len(usage(server)["totals"]) == 2, timeout=5)
        report = usage(server)
        assert report["currency"] == "USD"
        assert [(r["key"], r["currency"], r["requests"]) for r in report["rows"]] == [
            ("bob", "EUR", 1),
            ("bob", "USD", 1),
        ]
        assert report["total"]["requests"] == 1  # in USD: the euros are not added in
        assert [t["currency"] for t in report["totals"]] == ["EUR", "USD"]
        metrics = server.metrics()
        assert metrics['firsttoken_key_spend_total{currency="EUR",key="bob"}'] > 0
        assert metrics['firsttoken_key_spend_total{currency="USD",key="bob"}'] > 0


def reload_said(server: Server, event: str) -> list[dict[str, Any]]:
    return [r for r in server.log_records() if r.get("event") == event]


def test_without_a_usage_db_the_start_line_says_budgets_reset(tmp_path: Path) -> None:
    routes, keys = write_config(tmp_path)
    with run_server("--routes", str(routes), "--api-keys", str(keys)) as server:
        line = next(r for r in server.log_records() if r.get("event") == "listening")
        assert line["usage_db"] == "memory" and "budgets reset on restart" in line["note"]


def test_two_instances_write_one_postgresql_ledger_and_survive_it_stopping(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    routes, keys = write_config(tmp_path)
    db = postgres.new_database()
    with serve(routes, keys, db) as one, serve(routes, keys, db) as two:
        expected = client_costs(one, "sk-alice", upstream=False)
        expected += client_costs(two, "sk-alice", upstream=False)
        wait_for(lambda: usage(one)["total"]["requests"] == 10, timeout=10)
        assert Decimal(usage(two)["total"]["cost"]) == expected
        assert spend(one, "alice") + spend(two, "alice") == expected
        postgres.stop()
        try:
            failed = 0
            for _ in range(10):
                r = post(
                    one,
                    "/chat/completions",
                    "sk-bob",
                    {
                        "model": "plain",
                        "messages": MSG,
                        "max_tokens": 3,
                        "stream": True,
                    },
                )
                failed += r.status_code != 200 or "data: [DONE]" not in r.text
            assert failed == 0
            # Streams go on, but the instance says its ledger is away: ready, degraded.
            wait_for(lambda: one.metric("firsttoken_usage_db_up", 1.0) == 0.0, timeout=10)
            ready = httpx.get(one.url + "/readyz")
            assert ready.status_code == 200 and ready.json()["degraded"] == ["ledger"]
        finally:
            postgres.start()
        wait_for(lambda: usage(one)["total"]["requests"] == 20, timeout=15)
        assert httpx.get(one.url + "/readyz").json()["status"] == "ready"


def test_two_instances_on_one_redis_share_the_budget_racing_for_the_last_cent(
    tmp_path: Path,
) -> None:
    from tests.redis_server import run_redis

    routes, keys = write_config(tmp_path)
    with run_redis() as redis:
        shared = ("--redis", redis)
        db = f"sqlite:///{tmp_path / 'usage.db'}"
        with serve(routes, keys, db, *shared) as one, serve(routes, keys, db, *shared) as two:
            post(
                one,
                "/chat/completions",
                "sk-racer",
                {
                    "model": "gold",
                    "messages": MSG,
                    "max_tokens": 4,
                },
            )
            wait_for(lambda: spend(one, "racer") == Decimal("0.04"))
            body = {"model": "gold", "messages": MSG, "max_tokens": 3}
            with concurrent.futures.ThreadPoolExecutor(50) as pool:
                answers = list(
                    pool.map(
                        lambda i: post((one, two)[i % 2], "/chat/completions", "sk-racer", body),
                        range(50),
                    )
                )
            codes = [a.status_code for a in answers]
            assert codes.count(200) == 1 and codes.count(429) == 49
            total = lambda: spend(one, "racer") + spend(two, "racer")  # noqa: E731
            wait_for(lambda: total() == Decimal("0.07"))
            # Each instance's budget gauge reads the fleet's count from Redis (every 5 s).
            racer = 'firsttoken_key_budget_spent{key="racer",per="total"}'
            for server in (one, two):
                wait_for(lambda s=server: s.metrics()[racer] == 0.07, timeout=8)  # type: ignore[misc]
            # Open-ended answers on both: capped by one shared budget (Redis's script).
            answers = five_open_ended_answers((one, two))
            done = [a.json()["usage"] for a in answers if a.status_code == 200]
            assert done and all(u["completion_tokens"] < 1024 for u in done)
            billed = sum(cost(TEN, u["prompt_tokens"], u["completion_tokens"]) for u in done)
            cents = lambda: spend(one, "cent") + spend(two, "cent")  # noqa: E731
            wait_for(lambda: cents() == billed)
            assert billed <= Decimal("0.01")


def test_prompt_cache_reads_and_writes_are_priced_as_such_and_shown_on_every_api(
    tmp_path: Path,
) -> None:
    from tests.cache_upstreams import CACHED, PROMPT, WRITTEN, cache_upstreams

    with cache_upstreams() as up:
        routes = tmp_path / "routes.toml"
        routes.write_text(
            f"""
[targets.claude]
kind = "anthropic"
url = "{up.url}/v1"
model = "claude-x"
price = {{ prompt = 3, completion = 15, cached_prompt = 0.30, cache_write = 3.75 }}
[targets.oai]
kind = "openai"
url = "{up.url}/v1"
model = "cached"
price = {{ prompt = 1.25, completion = 10, cached_prompt = 0.125 }}
[models.claude]
targets = ["claude"]
[models.oai]
targets = ["oai"]
"""
        )
        keys = tmp_path / "keys.toml"
        keys.write_text(KEYS)
        with serve(routes, keys, f"sqlite:///{tmp_path / 'u.db'}") as server:
            marker = {"type": "ephemeral"}
            r = post(
                server,
                "/messages",
                "sk-bob",
                {
                    "model": "claude",
                    "max_tokens": 5,
                    "system": [
                        {"type": "text", "text": "a long system prompt", "cache_control": marker}
                    ],
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "a long document", "cache_control": marker}
                            ],
                        }
                    ],
                },
            )
            assert r.status_code == 200, r.text
            assert up.bodies[-1]["system"][0]["cache_control"] == marker
            assert up.bodies[-1]["messages"][0]["content"][0]["cache_control"] == marker
            u = r.json()["usage"]
            assert u == {
                "input_tokens": PROMPT - CACHED - WRITTEN,
                "cache_creation_input_tokens": WRITTEN,
                "cache_read_input_tokens": CACHED,
                "output_tokens": 5,
            }
            claude = (
                u["input_tokens"] * Decimal(3)
                + u["cache_read_input_tokens"] * Decimal("0.30")
                + u["cache_creation_input_tokens"] * Decimal("3.75")
                + u["output_tokens"] * Decimal(15)
            ) / M
            # The same upstream through Chat Completions and Responses shows them too.
            chat = post(
                server,
                "/chat/completions",
                "sk-bob",
                {
                    "model": "claude",
                    "messages": MSG,
                    "max_tokens": 5,
                },
            ).json()["usage"]
            assert chat["prompt_tokens"] == PROMPT
            assert chat["prompt_tokens_details"] == {
                "cached_tokens": CACHED,
                "cache_write_tokens": WRITTEN,
            }
            responses = post(
                server,
                "/responses",
                "sk-bob",
                {
                    "model": "claude",
                    "input": "hi",
                    "max_output_tokens": 5,
                },
            ).json()["usage"]
            assert responses["input_tokens_details"] == {
                "cached_tokens": CACHED,
                "cache_write_tokens": WRITTEN,
            }
            oai = post(
                server,
                "/chat/completions",
                "sk-bob",
                {
                    "model": "oai",
                    "messages": MSG,
                    "max_tokens": 7,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            ou = [c for c in sse_data(oai.text) if c.get("usage")][-1]["usage"]
            assert ou["prompt_tokens_details"]["cached_tokens"] == CACHED
            openai_cost = (
                (PROMPT - CACHED) * Decimal("1.25")
                + CACHED * Decimal("0.125")
                + ou["completion_tokens"] * Decimal(10)
            ) / M
            expected = 3 * claude + openai_cost
            wait_for(lambda: usage(server)["total"]["requests"] == 4)
            assert Decimal(usage(server)["total"]["cost"]) == expected
            assert spend(server, "bob") == expected


def test_an_open_server_with_a_usage_db_records_every_request(tmp_path: Path) -> None:
    routes, _ = write_config(tmp_path)
    db = tmp_path / "usage.db"
    with run_server(
        "--routes",
        str(routes),
        "--usage-db",
        f"sqlite:///{db}",
        "--admin-key-env",
        "LEDGER_ADMIN",
        env={"LEDGER_ADMIN": ADMIN},
    ) as server:
        r = httpx.post(
            server.v1 + "/chat/completions",
            json={
                "model": "plain",
                "messages": MSG,
                "max_tokens": 3,
            },
            timeout=30,
        )
        u = r.json()["usage"]
        wait_for(lambda: usage(server)["total"]["requests"] == 1)
        row = usage(server)["rows"][0]
        assert row["key"] == "open" and row["completion_tokens"] == u["completion_tokens"]
        assert Decimal(row["cost"]) == cost(CENTER, u["prompt_tokens"], u["completion_tokens"])
        assert spend(server, "open") == Decimal(row["cost"])


def test_with_redis_away_budgets_are_still_enforced_by_each_instance(tmp_path: Path) -> None:
    from tests.redis_server import redis_server

    routes, keys = write_config(tmp_path)
    with redis_server() as redis:
        db = f"sqlite:///{tmp_path / 'usage.db'}"
        with serve(routes, keys, db, "--redis", redis.url) as server:
            redis.stop()
            try:
                body = {"model": "gold", "messages": MSG, "max_tokens": 6}
                first = post(server, "/chat/completions", "sk-racer", body)
                assert first.status_code == 200  # held and settled in this instance
                wait_for(lambda: spend(server, "racer") == Decimal("0.06"))
                again = post(server, "/chat/completions", "sk-racer", body)
                assert again.status_code == 429, again.text  # 6 cents of 5: refused here too
                assert again.json()["error"]["code"] == "budget_exceeded"
            finally:
                redis.start()


@pytest.mark.parametrize(
    "db",
    ["sqlite:///no/such/directory/ledger.db", "postgresql://u@127.0.0.1:1/db?password=hunter2"],
)
def test_a_ledger_that_cannot_open_stops_the_start_in_one_line(tmp_path: Path, db: str) -> None:
    routes, keys = write_config(tmp_path)
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "firsttoken",
            "serve",
            "--port",
            "0",
            "--usage-db",
            db,
            "--routes",
            str(routes),
            "--api-keys",
            str(keys),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    out = started.stdout + started.stderr
    assert started.returncode == 1 and '"listening"' not in out, out
    (line,) = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert line["event"] == "startup.failed" and "the ledger did not open" in line["error"]
    assert "hunter2" not in out and "Traceback" not in out
    if db.startswith("sqlite"):  # the path as SQLAlchemy's rule resolves it, and the rule
        assert f"no directory {tmp_path / 'no/such/directory'}" in line["error"]
        assert "sqlite:////" in line["error"]
