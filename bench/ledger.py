"""What every answer cost: the usage ledger under a mixed load, in SQLite and PostgreSQL.

    .venv/bin/python -m bench.ledger                       # 10,000 requests; all phases
    .venv/bin/python -m bench.ledger --requests 2000 --streams 200 --outage-s 10   # smaller
    .venv/bin/python -m bench.ledger --phases mixed --db sqlite                      # one part

Three phases, each against real processes on loopback (the gateway, two firsttoken upstreams
as OpenAI-compatible targets, one of them failing 30% of its streams mid-answer, and
tests/cache_upstreams.py as an Anthropic and an OpenAI-compatible upstream that report
prompt-cache tokens; a real PostgreSQL from tests/postgres_server.py):

mixed     `--requests` requests, `--concurrency` at once, over all four APIs (Chat Completions
          and legacy Completions, Responses, Anthropic Messages, native streams), streamed and
          whole: a plain route (reasoning tokens at their own price), a hand-off (edge, then
          center, each at its own price), splices (a target that cuts 30% of its answers,
          continued on another), prompt-cache reads and writes from both upstream formats, and
          native streams cancelled after a few tokens. Each client prices the usage it was
          told with the routes file's prices (Decimal, independently of the gateway's code) and
          the bench compares that, request by request (the X-Stream-Id), with the ledger's
          record; and the ledger's total with the instances' `firsttoken_key_spend_total`.
          Once with SQLite and one instance, once with PostgreSQL and two instances writing.
overhead  `--streams` streams at once against a gateway with --usage-db (SQLite) and one without
          (records in memory only), interleaved, the same requests: the gateway's tokens per
          CPU-second and the clients' TTFT p50 in each.
outage    two instances on PostgreSQL under a steady load; PostgreSQL stopped for `--outage-s`
          seconds and started again: streams that failed (must be 0) and records lost (the
          ledger's count against the requests the gateway answered, must be 0).
takeover  three instances with --redis --durable on one redis-server, each with its own SQLite
          ledger, `--takeover-streams` native streams on a priced route spread over them; one
          instance SIGKILLed and one SIGTERMed mid-answer, their readers coming back with
          Last-Event-ID on the third, which takes the streams over. Every stream's usage as its
          client was told it against the records of all three ledgers together (the owner's,
          `moved`, and the taker's, `<id>:<suffix>`): unbilled and overbilled tokens (must be
          0), and the cost at the route's price (must be exact).

Prints one JSON object (and a short summary on stderr). The machine's CPU may be shared: the
overhead phase compares rounds run back to back, in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import psutil

from firsttoken.formats.sse import EventDecoder
from tests.cache_upstreams import cache_upstreams
from tests.postgres_server import PostgresServer, postgres_server
from tests.servers import Server, run_server

M = Decimal(10**6)
KEY = "sk-bench"
# Per million tokens: the routes file's and the bench's own copy (the check is independent).
PRICES: dict[str, dict[str, Decimal]] = {
    "edge": {"prompt": Decimal("0.1"), "completion": Decimal("0.2")},
    "center": {"prompt": Decimal("0.5"), "completion": Decimal("1.5"), "reasoning": Decimal("3")},
    "cut": {"prompt": Decimal("0.8"), "completion": Decimal("2.4")},
    "mend": {"prompt": Decimal("0.8"), "completion": Decimal("2.4")},
    "claude": {
        "prompt": Decimal("3"),
        "completion": Decimal("15"),
        "cached_prompt": Decimal("0.3"),
        "cache_write": Decimal("3.75"),
    },
    "oai": {
        "prompt": Decimal("1.25"),
        "completion": Decimal("10"),
        "cached_prompt": Decimal("0.125"),
    },
}
HANDOFF_AFTER = 5
# Load the bench makes on purpose: no rate limit, no shedding on TTFT, no breaker.
OPEN = ("--rate-limit-per-s", "0", "--ttft-slo-ms", "0", "--breaker-error-rate", "1")
ERRORS: Counter[tuple[Any, ...]] = Counter()  # what the clients told no usage were told


def routes_toml(cut_url: str, mend_url: str, cache_url: str) -> str:
    def price(name: str) -> str:
        return "{ " + ", ".join(f"{k} = {v}" for k, v in PRICES[name].items()) + " }"

    return f"""
