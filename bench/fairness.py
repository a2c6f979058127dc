"""`python -m bench.fairness`: when engines are full (issue 29), who waits and what a key pays.

Each scenario runs against its own `firsttoken serve` on 127.0.0.1 (the synthetic engine):

- **budget**: 20 requests at once (`max_tokens` 50 each) from a key whose `tokens_per_minute`
  is 100. How many were admitted, the tokens they used (prompt + answer, from each answer's
  `usage`), and how far over the budget that is, in tokens and in requests.
- **cut**: a streaming chat (`max_tokens` 200) whose client leaves after 5 chunks. The chunks
  it read, the tokens the stream generated (its `stream.finished` log line) and what its key
  was billed (`firsttoken_key_tokens_total`).
- **flood**: one target with `max_concurrency = 4` (routes file). Key `flood` opens 24 streams
  of 150 tokens; 0.3 s later key `steady` opens 4 and key `vip` (priority 1) opens 1. Each
  key's TTFT p50/p95 and how many of its streams completed. It measures the gateway's queue
  in front of the target (routing/queue.py). **flood-fifo** sends the same streams to the
  synthetic engine's batching simulation with `--batch-max 4` and no routes: the engine's own
  first come, first served line, as issue 29 measured it.

`--root DIR` runs another checkout's server (e.g. a `git worktree` at an older commit) for a
before/after comparison; the figures that need this checkout's metrics are then None.

    python -m bench.fairness [--scenario all|budget|cut|flood|flood-fifo] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.procs import ROOT

__all__ = ["budget", "cut", "flood", "main"]

TIMEOUT = httpx.Timeout(60.0)
BUDGET = 100  # tokens per minute of the budget scenario's key
KEYS = f"""
[[keys]]
name = "budgeted"
key = "sk-budgeted"
tokens_per_minute = {BUDGET}
max_streams = 100

[[keys]]
name = "cutter"
key = "sk-cutter"
tokens_per_minute = 100000

[[keys]]
name = "flood"
key = "sk-flood"
max_streams = 100

[[keys]]
name = "steady"
key = "sk-steady"

[[keys]]
name = "vip"
key = "sk-vip"
priority = 1
"""
ROUTES = """
[targets.engine]
kind = "synthetic"
max_concurrency = 4
queue_timeout_s = 60

[models.synthetic]
targets = ["engine"]
"""


class Server:
    """`firsttoken serve` in a subprocess, its log in a file."""

    def __init__(self, root: Path, workdir: Path, *args: str) -> None:
        self.log = workdir / "server.log"
        with self.log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "firsttoken", "serve", "--port", "0", *args],
                cwd=root,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.url = ""
        deadline = time.monotonic() + 30
        while not self.url:
            for record in self.records():
                if record.get("event") == "listening":
                    self.url = record["url"]
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start:\n" + self.log.read_text()[-2000:])
            time.sleep(0.05)

    def records(self) -> Iterator[dict[str, Any]]:
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                yield json.loads(line)
            except ValueError:
                continue

    def metric(self, name: str) -> float | None:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def serving(root: Path, *args: str, routes: bool = False) -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="ft-fairness-") as tmp:
        work = Path(tmp)
        (work / "keys.toml").write_text(KEYS)
        extra = ["--api-keys", str(work / "keys.toml"), *args]
        if routes:
            (work / "routes.toml").write_text(ROUTES)
            extra += ["--routes", str(work / "routes.toml")]
        server = Server(root, work, *extra)
        try:
            yield server
        finally:
            server.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer sk-{key}"}


def _billed(server: Server, key: str) -> dict[str, float | None]:
    return {
        kind: server.metric(f'firsttoken_key_tokens_total{{key="{key}",kind="{kind}"}}')
        for kind in ("prompt", "completion")
    }


# -- budget -----------------------------------------------------------------------------------


async def _burst(url: str, n: int, max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        return await asyncio.gather(
            *(
                client.post(
                    url + "/v1/completions",
                    headers=_auth("budgeted"),
                    json={"prompt": f"budget {i}", "max_tokens": max_tokens},
                )
                for i in range(n)
            )
        )


def budget(root: Path = ROOT, requests: int = 20, max_tokens: int = 50) -> dict[str, Any]:
    if (left := 60 - time.time() % 60) < 10:
        time.sleep(left + 0.5)  # one clock minute for the whole burst
    with serving(root, "--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "5") as server:
        answers = asyncio.run(_burst(server.url, requests, max_tokens))
        ok = [r.json()["usage"] for r in answers if r.status_code == 200]
        codes: dict[str, int] = {}
        for r in answers:
            if r.status_code != 200:
                code = r.json()["error"]["code"]
                codes[code] = codes.get(code, 0) + 1
        used = sum(u["total_tokens"] for u in ok)
        one = ok[0]["prompt_tokens"] + max_tokens if ok else max_tokens
        billed = _billed(server, "budgeted")
    return {
        "budget_tokens_per_minute": BUDGET,
        "requests": requests,
        "max_tokens": max_tokens,
        "admitted": len(ok),
        "refused": codes,
        "tokens_used": used,
        "billed": billed,
        "over_budget_tokens": max(0, used - BUDGET),
        "over_budget_requests": round(max(0, used - BUDGET) / one, 2),
        "one_request_may_cost": one,
    }


# -- cut --------------------------------------------------------------------------------------


def cut(root: Path = ROOT, after_chunks: int = 5, max_tokens: int = 200) -> dict[str, Any]:
    with serving(root, "--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "20") as server:
        chunks = 0
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            headers=_auth("cutter"),
            json={
                "messages": [{"role": "user", "content": "Tell me about lighthouses."}],
                "stream": True,
                "max_tokens": max_tokens,
            },
            timeout=TIMEOUT,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and _content(line):
                    chunks += 1
                    if chunks == after_chunks:
                        break
        finished: dict[str, Any] | None = None
        deadline = time.monotonic() + 10
        while finished is None and time.monotonic() < deadline:
            finished = next(
                (r for r in server.records() if r.get("event") == "stream.finished"), None
            )
            time.sleep(0.05)
        billed = _billed(server, "cutter")
    return {
        "max_tokens": max_tokens,
        "chunks_read": chunks,
        "outcome": finished and finished.get("outcome"),
        "tokens_generated": finished and finished.get("tokens_generated"),
        "tokens_sent": finished and finished.get("tokens_sent"),
        "billed": billed,
    }


# -- flood ------------------------------------------------------------------------------------


def _content(line: str) -> str:
    """The answer text of an OpenAI chunk's data line ("" for the role chunk, the usage)."""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


