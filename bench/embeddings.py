"""What the embeddings relay adds: `POST /v1/embeddings` direct to the upstream, through
firsttoken's routes and through LiteLLM, per request, at 1 and at 32 at once, in one run.

    .venv/bin/python -m bench.embeddings                  # about 2 minutes with LiteLLM
    .venv/bin/python -m bench.embeddings --quick --no-litellm   # seconds: the smoke test

The upstream is `firsttoken serve` with the synthetic engine (it answers /v1/embeddings with
deterministic vectors, in microseconds of its own work). In front of it:

- `direct`: the upstream itself (what the client and the upstream cost; "added" is over it);
- `relay`: `firsttoken serve --routes FILE`, one route `synthetic` over one `kind = "openai"`
  target with `serves = ["embeddings"]`;
- `litellm`: the LiteLLM proxy (`model: openai/synthetic`, `api_base` the upstream; found and
  run as `bench.proxies` does: `.venv/litellm`, `--litellm PATH`).

Each request is what the openai SDK sends by default: one text of 15 words,
`encoding_format: "base64"`; its answer must be 200 with the upstream's own vector (checked
against direct's), or it counts as failed.

- **c=1, paired per round**: a round sends one request to every target in turn (the order
  rotates); a target's added latency in a round is its latency minus direct's in the same
  round; p50/p99 over those differences, and each target's own p50/p99.
- **c=32**: per round, each target in turn (rotating) gets 32 clients at once, each sending
  `--per-client` requests back to back on its own keep-alive connection; p50/p99 per request
  over every round, requests per second while it ran, and this client's CPU over that time
  (near 100%: the one client process, not the target, set the pace).

Latency runs from the request's write to the whole answer read (httpx, one connection per
client, opened before timing). Nothing is pinned: on a shared machine the figures carry its
noise; compare ratios from one run. Writes `bench/results/embeddings.json` and `.txt`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.gateways import launch
from bench.procs import ROOT, ServerProcess
from bench.proxies import find_litellm, launch_litellm, litellm_version
from bench.stats import loadavg

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
OPEN = ("--rate-limit-per-s", "0", "--ttft-slo-ms", "0", "--breaker-error-rate", "1")
TARGETS = ("direct", "relay", "litellm")
LABELS = {"direct": "direct (upstream)", "relay": "firsttoken relay", "litellm": "LiteLLM"}
TEXT = "the first token arrives soon and every stream can be resumed where it broke off"
BODY = {"model": "synthetic", "input": TEXT, "encoding_format": "base64"}


def _log(msg: str) -> None:
    print(f"[embeddings {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    rounds: int = 300  # c=1 rounds, every target once a round
    concurrency: int = 32
    burst_rounds: int = 6  # c=32 rounds, every target once a round
    per_client: int = 10  # requests each of the 32 clients sends in its turn

    @classmethod
    def quick(cls) -> Sizes:
        return cls(rounds=5, concurrency=4, burst_rounds=1, per_client=2)


def routes_file(out: Path, upstream: str) -> Path:
    path = out / "routes.toml"
    path.write_text(
        '[targets.upstream]\nkind = "openai"\n'
        f'url = "{upstream}/v1"\nmodel = "synthetic"\nserves = ["embeddings"]\n\n'
        '[models.synthetic]\ntargets = ["upstream"]\n'
    )
    return path


class Checked:
    """Each target's answers against the upstream's own vector: a relay that answered 200
    with anything else did not do the job."""

    def __init__(self, vector: str) -> None:
        self.vector = vector

    def ok(self, response: httpx.Response) -> bool:
        if response.status_code != 200:
            return False
        data = response.json().get("data") or [{}]
        return bool(data[0].get("embedding") == self.vector)


async def timed(client: httpx.AsyncClient, check: Checked) -> float | None:
    """One request's latency in ms, or None when its answer was wrong or failed."""
    t0 = time.perf_counter()
    try:
        response = await client.post("/v1/embeddings", json=BODY)
    except httpx.HTTPError:
        return None
    ms = (time.perf_counter() - t0) * 1000
    return ms if check.ok(response) else None


def connect(url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=30.0)


