"""What the operator's page costs the gateway: tokens per server CPU-second with 500 streams
running, with `/ops` open in 3 browsers against none, in the same run.

    .venv/bin/python -m bench.ops [--streams 500] [--rounds 6] [--phase-s 10] [--quick]

Two identical `firsttoken serve` processes (twins: synthetic engine at its default pace, 20 ms
per token; each stream long enough to outlast the run) each take `--streams` streams from a load
client in its own process (bench/load.py: raw sockets, no parsing while it runs). Once they all
run, each round opens `/ops` in three Chromium contexts (separate sessions, as three operators'
browsers would be: the page and its EventSource on `/v1/admin/events`, behind the admin key) on
one twin, alternating between them, and measures both twins over the same seconds: each
process's CPU (user + system, every thread) and the tokens it wrote
(`firsttoken_tokens_sent_total`). Measuring both at once is what makes the comparison hold on a
shared machine: a neighbour's burst lands on both twins. The cost is 1 - pages / none in tokens
per CPU-second, pooled over all rounds, and balanced: the mean of each twin's mean cost (each
twin has a bias of its own, a few per cent either way, which alternating the pages cancels).
With nobody watching, the feed still builds a snapshot every 5 s (so that the charts have their
15 minutes when a page opens); with a page open, one a second: the difference is the page's
cost, and is in the figure. One snapshot's CPU (collect, build, encode) is also measured apart,
in process, as `build_ms`.

Needs Chromium (`/usr/bin/chromium`, or FIRSTTOKEN_CHROMIUM) and Playwright, as the web tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.expected import RequestSpec
from bench.load import Plan, drive
from tests.servers import Server, parse_metrics, run_server, wait_for

ADMIN = "bench-ops-admin"
ADMIN_ENV = {"OPS_BENCH_ADMIN": ADMIN}
OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0", "--ttft-slo-ms", "0")
ITL_MS = 20.0  # the server's default --synthetic-itl-ms
CHROMIUM = Path(os.environ.get("FIRSTTOKEN_CHROMIUM", "/usr/bin/chromium"))
RESULTS = Path(__file__).parent / "results"


@dataclass
class Phase:
    arm: str  # none | pages
    seconds: float
    cpu_s: float
    tokens: float

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s if self.cpu_s else 0.0


class LongSpec(RequestSpec):
    """A stream whose natural answer is as long as its `max_tokens` (not ~300 tokens)."""

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["synthetic"]["answer_tokens"] = self.max_tokens
        return body


def load_main(port: int, streams: int, seconds: float) -> None:
    """The load client's process: `streams` streams that each outlast `seconds`."""
    tokens = int(seconds * 1000 / ITL_MS) + 200
    specs = [LongSpec(i % 8, tokens, 20.0, ITL_MS) for i in range(streams)]
    plan = Plan(specs, ramp_s=min(10.0, streams / 100), deadline_s=seconds + 60)
    asyncio.run(drive("127.0.0.1", port, plan))


def sample(server: Server, proc: psutil.Process) -> tuple[float, float, float]:
    times = proc.cpu_times()
    sent = parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)
    return time.monotonic(), times.user + times.system, sent["firsttoken_tokens_sent_total"]


def start_twin(stack: ExitStack, args: argparse.Namespace, total_s: float) -> Server:
    server = stack.enter_context(
        run_server(
            "--admin-key-env",
            "OPS_BENCH_ADMIN",
            "--max-streams-per-key",
            str(args.streams * 2),
            *OPEN,
            env=ADMIN_ENV,
            timeout=60,
        )
    )
    command = ["-m", "bench.ops", "--_load", str(server.port), str(args.streams), str(total_s)]
    load = subprocess.Popen([sys.executable, *command])
    stack.callback(load.kill)
    return server


