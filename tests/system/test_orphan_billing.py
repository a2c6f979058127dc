"""Money of a dead instance's streams that nobody took over (Redis mode): real instances on
one real redis-server, each with its own SQLite ledger. An OpenAI SDK stream's connection dies
with its SIGKILLed instance and the SDK never resumes: a survivor sweeps the dead instance's
streams and bills what their clients received (`--durable`: exactly what Redis holds), once.
A native stream resumed elsewhere within its grace is still taken over and billed once; one
whose reader comes back only after the sweep is told `stream_lost`, and billed what it got.
"""

from __future__ import annotations

import sqlite3
import time
from collections import defaultdict
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest
import redis

from firsttoken.resume.redis_keys import events_key, meta_key, owned_key, tag_of
from firsttoken.resume.runs import encode_run
from firsttoken.resume.sweeper import SWEEP
from firsttoken.resume.takeover import CLAIM
from tests.rawhttp import RawStream
from tests.redis_server import run_redis
from tests.servers import wait_for
from tests.system.test_takeover import native, read_to_end, read_until, resume
from tests.system.test_takeover_billing import COMPLETION, PROMPT, M, instance

KEY = "sk-ops-new"
# Tokens that may be in flight to a reader when its instance is SIGKILLed: a flush's worth
# (50 ms at the route's 8 ms a token) confirmed or written and not yet read, and what a reset
# drops from a socket its client had not read.
IN_FLIGHT = 12


@pytest.fixture
def redis_url() -> Iterator[str]:
    with run_redis() as url:
        yield url


def records(*dbs: Path) -> dict[str, list[tuple[str, int, int, Decimal]]]:
    """Every instance's ledger records by stream id (a taken-over part is `<id>:<suffix>`):
    (outcome, prompt tokens, completion tokens, cost)."""
    out: dict[str, list[tuple[str, int, int, Decimal]]] = defaultdict(list)
    for db in dbs:
        if not db.exists():
            continue
        with sqlite3.connect(db) as conn:
            rows = conn.execute(
                "SELECT request_id, outcome, prompt_tokens, completion_tokens, cost_picos "
                "FROM usage_requests"
            ).fetchall()
            targets = {t for (t,) in conn.execute("SELECT target FROM usage_legs")}
        assert targets <= {"edge"}, targets  # priced at the route's target
        for request_id, outcome, p, c, cost in rows:
            out[request_id.split(":")[0]].append((outcome, p, c, Decimal(cost) / 10**12))
    return out


def start_native(server: object, prompt: str) -> dict:
    r = httpx.post(
        server.v1 + "/streams",  # type: ignore[attr-defined]
        json={"model": "chat", "prompt": prompt, "max_tokens": 300},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
    )
    assert r.status_code == 201, r.text
    return r.json()