async def warm(urls: dict[str, str], check: Checked) -> None:
    for name, url in urls.items():
        async with connect(url) as client:
            got = [await timed(client, check) for _ in range(20)]
        if any(ms is None for ms in got):
            raise RuntimeError(f"{name}: warm-up requests failed or answered another vector")


async def one_at_a_time(
    urls: dict[str, str], check: Checked, rounds: int
) -> dict[str, list[float | None]]:
    clients = {name: connect(url) for name, url in urls.items()}
    names = list(urls)
    out: dict[str, list[float | None]] = {name: [] for name in names}
    try:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                out[name].append(await timed(clients[name], check))
    finally:
        for client in clients.values():
            await client.aclose()
    return out


async def burst(url: str, check: Checked, sizes: Sizes) -> tuple[list[float | None], float, float]:
    """`concurrency` clients at once, each `per_client` requests back to back: latencies, the
    wall time of the whole burst, and this client's CPU time over it."""
    clients = [connect(url) for _ in range(sizes.concurrency)]
    try:
        # One connection each, opened before timing.
        await asyncio.gather(*(c.get("/v1/models") for c in clients))

        async def one(client: httpx.AsyncClient) -> list[float | None]:
            return [await timed(client, check) for _ in range(sizes.per_client)]

        t0, cpu0 = time.perf_counter(), time.process_time()
        runs = await asyncio.gather(*(one(c) for c in clients))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return [ms for run in runs for ms in run], wall, cpu


Burst = tuple[list[float | None], float, float]  # latencies, wall s, client CPU s