currency = "USD"
[targets.edge]
kind = "synthetic"
ttft_ms = 5
itl_ms = 1
price = {price("edge")}
[targets.center]
kind = "synthetic"
ttft_ms = 10
itl_ms = 2
price = {price("center")}
[targets.cut]
kind = "openai"
url = "{cut_url}/v1"
model = "synthetic"
continuation = "vllm"
eject_after = 1000000
price = {price("cut")}
[targets.mend]
kind = "openai"
url = "{mend_url}/v1"
model = "synthetic"
continuation = "vllm"
price = {price("mend")}
[targets.claude]
kind = "anthropic"
url = "{cache_url}/v1"
model = "claude-x"
price = {price("claude")}
[targets.oai]
kind = "openai"
url = "{cache_url}/v1"
model = "cached"
price = {price("oai")}
[models.plain]
targets = ["center"]
[models.handoff]
targets = ["center"]
handoff = {{ from = "edge", after_tokens = {HANDOFF_AFTER}, prefill = false, pace_ms = 0 }}
[models.splice]
targets = ["cut", "mend"]
max_splices = 3
hedge = false
[models.claude]
targets = ["claude"]
[models.oai]
targets = ["oai"]
"""


KEYS = (
    f'[[keys]]\nname = "bench"\nkey = "{KEY}"\nmax_streams = 100000\n'
    'budget = { amount = 1000000, per = "day" }\n'
)


# -- pricing what a client was told ----------------------------------------------------------------


@dataclass
class Told:
    """The usage one client received, in one shape whatever the API."""

    prompt: int
    completion: int
    reasoning: int = 0
    cached: int = 0
    written: int = 0


def _price(
    target: str, prompt: int, cached: int, written: int, answer: int, reasoning: int
) -> Decimal:
    p = PRICES[target]
    return (
        (prompt - cached - written) * p["prompt"]
        + cached * p.get("cached_prompt", p["prompt"])
        + written * p.get("cache_write", p["prompt"])
        + (answer - reasoning) * p["completion"]
        + reasoning * p.get("reasoning", p["completion"])
    ) / M


def priced(route: str, told: Told) -> Decimal:
    """What `told` costs on `route`, as the routes file's prices say."""
    if route == "handoff":
        first = min(HANDOFF_AFTER, told.completion)
        return _price("edge", told.prompt, 0, 0, first, 0) + _price(
            "center", 0, 0, 0, told.completion - first, 0
        )
    target = {"plain": "center", "splice": "cut"}.get(route, route)  # cut and mend: one price
    return _price(target, told.prompt, told.cached, told.written, told.completion, told.reasoning)


def chat_told(u: dict[str, Any]) -> Told:
    details = u.get("prompt_tokens_details") or {}
    return Told(
        u["prompt_tokens"],
        u["completion_tokens"],
        (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0),
        details.get("cached_tokens", 0),
        details.get("cache_write_tokens", 0),
    )


def responses_told(u: dict[str, Any]) -> Told:
    details = u.get("input_tokens_details") or {}
    return Told(
        u["input_tokens"],
        u["output_tokens"],
        (u.get("output_tokens_details") or {}).get("reasoning_tokens", 0),
        details.get("cached_tokens", 0),
        details.get("cache_write_tokens", 0),
    )


def messages_told(u: dict[str, Any]) -> Told:
    read = u.get("cache_read_input_tokens", 0)
    written = u.get("cache_creation_input_tokens", 0)
    return Told(u["input_tokens"] + read + written, u["output_tokens"], 0, read, written)


def _events(text: str) -> list[tuple[str | None, Any]]:
    out: list[tuple[str | None, Any]] = []
    event: str | None = None
    for line in text.splitlines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            out.append((event, json.loads(line[6:])))
            event = None
        elif not line:
            event = None
    return out


# -- the mixed load --------------------------------------------------------------------------------