def measure(args: argparse.Namespace) -> dict[str, object]:
    from playwright.sync_api import BrowserContext, sync_playwright

    total_s = args.rounds * (args.phase_s + 8) + 60
    phases: list[Phase] = []
    with ExitStack() as stack:
        twins = [start_twin(stack, args, total_s) for _ in range(2)]
        procs = [psutil.Process(t.proc.pid) for t in twins]
        for twin in twins:
            wait_for(
                lambda twin=twin: twin.metric("firsttoken_active_streams") >= args.streams * 0.98,
                timeout=90,
                interval=0.5,
            )
        time.sleep(2)
        playwright = stack.enter_context(sync_playwright())
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        stack.callback(browser.close)
        contexts: list[BrowserContext] = []
        for round_ in range(args.rounds):
            watched = round_ % 2  # the twin with the pages open this round
            for context in contexts:
                context.close()
            contexts = []
            for _ in range(3):
                context = browser.new_context(
                    extra_http_headers={"Authorization": f"Bearer {ADMIN}"}
                )
                page = context.new_page()
                page.goto(twins[watched].url + "/ops")
                page.wait_for_function("() => window.opsState.snapshots > 0")
                contexts.append(context)
            time.sleep(3)  # the pages' loading done: what is measured is them open
            before = [sample(t, p) for t, p in zip(twins, procs, strict=True)]
            time.sleep(args.phase_s)
            after = [sample(t, p) for t, p in zip(twins, procs, strict=True)]
            for i, (b, a) in enumerate(zip(before, after, strict=True)):
                arm = "pages" if i == watched else "none"
                phases.append(Phase(arm, a[0] - b[0], a[1] - b[1], a[2] - b[2]))
            pages, none = (phases[-2], phases[-1]) if watched == 0 else (phases[-1], phases[-2])
            print(
                f"  round {round_ + 1}: pages on twin {watched + 1}: "
                f"{pages.tokens_per_cpu_s:8.0f} tokens/CPU-s, none {none.tokens_per_cpu_s:8.0f} "
                f"({1 - pages.tokens_per_cpu_s / none.tokens_per_cpu_s:+.2%})",
                flush=True,
            )
        active = sum(t.metric("firsttoken_active_streams") for t in twins)
    arms = {
        arm: sum(p.tokens for p in phases if p.arm == arm)
        / sum(p.cpu_s for p in phases if p.arm == arm)
        for arm in ("none", "pages")
    }
    # Each round's cost, by the twin that had the pages: each twin has a bias of its own (a few
    # per cent, either way), which the mean of the two twins' means cancels.
    by_twin: dict[int, list[float]] = {0: [], 1: []}
    for round_ in range(len(phases) // 2):
        pair = phases[2 * round_ : 2 * round_ + 2]
        pages = next(p for p in pair if p.arm == "pages")
        none = next(p for p in pair if p.arm == "none")
        by_twin[round_ % 2].append(1 - pages.tokens_per_cpu_s / none.tokens_per_cpu_s)
    balanced = statistics.mean(statistics.mean(c) for c in by_twin.values() if c)
    return {
        "streams": args.streams,
        "active_at_end": active,
        "tokens_per_cpu_s": arms,
        "cost": 1 - arms["pages"] / arms["none"],
        "cost_twins_balanced": balanced,
        "cost_by_twin": by_twin,
        "build_ms": build_ms(),
        "phases": [asdict(p) | {"tokens_per_cpu_s": p.tokens_per_cpu_s} for p in phases],
    }


def build_ms() -> float:
    """One snapshot (collect + build + encode) of a server with 20 routes and keys, in process."""
    from firsttoken.ops.feed import frame
    from firsttoken.ops.snapshot import Snapshots
    from firsttoken.telemetry.metrics import Metrics

    metrics, snaps = Metrics(), Snapshots()
    for i in range(20):
        metrics.stream_started(f"route-{i}", f"key-{i}")
        metrics.count_key_tokens(f"key-{i}", (1, 2, 3, 4, 0))
    started = time.perf_counter()
    for i in range(200):
        families = [
            [f.name, f.type, f.documentation, [[s.name, s.labels, s.value] for s in f.samples]]
            for f in metrics.registry.collect()
        ]
        frame("snapshot", snaps.build(families, 1000.0 + i))
    return (time.perf_counter() - started) / 200 * 1000


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_load":
        load_main(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--phase-s", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="50 streams, 2 rounds of 3 s")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where ops.json goes")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.rounds, args.phase_s = 50, 2, 3.0
    others = psutil.cpu_percent(interval=0.5) / 100 * (psutil.cpu_count() or 1)
    print(
        f"bench.ops: two twins of {args.streams} streams, {args.rounds} rounds of "
        f"{args.phase_s:g} s (machine busy before: {others:.2f} cores)",
        flush=True,
    )
    result = measure(args)
    arms = result["tokens_per_cpu_s"]
    assert isinstance(arms, dict)
    print(
        f"tokens per server CPU-second: none {arms['none']:.0f}, 3 pages {arms['pages']:.0f}; "
        f"cost {float(result['cost']) * 100:+.2f} % pooled, "  # type: ignore[arg-type]
        f"{float(result['cost_twins_balanced']) * 100:+.2f} % balanced over the twins "  # type: ignore[arg-type]
        "(target <= 2 %); "
        f"one snapshot {float(result['build_ms']):.2f} ms"  # type: ignore[arg-type]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ops.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