async def at_once(urls: dict[str, str], check: Checked, sizes: Sizes) -> dict[str, Burst]:
    names = list(urls)
    out: dict[str, Burst] = {name: ([], 0.0, 0.0) for name in names}
    for r in range(sizes.burst_rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            got, wall, cpu = await burst(urls[name], check, sizes)
            lat, wall_sum, cpu_sum = out[name]
            out[name] = (lat + got, wall_sum + wall, cpu_sum + cpu)
    return out


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


def summarise(single: dict[str, list[float | None]], many: dict[str, Burst]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    direct = single["direct"]
    for name, got in single.items():
        ok = [ms for ms in got if ms is not None]
        added = [
            ms - d for ms, d in zip(got, direct, strict=True) if ms is not None and d is not None
        ]
        lat, wall, cpu = many[name]
        ok_many = [ms for ms in lat if ms is not None]
        out[name] = {
            "c1": {
                "requests": len(got),
                "failed": len(got) - len(ok),
                "p50_ms": _pct(ok, 50),
                "p99_ms": _pct(ok, 99),
                "added_p50_ms": _pct(added, 50) if name != "direct" else None,
                "added_p99_ms": _pct(added, 99) if name != "direct" else None,
            },
            "many": {
                "requests": len(lat),
                "failed": len(lat) - len(ok_many),
                "p50_ms": _pct(ok_many, 50),
                "p99_ms": _pct(ok_many, 99),
                "per_s": len(ok_many) / wall if wall else None,
                "client_cpu_share": cpu / wall if wall else None,  # 1.0: the client is the limit
            },
        }
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}×" if a is not None and b else "—"


def _ms(v: float | None) -> str:
    return f"{v:.2f}" if v is not None else "—"


def report(res: dict[str, Any]) -> str:
    meta, figs, c = res["meta"], res["targets"], res["meta"]["sizes"]["concurrency"]
    lines = [
        f"embeddings relay — {meta['date']} at {meta['commit']} ({meta['host']}, "
        f"{meta['cpus']} CPUs, load {meta['load_before']})",
        f"LiteLLM: {meta['litellm']['status']}",
        "",
        f"| | c=1 p50 / p99 ms | c=1 added over direct p50 / p99 ms "
        f"| c={c} p50 / p99 ms | c={c} req/s | client CPU at c={c} | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, fig in figs.items():
        one, many = fig["c1"], fig["many"]
        added = (
            f"+{_ms(one['added_p50_ms'])} / +{_ms(one['added_p99_ms'])}"
            if name != "direct"
            else "—"
        )
        rate = f"{many['per_s']:.0f}" if many["per_s"] else "—"
        client = f"{many['client_cpu_share']:.0%}" if many["client_cpu_share"] else "—"
        lines.append(
            f"| {LABELS[name]} | {_ms(one['p50_ms'])} / {_ms(one['p99_ms'])} | {added} "
            f"| {_ms(many['p50_ms'])} / {_ms(many['p99_ms'])} | {rate} | {client} "
            f"| {one['failed'] + many['failed']} |"
        )
    if "litellm" in figs and "relay" in figs:
        lite, relay = figs["litellm"], figs["relay"]
        lines += [
            "",
            "LiteLLM ÷ relay: added at c=1 "
            f"{_ratio(lite['c1']['added_p50_ms'], relay['c1']['added_p50_ms'])} p50, "
            f"{_ratio(lite['c1']['added_p99_ms'], relay['c1']['added_p99_ms'])} p99; "
            f"latency at c={c} {_ratio(lite['many']['p50_ms'], relay['many']['p50_ms'])} p50, "
            f"{_ratio(lite['many']['p99_ms'], relay['many']['p99_ms'])} p99",
        ]
    if "relay" in figs:
        relay, direct = figs["relay"], figs["direct"]
        lines.append(
            f"relay ÷ direct at c={c}: "
            f"{_ratio(relay['many']['p50_ms'], direct['many']['p50_ms'])} p50, "
            f"{_ratio(relay['many']['p99_ms'], direct['many']['p99_ms'])} p99"
        )
    return "\n".join(lines) + "\n"


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


async def measure(args: argparse.Namespace, sizes: Sizes, out: Path) -> dict[str, Any]:
    logs = out / "embeddings-logs"
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    ft = [py, "-m", "firsttoken", "serve", "--port", "0", *OPEN]
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_before": loadavg(),
        "sizes": asdict(sizes),
        "body": BODY,
        "litellm": {"status": "not tried"},
    }
    procs: list[ServerProcess] = []
    try:
        upstream = launch("direct", ft, logs)
        procs.append(upstream)
        relay = launch("relay", [*ft, "--routes", str(routes_file(logs, upstream.url))], logs)
        procs.append(relay)
        urls = {"direct": upstream.url, "relay": relay.url}
        if args.no_litellm:
            meta["litellm"]["status"] = "skipped (--no-litellm)"
        elif (binary := find_litellm(args.litellm)) is None:
            meta["litellm"]["status"] = "not installed (see bench/README.md, Proxies)"
        else:
            try:
                lite, start_s = launch_litellm(binary, upstream.url, out)
            except RuntimeError as exc:
                meta["litellm"]["status"] = f"did not start: {exc}"
            else:
                procs.append(lite)
                urls["litellm"] = lite.url
                version = litellm_version(binary)
                meta["litellm"]["status"] = f"litellm {version}, started in {start_s:.0f} s"
        async with connect(upstream.url) as client:
            answer = await client.post("/v1/embeddings", json=BODY)
        check = Checked(answer.json()["data"][0]["embedding"])
        await warm(urls, check)
        _log(f"c=1: {sizes.rounds} rounds over {', '.join(urls)}")
        single = await one_at_a_time(urls, check, sizes.rounds)
        _log(f"c={sizes.concurrency}: {sizes.burst_rounds} rounds")
        many = await at_once(urls, check, sizes)
    finally:
        for proc in procs:
            proc.stop()
    meta["load_after"] = loadavg()
    return {"meta": meta, "targets": summarise(single, many)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few requests: the smoke test")
    parser.add_argument("--litellm", help="path to the `litellm` command")
    parser.add_argument("--no-litellm", action="store_true", help="direct and the relay only")
    parser.add_argument("--rounds", type=int, help="c=1 rounds (default 300)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.rounds:
        sizes = Sizes(args.rounds, sizes.concurrency, sizes.burst_rounds, sizes.per_client)
    args.out.mkdir(parents=True, exist_ok=True)
    res = asyncio.run(measure(args, sizes, args.out))
    (args.out / "embeddings.json").write_text(json.dumps(res, indent=2) + "\n")
    text = report(res)
    (args.out / "embeddings.txt").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