@dataclass
class Result:
    stream_id: str | None
    route: str
    api: str
    told: Told | None  # None: the client was told no usage (an error, a cancel)
    outcome: str  # completed | error | cancelled | refused


@dataclass
class Plan:
    api: str
    route: str
    stream: bool
    max_tokens: int
    reasoning: int = 0
    cancel: bool = False


def plans(n: int, seed: int = 40) -> list[Plan]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        api = rng.choice(("chat", "completions", "responses", "messages", "native"))
        route = rng.choice(("plain", "plain", "handoff", "splice", "splice", "claude", "oai"))
        stream = api == "native" or rng.random() < 0.7
        reasoning = 3 if route == "plain" and api in ("chat", "responses", "native") else 0
        if route in ("claude", "oai") and api in ("completions", "native"):
            api = "chat"  # the cache upstreams speak chat and messages
        cancel = api == "native" and rng.random() < 0.3
        # A cancelled stream is a long one: the cancel lands well before its end.
        limit = 300 if cancel else rng.randrange(8, 40)
        out.append(Plan(api, route, stream, limit, reasoning, cancel))
    return out


async def one(client: httpx.AsyncClient, base: str, plan: Plan) -> Result:
    headers = {"authorization": f"Bearer {KEY}"}
    synthetic = {"reasoning_tokens": plan.reasoning} if plan.reasoning else None
    text = "what does a ledger hold, and why"
    if plan.api == "native":
        body: dict[str, Any] = {"model": plan.route, "prompt": text, "max_tokens": plan.max_tokens}
        if synthetic:
            body["synthetic"] = synthetic
        r = await client.post(base + "/v1/streams", json=body, headers=headers)
        if r.status_code != 201:
            ERRORS[(plan.api, plan.route, r.status_code, r.text[-160:])] += 1
            return Result(None, plan.route, plan.api, None, "refused")
        created = r.json()
        sid = created["id"]
        auth = {"authorization": f"Bearer {created['resume_token']}"}
        seen = 0
        told = None
        outcome = "error"
        last = ""
        async with client.stream("GET", base + created["events_url"], headers=auth) as events:
            event = None
            async for line in events.aiter_lines():
                last = line or last
                if line.startswith("event: "):
                    event = line[7:]
                    continue
                if line.startswith("data: {") and event is None:
                    seen += 1
                    if plan.cancel and seen == 3:
                        await client.post(base + f"/v1/streams/{sid}/cancel", headers=auth)
                        outcome = "cancelled"
                if line.startswith("data: ") and event == "meta":
                    meta = json.loads(line[6:])
                    if "usage" in meta:
                        told, outcome = chat_told(meta["usage"]), "completed"
                if not line:
                    event = None
        if outcome == "error":
            ERRORS[(plan.api, plan.route, plan.cancel, last[-160:])] += 1
        return Result(sid, plan.route, plan.api, told, outcome)
    if plan.api in ("chat", "completions"):
        path = "/v1/chat/completions" if plan.api == "chat" else "/v1/completions"
        body = {"model": plan.route, "max_tokens": plan.max_tokens, "stream": plan.stream}
        if plan.api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if plan.stream:
            body["stream_options"] = {"include_usage": True}
    elif plan.api == "responses":
        path = "/v1/responses"
        body = {
            "model": plan.route,
            "input": text,
            "max_output_tokens": plan.max_tokens,
            "stream": plan.stream,
        }
    else:
        path = "/v1/messages"
        body = {
            "model": plan.route,
            "max_tokens": plan.max_tokens,
            "stream": plan.stream,
            "messages": [{"role": "user", "content": text}],
        }
    if synthetic:
        body["synthetic"] = synthetic
    r = await client.post(base + path, json=body, headers=headers)
    sid = r.headers.get("x-stream-id")
    if r.status_code != 200:
        ERRORS[(plan.api, plan.route, r.status_code, r.text[-160:])] += 1
        return Result(sid, plan.route, plan.api, None, "refused")
    told = None
    if not plan.stream:
        data = r.json()
        u = data.get("usage")
        if u:
            told = {
                "chat": chat_told,
                "completions": chat_told,
                "responses": responses_told,
                "messages": messages_told,
            }[plan.api](u)
    else:
        events = _events(r.text)
        if plan.api in ("chat", "completions"):
            usages = [d["usage"] for _, d in events if d.get("usage")]
            told = chat_told(usages[-1]) if usages and "data: [DONE]" in r.text else None
        elif plan.api == "responses":
            ends = [d for e, d in events if e in ("response.completed", "response.incomplete")]
            told = responses_told(ends[-1]["response"]["usage"]) if ends else None
        else:
            deltas = [d["usage"] for e, d in events if e == "message_delta"]
            told = messages_told(deltas[-1]) if deltas and "input_tokens" in deltas[-1] else None
    if told is None:
        ERRORS[(plan.api, plan.route, plan.stream, r.text[-160:])] += 1
    return Result(sid, plan.route, plan.api, told, "completed" if told else "error")