def test_a_dead_instances_sdk_stream_is_billed_what_its_client_received(
    redis_url: str, tmp_path: Path
) -> None:
    a_run, a_db = instance(tmp_path, redis_url, "a")
    b_run, b_db = instance(tmp_path, redis_url, "b")
    with a_run as a, b_run as b:  # type: ignore[attr-defined]
        resumed = start_native(a, "resumed within its grace")
        late = start_native(a, "resumed after the sweep")
        readers = [RawStream(a.port, "GET", c["events_url"]) for c in (resumed, late)]
        client = openai.OpenAI(base_url=a.v1, api_key=KEY, max_retries=0, timeout=20)
        chat = client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "an SDK stream its instance dies under"}],
            max_tokens=300,
            stream=True,
        )
        received = 0  # the synthetic engine sends one token a chunk
        chunks = iter(chat)
        while received < 30:
            chunk = next(chunks)
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
        for r in readers:
            read_until(r, 10)
        a.kill()
        try:
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    received += 1
        except openai.APIError:
            pass  # its connection died with its instance
        for r in readers:
            read_to_end(r)
        got = [native(r.body) for r in readers]
        # Resumed on the survivor within its grace: taken over, finished, billed once whole.
        body, _ = resume(b, resumed, got[0]["last_id"])
        after = native(body)
        assert after["done"] == 1, after["error"]
        told = [m for m in after["meta"] if "usage" in m][-1]["usage"]
        # The sweep comes once the dead instance's key is gone (~3 s) and the grace (5 s)
        # passed: the SDK's stream and the late one are billed then.
        wait_for(lambda: len(records(a_db, b_db)) == 3, timeout=20)
        time.sleep(0.5)  # nothing more comes
        billed = records(a_db, b_db)
        print(f"received {received}; ledgers: {dict(billed)}")
        assert billed.pop(resumed["id"]) == [
            (
                "completed",
                told["prompt_tokens"],
                told["completion_tokens"],
                (told["prompt_tokens"] * PROMPT + told["completion_tokens"] * COMPLETION) / M,
            )
        ]
        # Billed what Redis holds: never less than a reader received (`--durable`), and more
        # only by the events in flight to it when A died (docs/reliability.md).
        ((outcome, prompt, completion, cost),) = billed.pop(late["id"])
        assert outcome == "orphaned"
        assert len(got[1]["tokens"]) <= completion <= len(got[1]["tokens"]) + IN_FLIGHT
        assert prompt > 0 and cost == (prompt * PROMPT + completion * COMPLETION) / M
        ((outcome, prompt, completion, cost),) = [v[0] for v in billed.values()]
        assert outcome == "orphaned" and received <= completion <= received + IN_FLIGHT
        assert prompt > 0 and cost == (prompt * PROMPT + completion * COMPLETION) / M
        assert b.metric("firsttoken_redis_orphans_swept_total") == 2
        # The late reader is told its stream is gone, and nothing is billed twice.
        body, _ = resume(b, late, got[1]["last_id"])
        after = native(body)
        assert after["done"] == 0 and after["error"]["code"] == "stream_lost", after
        time.sleep(0.5)
        assert sum(len(v) for v in records(a_db, b_db).values()) == 3


def test_a_sweep_and_a_claim_take_a_dead_owners_stream_once(redis_url: str) -> None:
    """The sweep's Lua call and the takeover's claim against one real Redis: whichever comes
    first has the stream; the other finds it ended (swept) or moved (claimed)."""
    r = redis.Redis.from_url(redis_url)
    meta, events = meta_key("s1"), events_key("s1")
    owned = owned_key(tag_of(meta), "dead")
    sweep, claim = r.register_script(SWEEP), r.register_script(CLAIM)

    def dead_owners_stream() -> None:
        r.delete(meta, events, owned)
        r.hset(
            meta, mapping={"owner": "dead", "fence": 1, "takeover": 1, "req": "{}", "trace": "t"}
        )
        r.sadd(owned, "s1")
        r.xadd(events, encode_run(1, [b"a", b"b"], {}), id="2-0")

    dead_owners_stream()
    assert sweep(keys=[meta, events, owned], args=["dead", "me", 60, "s1"]) == [
        b"swept",
        b"{}",
        b"",
        b"t",
    ]
    assert r.xrange(events)[-1] == (b"2-1", {b"end": b"orphaned"})
    assert r.hget(meta, "fence") == b"2" and not r.hexists(meta, "req")  # nothing to go on
    assert not r.sismember(owned, "s1") and 0 < r.ttl(meta) <= 60
    assert sweep(keys=[meta, events, owned], args=["dead", "me", 60, "s1"]) == [b"ended"]
    assert claim(keys=[meta], args=["dead", "other"]) == [b"ended"]

    dead_owners_stream()
    assert claim(keys=[meta], args=["dead", "other"])[0] == b"claimed"
    assert r.sismember(owned_key(tag_of(meta), "other"), "s1")  # the new owner's to sweep
    assert sweep(keys=[meta, events, owned], args=["dead", "me", 60, "s1"]) == [b"moved"]
    assert not r.sismember(owned, "s1") and not r.hexists(meta, "outcome")
