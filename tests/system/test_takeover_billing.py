"""Money across a takeover (Redis mode): real instances on one real redis-server, each with its
own SQLite ledger, a priced route and a key with a money budget. Whether the owner is SIGKILLed
(it never writes its record) or SIGTERMed (it hands over, recording its part), the ledgers of
all instances together bill exactly what the client was told in `usage`, at the route's
target's prices, and the key's budget counts the whole answer. A stream goes on after a
takeover only under the secret it was started with (`test_a_rotated_out_secrets_stream...`).
"""

from __future__ import annotations

import signal
import sqlite3
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from tests.rawhttp import RawStream
from tests.redis_server import run_redis
from tests.servers import Server, run_server, wait_for
from tests.system.test_takeover import native, read_to_end, read_until, resume

M = Decimal(10**6)
PROMPT, COMPLETION = Decimal("0.5"), Decimal(50)  # per million: 300 tokens are $0.015
ROUTES = """
[targets.edge]
kind = "synthetic"
ttft_ms = 20
itl_ms = 8
price = { prompt = 0.5, completion = 50 }
[models.chat]
targets = ["edge"]
"""
KEYS = """
[[keys]]
name = "erin"
key = "sk-erin"
budget = { amount = 0.01, per = "day" }
[[keys]]
name = "ops"
key = "sk-ops-new"
[[keys]]
name = "ops"
key = "sk-ops-old"
"""
ANSWER = 300


@pytest.fixture
def redis_url() -> Iterator[str]:
    with run_redis() as url:
        yield url


def instance(tmp: Path, url: str, name: str, keys: str = KEYS) -> tuple[object, Path]:
    routes, keyfile, db = tmp / "routes.toml", tmp / f"keys-{name}.toml", tmp / f"{name}.db"
    routes.write_text(ROUTES)
    keyfile.write_text(keys)
    server = run_server(
        "--redis",
        url,
        "--durable",
        "--routes",
        str(routes),
        "--api-keys",
        str(keyfile),
        "--usage-db",
        f"sqlite:///{db}",
        "--rate-limit-per-s",
        "0",
        "--resume-grace-s",
        "5",
    )
    return server, db


def billed(*dbs: Path) -> tuple[int, int, Decimal, list[str]]:
    """The ledgers' prompt and completion tokens, cost and outcomes, all instances together."""
    prompt = completion = picos = 0
    outcomes: list[str] = []
    for db in dbs:
        if not db.exists():
            continue
        with sqlite3.connect(db) as conn:
            rows = conn.execute(
                "SELECT prompt_tokens, completion_tokens, cost_picos, outcome FROM usage_requests"
            ).fetchall()
            targets = {t for (t,) in conn.execute("SELECT target FROM usage_legs")}
        assert targets <= {"edge"}, targets  # priced at the route's target, never at ""
        for p, c, cost, outcome in rows:
            prompt, completion, picos = prompt + p, completion + c, picos + cost
            outcomes.append(outcome)
    return prompt, completion, Decimal(picos) / 10**12, sorted(outcomes)


def start(server: Server, key: str, prompt: str) -> dict:
    body = {"model": "chat", "prompt": prompt, "max_tokens": ANSWER}
    r = httpx.post(
        server.v1 + "/streams", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    assert r.status_code == 201, r.text
    return r.json()


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_a_taken_over_answer_is_billed_once_whole_at_its_targets_price(
    redis_url: str, tmp_path: Path, how: str
) -> None:
    a_run, a_db = instance(tmp_path, redis_url, "a")
    b_run, b_db = instance(tmp_path, redis_url, "b")
    with a_run as a, b_run as b:  # type: ignore[attr-defined]
        created = start(a, "sk-erin", "bill me once")
        stream = RawStream(a.port, "GET", created["events_url"])
        read_until(stream, 20)
        if how == "sigkill":
            a.kill()
        else:
            a.proc.send_signal(signal.SIGTERM)
            a.proc.wait(timeout=10)
        read_to_end(stream)
        before = native(stream.body)
        body, _ = resume(b, created, before["last_id"])
        after = native(body)
        assert after["done"] == 1, after["error"]
        told = [m for m in after["meta"] if "usage" in m][-1]["usage"]
        tokens = told["completion_tokens"]  # the synthetic answer may stop before max_tokens
        assert len(before["tokens"]) + len(after["tokens"]) == tokens > 200
        expected = (told["prompt_tokens"] * PROMPT + tokens * COMPLETION) / M
        wait_for(lambda: billed(a_db, b_db)[1] >= tokens, timeout=10)
        prompt, completion, cost, outcomes = billed(a_db, b_db)
        print(f"{how}: billed {prompt} + {completion} tokens, {cost} ({outcomes})")
        assert (prompt, completion, cost) == (told["prompt_tokens"], tokens, expected)
        assert outcomes == (["completed"] if how == "sigkill" else ["completed", "moved"])
        # Over $0.014 of a $0.01 budget spent: the key's next request is refused.
        again = httpx.post(
            b.v1 + "/streams",
            json={"model": "chat", "prompt": "more", "max_tokens": 5},
            headers={"Authorization": "Bearer sk-erin"},
            timeout=10,
        )
        assert again.status_code == 429 and again.json()["error"]["code"] == "budget_exceeded"


def test_a_rotated_out_secrets_stream_is_not_taken_over(redis_url: str, tmp_path: Path) -> None:
    """During a rotation (two secrets under one name) a stream started with the old one, handed
    over by SIGTERM, ends where the old secret is gone, as it would on its owner."""
    rotated = KEYS.replace('[[keys]]\nname = "ops"\nkey = "sk-ops-old"\n', "")
    a_run, _ = instance(tmp_path, redis_url, "a")
    b_run, _ = instance(tmp_path, redis_url, "b", keys=rotated)
    with a_run as a, b_run as b:  # type: ignore[attr-defined]
        created = start(a, "sk-ops-old", "rotated out")
        stream = RawStream(a.port, "GET", created["events_url"])
        read_until(stream, 10)
        a.proc.send_signal(signal.SIGTERM)
        a.proc.wait(timeout=10)
        read_to_end(stream)
        body, _ = resume(b, created, native(stream.body)["last_id"])
        after = native(body)
        assert after["done"] == 0 and after["error"]["code"] == "stream_lost"
        assert "key" in after["error"]["message"] and len(after["tokens"]) < ANSWER
        assert b.metric('firsttoken_takeovers_total{outcome="refused"}') == 1