async def load(bases: list[str], todo: list[Plan], concurrency: int) -> list[Result]:
    results: list[Result] = []
    queue = list(enumerate(todo))
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker() -> None:
            while queue:
                i, plan = queue.pop()
                try:
                    results.append(await one(client, bases[i % len(bases)], plan))
                except httpx.TransportError as exc:  # the client's connection, not an answer
                    ERRORS[("transport", plan.api, plan.route, repr(exc))] += 1
                    results.append(Result(None, plan.route, plan.api, None, "transport"))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


# -- reading what the gateway says -----------------------------------------------------------------


def spend(server: Server) -> Decimal:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = Decimal(0)
    for line in text.splitlines():
        if line.startswith("firsttoken_key_spend_total{"):
            total += Decimal(line.split()[-1])
    return total


def queued(server: Server) -> float:
    return server.metric("firsttoken_usage_records_queued")


def ledger_rows(db: str) -> dict[str, tuple[str, int]]:
    """request_id -> (outcome, cost in picos), straight from the database."""
    sql = "SELECT request_id, outcome, cost_picos FROM usage_requests"
    if db.startswith("sqlite:///"):
        with sqlite3.connect(db[len("sqlite:///") :]) as conn:
            rows = conn.execute(sql).fetchall()
    else:
        import psycopg

        with psycopg.connect(db) as conn:
            rows = conn.execute(sql).fetchall()
    return {r[0]: (r[1], int(r[2])) for r in rows}