async def _stream(client: httpx.AsyncClient, url: str, key: str, tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    ttft: float | None = None
    done = False
    try:
        async with client.stream(
            "POST",
            url + "/v1/chat/completions",
            headers=_auth(key),
            json={
                "model": "synthetic",
                "messages": [{"role": "user", "content": f"{key} {start}"}],
                "stream": True,
                "max_tokens": tokens,
            },
        ) as r:
            if r.status_code != 200:
                return {"key": key, "status": r.status_code, "ttft_ms": None, "done": False}
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {") and _content(line):
                    ttft = time.perf_counter() - start
                if line == "data: [DONE]":
                    done = True
    except httpx.HTTPError as exc:
        return {"key": key, "status": repr(exc), "ttft_ms": None, "done": False}
    return {
        "key": key,
        "status": 200,
        "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
        "done": done,
    }


async def _flood(url: str, tokens: int, delay_s: float) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        first = [asyncio.create_task(_stream(client, url, "flood", tokens)) for _ in range(24)]
        await asyncio.sleep(delay_s)
        later = [asyncio.create_task(_stream(client, url, "steady", tokens)) for _ in range(4)]
        later.append(asyncio.create_task(_stream(client, url, "vip", tokens)))
        return list(await asyncio.gather(*first, *later))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 1)


def flood(
    root: Path = ROOT, tokens: int = 150, delay_s: float = 0.3, fifo: bool = False
) -> dict[str, Any]:
    """`fifo`: the baseline the issue measured, no gateway queue: the synthetic engine's
    batching simulation with `--batch-max 4` takes the streams first come, first served (its
    step time sets the pace: ~16 ms a token with 4 in the batch, not 20)."""
    if fifo:
        with serving(root, "--batch-max", "4") as server:
            streams = asyncio.run(_flood(server.url, tokens, delay_s))
    else:
        args = ("--synthetic-ttft-ms", "50", "--synthetic-itl-ms", "20")
        with serving(root, *args, routes=True) as server:
            streams = asyncio.run(_flood(server.url, tokens, delay_s))
    out: dict[str, Any] = {
        "queue": "engine FIFO (--batch-max 4)" if fifo else "gateway (max_concurrency = 4)",
        "tokens": tokens,
        "keys": {},
    }
    for key in ("flood", "steady", "vip"):
        mine = [s for s in streams if s["key"] == key]
        ttfts = [s["ttft_ms"] for s in mine if s["ttft_ms"] is not None]
        out["keys"][key] = {
            "streams": len(mine),
            "completed": sum(s["done"] for s in mine),
            "ttft_p50_ms": _pct(ttfts, 50),
            "ttft_p95_ms": _pct(ttfts, 95),
            "not_200": [s["status"] for s in mine if s["status"] != 200],
        }
    return out


SCENARIOS = {
    "budget": budget,
    "cut": cut,
    "flood": flood,
    "flood-fifo": lambda root: flood(root, fifo=True),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=["all", *SCENARIOS], default="all")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose server runs")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    results = {name: SCENARIOS[name](args.root) for name in names}
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