def wait_written(servers: list[Server], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(queued(s) == 0 for s in servers):
            time.sleep(0.3)  # the last batch's commit
            return
        time.sleep(0.2)
    raise RuntimeError("the ledger's queue did not empty")


@contextmanager
def upstreams() -> Iterator[tuple[str, str, str]]:
    with ExitStack() as stack:
        fast = ("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1", *OPEN)
        cut = stack.enter_context(run_server(*fast, "--synthetic-fail-rate", "0.3"))
        mend = stack.enter_context(run_server(*fast))
        cache = stack.enter_context(cache_upstreams())
        yield cut.url, mend.url, cache.url


def gateways(
    stack: ExitStack, tmp: Path, urls: tuple[str, str, str], db: str | None, n: int
) -> list[Server]:
    routes, keys = tmp / "routes.toml", tmp / "keys.toml"
    routes.write_text(routes_toml(*urls))
    keys.write_text(KEYS)
    args = [
        "--routes",
        str(routes),
        "--api-keys",
        str(keys),
        *OPEN,
    ]
    if db:
        args += ["--usage-db", db]
    return [stack.enter_context(run_server(*args, timeout=60)) for _ in range(n)]


def mixed(
    requests: int, concurrency: int, db_kind: str, pg: PostgresServer | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, upstreams() as urls, ExitStack() as stack:
        if db_kind == "sqlite":
            db, n = f"sqlite:///{tmp}/usage.db", 1
        else:
            assert pg is not None
            db, n = pg.new_database(), 2
        servers = gateways(stack, Path(tmp), urls, db, n)
        started = time.monotonic()
        results = asyncio.run(load([s.url for s in servers], plans(requests), concurrency))
        elapsed = time.monotonic() - started
        wait_written(servers)
        rows = ledger_rows(db)
        counter = sum((spend(s) for s in servers), Decimal(0))
        seams: Counter[str] = Counter()
        for s in servers:
            for name, value in s.metrics().items():
                if name.startswith(("firsttoken_failovers_total", "firsttoken_handoffs_total")):
                    seams[name.split("{")[0].removeprefix("firsttoken_")] += int(value)
    outcomes = Counter(r.outcome for r in results)
    told = [r for r in results if r.told is not None and r.stream_id]
    expected = sum((priced(r.route, r.told) for r in told if r.told), Decimal(0))
    recorded = (
        sum((Decimal(rows[r.stream_id][1]) for r in told if r.stream_id in rows), Decimal(0))
        / 10**12
    )
    mismatched = [
        r.stream_id
        for r in told
        if r.stream_id not in rows
        or Decimal(rows[r.stream_id][1]) / 10**12 != priced(r.route, r.told)  # type: ignore[arg-type]
    ]
    total = Decimal(sum(c for _, c in rows.values())) / 10**12
    ids = {r.stream_id for r in results if r.stream_id and r.outcome != "refused"}
    return {
        "db": db_kind,
        "instances": n,
        "requests": len(results),
        "seconds": round(elapsed, 1),
        "outcomes": dict(outcomes),
        "ledger_outcomes": dict(Counter(o for o, _ in rows.values())),
        "seams": dict(seams),
        "records": len(rows),
        "records_missing": len(ids - set(rows)),
        "records_of_requests_the_client_lost": len(set(rows) - ids),
        "told_usage": len(told),
        "told_cost": str(expected),
        "ledger_cost_of_those": str(recorded),
        "requests_priced_differently": len(mismatched),
        "ledger_total": str(total),
        "spend_counter_total": str(counter),
        "counter_matches_ledger": abs(counter - total) <= total * Decimal("1e-14"),
        "exact": expected == recorded and not mismatched,
    }


# -- overhead: the ledger's writes at many streams -------------------------------------------------


def ttft_buckets(server: Server) -> dict[float, float]:
    """The gateway's TTFT histogram: cumulative counts by upper bound (seconds)."""
    out: dict[float, float] = {}
    for name, value in server.metrics().items():
        if name.startswith("firsttoken_ttft_seconds_bucket{"):
            bound = name.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if bound == "+Inf" else float(bound)] = value
    return out


def server_p50_ms(before: dict[float, float], after: dict[float, float]) -> float:
    """The p50 of the streams counted between two reads: the first bound holding half."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = counts[-1][1] if counts else 0.0
    for bound, cumulative in counts:
        if total and cumulative >= total / 2:
            return round(bound * 1000, 1)
    return -1.0


async def streams_round(base: str, streams: int, tokens: int) -> tuple[int, list[float]]:
    """`streams` native-free Chat Completions streams at once; tokens received, TTFTs."""
    limits = httpx.Limits(max_connections=streams + 10, max_keepalive_connections=streams)
    ttfts: list[float] = []
    received = 0
    body = {
        "model": "plain",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one_stream() -> None:
            nonlocal received
            start = time.perf_counter()
            first = True
            async with client.stream(
                "POST",
                base + "/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {KEY}"},
            ) as r:
                if r.status_code != 200:
                    ERRORS[("overhead", r.status_code, (await r.aread())[-160:].decode())] += 1
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        if first:
                            ttfts.append(time.perf_counter() - start)
                            first = False
                        received += 1

        await asyncio.gather(*(one_stream() for _ in range(streams)))
    return received, ttfts


def overhead(streams: int, rounds: int, tokens: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, upstreams() as urls, ExitStack() as stack:
        tmp_path = Path(tmp)
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        off = gateways(stack, tmp_path / "a", urls, None, 1)[0]
        on = gateways(stack, tmp_path / "b", urls, f"sqlite:///{tmp}/usage.db", 1)[0]
        rows: dict[str, list[dict[str, float]]] = {"memory": [], "sqlite": []}
        for server in (off, on):  # warm-up: imports, connections, the first plans
            asyncio.run(streams_round(server.url, min(streams, 50), tokens))
        for i in range(rounds * 2):
            name, server = (("memory", off), ("sqlite", on))[i % 2]
            proc = psutil.Process(server.proc.pid)
            before = ttft_buckets(server)
            cpu0 = sum(proc.cpu_times()[:2])
            received, ttfts = asyncio.run(streams_round(server.url, streams, tokens))
            if name == "sqlite":
                wait_written([server])
            cpu = sum(proc.cpu_times()[:2]) - cpu0
            rows[name].append(
                {
                    "tokens": received,
                    "cpu_s": round(cpu, 3),
                    "tokens_per_cpu_s": round(received / cpu, 1),
                    "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else -1.0,
                    "server_ttft_p50_ms": server_p50_ms(before, ttft_buckets(server)),
                }
            )
    per = {k: statistics.median(r["tokens_per_cpu_s"] for r in v) for k, v in rows.items()}
    ttft = {k: statistics.median(r["ttft_p50_ms"] for r in v) for k, v in rows.items()}
    server_ttft = {
        k: statistics.median(r["server_ttft_p50_ms"] for r in v) for k, v in rows.items()
    }
    return {
        "streams": streams,
        "tokens_per_stream": tokens,
        "rounds": rows,
        "tokens_per_cpu_s": per,
        "ledger_cost_pct": round((per["memory"] - per["sqlite"]) / per["memory"] * 100, 2),
        "ttft_p50_ms": ttft,  # the clients' (one Python process opening them all)
        "server_ttft_p50_ms": server_ttft,  # the gateway's histogram, this round's streams
    }


# -- outage: PostgreSQL stopped under load ---------------------------------------------------------


def outage(pg: PostgresServer, outage_s: float, concurrency: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, upstreams() as urls, ExitStack() as stack:
        db = pg.new_database()
        servers = gateways(stack, Path(tmp), urls, db, 2)
        bases = [s.url for s in servers]
        results: list[Result] = []
        peak: list[float] = []
        stop_at = time.monotonic() + 5 + outage_s + 5

        async def run() -> None:
            limits = httpx.Limits(max_connections=concurrency * 2)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:

                async def worker(i: int) -> None:
                    n = 0
                    while time.monotonic() < stop_at:
                        plan = Plan("chat", "plain", True, 20)
                        results.append(await one(client, bases[(i + n) % 2], plan))
                        n += 1

                async def faults() -> None:
                    await asyncio.sleep(5)
                    await asyncio.to_thread(pg.stop)
                    await asyncio.sleep(outage_s)
                    for s in servers:  # what waited in memory while the database was away
                        peak.append(await asyncio.to_thread(queued, s))
                    await asyncio.to_thread(pg.start)

                await asyncio.gather(faults(), *(worker(i) for i in range(concurrency)))

        asyncio.run(run())
        wait_written(servers, timeout=120)
        rows = ledger_rows(db)
        dropped = sum(s.metric("firsttoken_usage_records_dropped_total") for s in servers)
    failed = sum(1 for r in results if r.outcome != "completed")
    ids = {r.stream_id for r in results if r.stream_id}
    return {
        "outage_s": outage_s,
        "requests": len(results),
        "streams_failed": failed,
        "records": len(rows),
        "records_lost": len(ids - set(rows)),
        "dropped": dropped,
        "queued_at_the_outages_end": sum(peak),
    }


# -- takeover: money across a SIGKILL and a SIGTERM ----------------------------------------------

TAKEOVER_ROUTES = """
[targets.edge]
kind = "synthetic"
ttft_ms = 20
itl_ms = 40
price = { prompt = 0.5, completion = 50 }
[models.chat]
targets = ["edge"]
"""


async def taken_stream(
    client: httpx.AsyncClient, owner: str, rescue: str, i: int, read: asyncio.Event
) -> tuple[str, Told | None, int]:
    """One native stream created on `owner`, read there until its instance goes, then read
    to its end on `rescue` with Last-Event-ID: its id, the usage it was told, its tokens."""
    body = {"model": "chat", "prompt": f"takeover {i}", "max_tokens": 300}
    auth = {"Authorization": f"Bearer {KEY}"}
    r = await client.post(owner + "/v1/streams", json=body, headers=auth)
    r.raise_for_status()
    created = r.json()
    last_id, tokens, told = "", 0, None
    base = owner
    for _ in range(10):
        headers = {"Last-Event-ID": last_id} if last_id else {}
        try:
            async with client.stream(
                "GET", base + created["events_url"], headers=headers
            ) as events:
                decoder = EventDecoder()
                async for chunk in events.aiter_raw():
                    for event in decoder.feed(chunk):
                        data = event.data or ""
                        if data == "[DONE]":
                            return created["id"], told, tokens
                        if event.event is None and data:
                            tokens += 1
                            if tokens == 5:
                                read.set()
                        elif event.event == "meta":
                            meta = json.loads(data)
                            if "usage" in meta:
                                u = meta["usage"]
                                told = Told(u["prompt_tokens"], u["completion_tokens"])
                        elif event.event == "error":
                            ERRORS[("takeover", data[-160:])] += 1
                            return created["id"], told, tokens
                    last_id = decoder.last_event_id or last_id
        except httpx.HTTPError:
            pass  # its instance went: on to the one that stays
        base = rescue
        await asyncio.sleep(0.05)
    return created["id"], told, tokens


async def takeover_load(servers: list[Server], streams: int) -> list[tuple[str, Told | None, int]]:
    a, b, c = servers
    limits = httpx.Limits(max_connections=streams * 2)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        reads = [asyncio.Event() for _ in range(streams)]
        owners = (a, b, c)
        tasks = [
            asyncio.create_task(taken_stream(client, owners[i % 3].url, c.url, i, reads[i]))
            for i in range(streams)
        ]
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in reads)), 30)
        a.kill()  # never writes its records
        b.proc.send_signal(signal.SIGTERM)  # hands over, recording its part
        return await asyncio.gather(*tasks)


def ledger_outcomes(db: str) -> dict[str, int]:
    path = Path(db[len("sqlite:///") :])
    if not path.exists():
        return {}
    sql = "SELECT outcome, count(*) FROM usage_requests GROUP BY outcome"
    with sqlite3.connect(path) as conn:
        return dict(conn.execute(sql).fetchall())


def ledger_sums(dbs: list[str]) -> dict[str, tuple[int, int, int]]:
    """Stream id -> (prompt, completion, cost in picos) over every instance's records of it."""
    out: dict[str, tuple[int, int, int]] = {}
    sql = "SELECT request_id, prompt_tokens, completion_tokens, cost_picos FROM usage_requests"
    for db in dbs:
        path = Path(db[len("sqlite:///") :])
        if not path.exists():
            continue
        with sqlite3.connect(path) as conn:
            for request_id, prompt, completion, cost in conn.execute(sql):
                sid = request_id.split(":")[0]
                p, c, k = out.get(sid, (0, 0, 0))
                out[sid] = (p + prompt, c + completion, k + cost)
    return out


def takeover(streams: int) -> dict[str, Any]:
    from tests.redis_server import run_redis

    price = {"prompt": Decimal("0.5"), "completion": Decimal(50)}
    with tempfile.TemporaryDirectory() as tmp, run_redis() as url, ExitStack() as stack:
        routes, keys = Path(tmp) / "routes.toml", Path(tmp) / "keys.toml"
        routes.write_text(TAKEOVER_ROUTES)
        keys.write_text(KEYS)
        dbs = [f"sqlite:///{tmp}/usage-{n}.db" for n in "abc"]
        servers = [
            stack.enter_context(
                run_server(
                    *("--redis", url, "--durable", "--routes", str(routes)),
                    *("--api-keys", str(keys), "--usage-db", db, "--resume-grace-s", "10"),
                    *OPEN,
                    timeout=60,
                )
            )
            for db in dbs
        ]
        results = asyncio.run(takeover_load(servers, streams))
        servers[1].proc.wait(timeout=10)
        wait_written([servers[2]])
        sums = ledger_sums(dbs)
        moved = servers[2].metric('firsttoken_takeovers_total{outcome="continued"}')
        records = {name: ledger_outcomes(db) for name, db in zip("abc", dbs, strict=True)}
    told_tokens = billed_tokens = unbilled = overbilled = 0
    mispriced = 0
    told_count = 0
    lost: Counter[str] = Counter()  # streams ended stream_lost (no usage told), by owner
    lost_received = lost_billed = 0
    for i, (sid, told, received) in enumerate(results):
        if told is None:
            lost["abc"[i % 3]] += 1
            lost_received += received
            lost_billed += sums.get(sid, (0, 0, 0))[1]
            continue
        told_count += 1
        prompt, completion, picos = sums.get(sid, (0, 0, 0))
        want = told.prompt + told.completion
        got = prompt + completion
        told_tokens += want
        billed_tokens += got
        unbilled += max(0, want - got)
        overbilled += max(0, got - want)
        cost = (told.prompt * price["prompt"] + told.completion * price["completion"]) / M
        if Decimal(picos) / 10**12 != cost:
            mispriced += 1
    return {
        "streams": len(results),
        "told_usage": told_count,
        "taken_over": int(moved),  # all of a's and b's streams: none ended before the kill
        "records_by_instance": records,
        "told_tokens": told_tokens,
        "billed_tokens": billed_tokens,
        "unbilled_tokens": unbilled,
        "overbilled_tokens": overbilled,
        "streams_priced_differently": mispriced,
        # Ended `stream_lost` (told no usage): by owner (a: SIGKILLed, b: SIGTERMed), the
        # answer tokens their clients received, and what the ledgers billed of them.
        "streams_lost": dict(lost),
        "lost_tokens_received": lost_received,
        "lost_tokens_billed": lost_billed,
        "exact": unbilled == overbilled == mispriced == 0 and lost_received == lost_billed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ledger",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=10_000, help="the mixed load's size")
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--streams", type=int, default=500, help="the overhead phase's streams")
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="overhead rounds per side")
    parser.add_argument("--outage-s", type=float, default=30.0)
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--takeover-streams", type=int, default=60)
    parser.add_argument("--phases", default="mixed,overhead,outage,takeover")
    args = parser.parse_args()
    phases = set(args.phases.split(","))
    report: dict[str, Any] = {}
    with ExitStack() as stack:
        pg = None
        if args.db != "sqlite" or "outage" in phases:
            pg = stack.enter_context(postgres_server())
        if "mixed" in phases:
            kinds = ("sqlite", "postgres") if args.db == "both" else (args.db,)
            report["mixed"] = [mixed(args.requests, args.concurrency, k, pg) for k in kinds]
            report["errors_seen"] = [[*k, n] for k, n in ERRORS.most_common(10)]
            print(json.dumps(report), file=sys.stderr)
            for m in report["mixed"]:
                print(
                    f"mixed {m['db']}: exact={m['exact']} counter={m['counter_matches_ledger']} "
                    f"missing={m['records_missing']} {m['outcomes']}",
                    file=sys.stderr,
                )
        if "overhead" in phases:
            report["overhead"] = overhead(args.streams, args.rounds, args.stream_tokens)
            print(json.dumps(report["overhead"]), file=sys.stderr)
            o = report["overhead"]
            print(
                f"overhead: {o['ledger_cost_pct']}% tokens/CPU-s, TTFT p50 {o['ttft_p50_ms']}",
                file=sys.stderr,
            )
        if "outage" in phases:
            assert pg is not None
            report["outage"] = outage(pg, args.outage_s, args.concurrency)
            print(f"outage: {report['outage']}", file=sys.stderr)
        if "takeover" in phases:
            report["takeover"] = t = takeover(args.takeover_streams)
            print(
                f"takeover: {t['taken_over']} streams taken over, {t['told_tokens']} tokens "
                f"told, {t['unbilled_tokens']} unbilled, {t['overbilled_tokens']} overbilled, "
                f"exact={t['exact']}",
                file=sys.stderr,
            )
    report["errors_seen"] = [[*k, n] for k, n in ERRORS.most_common(10)]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
