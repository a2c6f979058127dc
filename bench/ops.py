"""What the operator's page costs the gateway: tokens per server CPU-second with 500 streams
running, with `/ops` open in 3 browsers against none, in the same run.

    .venv/bin/python -m bench.ops [--streams 500] [--rounds 3] [--phase-s 10] [--quick]

One `firsttoken serve` (synthetic engine at its default pace, 20 ms per token; each stream long
enough to outlast the run) takes `--streams` streams from a load client in its own process
(bench/load.py: raw sockets, no parsing while it runs). Once they all run, phases alternate,
`none` then `pages`, `--rounds` times: in `pages`, three Chromium contexts (separate sessions,
as three operators' browsers would be) have `/ops` open behind the admin key, each with its
EventSource on `/v1/admin/events`; in `none` they are closed. Each phase measures the server
process's CPU (user + system, every thread) and the tokens it wrote
(`firsttoken_tokens_sent_total`), and reports tokens per CPU-second; the cost is 1 - pages /
none over the sums of all rounds (pooled), and the median over rounds of each `pages` phase
against the `none` phases beside it. With two cores or more the server runs on a core of its own
and Chromium on the others, so that the browsers' drawing does not share the server's core. With
nobody watching the feed still builds a snapshot every 5 s (so that the charts have their 15
minutes when a page opens); with a page open, one a second: the difference is the page's cost,
and is in the figure. One snapshot's CPU (collect, build, encode) is also measured apart, in
process, as `build_ms`.

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


def measure(args: argparse.Namespace) -> dict[str, object]:
    from playwright.sync_api import sync_playwright

    total_s = args.rounds * 2 * (args.phase_s + 3) + 30
    phases: list[Phase] = []
    cores = sorted(os.sched_getaffinity(0))
    pin = cores[:2] if len(cores) >= 2 else []
    with ExitStack() as stack:
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
        proc = psutil.Process(server.proc.pid)
        if pin:  # the server on a core of its own
            os.sched_setaffinity(server.proc.pid, {pin[0]})
        load = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.ops",
                "--_load",
                str(server.port),
                str(args.streams),
                str(total_s),
            ],
        )
        stack.callback(load.kill)
        wait_for(
            lambda: server.metric("firsttoken_active_streams") >= args.streams * 0.98,
            timeout=60,
            interval=0.5,
        )
        time.sleep(2)
        if pin:  # Chromium (launched from here) off the server's core; the load client anywhere
            os.sched_setaffinity(0, set(cores) - {pin[0]})
        playwright = stack.enter_context(sync_playwright())
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        stack.callback(browser.close)
        for _ in range(args.rounds):
            for arm in ("none", "pages"):
                contexts = []
                if arm == "pages":
                    for _ in range(3):
                        context = browser.new_context(
                            extra_http_headers={"Authorization": f"Bearer {ADMIN}"}
                        )
                        page = context.new_page()
                        page.goto(server.url + "/ops")
                        page.wait_for_function("() => window.opsState.snapshots > 0")
                        contexts.append(context)
                time.sleep(3)  # the pages' loading done: what is measured is them open
                t0, cpu0, sent0 = sample(server, proc)
                time.sleep(args.phase_s)
                t1, cpu1, sent1 = sample(server, proc)
                phases.append(Phase(arm, t1 - t0, cpu1 - cpu0, sent1 - sent0))
                for context in contexts:
                    context.close()
                print(
                    f"  {arm:5s} {phases[-1].tokens_per_cpu_s:9.0f} tokens/CPU-s "
                    f"({phases[-1].tokens:.0f} tokens, {phases[-1].cpu_s:.2f} CPU-s)",
                    flush=True,
                )
        active = server.metric("firsttoken_active_streams")
    arms = {
        arm: sum(p.tokens for p in phases if p.arm == arm)
        / sum(p.cpu_s for p in phases if p.arm == arm)
        for arm in ("none", "pages")
    }
    # Each `pages` phase against the mean of the `none` phases beside it: the median of these
    # is less moved by a neighbour's burst than the pooled figure.
    paired = []
    for i, phase in enumerate(phases):
        if phase.arm == "pages":
            beside = [p.tokens_per_cpu_s for p in phases[max(0, i - 1) : i + 2] if p.arm == "none"]
            paired.append(1 - phase.tokens_per_cpu_s / (sum(beside) / len(beside)))
    return {
        "streams": args.streams,
        "pinned_cores": pin,
        "cost_median_of_rounds": statistics.median(paired),
        "active_at_end": active,
        "tokens_per_cpu_s": arms,
        "cost": 1 - arms["pages"] / arms["none"],
        "build_ms": build_ms(),
        "phases": [asdict(p) | {"tokens_per_cpu_s": p.tokens_per_cpu_s} for p in phases],
    }


def build_ms() -> float:
    """One snapshot (collect + build + encode) of a server with 20 routes and keys, in process."""
    from firsttoken.observability import Metrics
    from firsttoken.ops.feed import frame
    from firsttoken.ops.snapshot import Snapshots

    metrics, snaps = Metrics(), Snapshots()
    for i in range(20):
        metrics.stream_started(f"route-{i}", f"key-{i}")
        metrics.count_key_tokens(f"key-{i}", (1, 2, 3, 4))
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="50 streams, 1 round of 3 s")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where ops.json goes")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.rounds, args.phase_s = 50, 1, 3.0
    others = psutil.cpu_percent(interval=0.5) / 100 * (psutil.cpu_count() or 1)
    print(
        f"bench.ops: {args.streams} streams, {args.rounds} rounds of {args.phase_s:g} s "
        f"per arm (machine busy before: {others:.2f} cores)",
        flush=True,
    )
    result = measure(args)
    arms = result["tokens_per_cpu_s"]
    assert isinstance(arms, dict)
    print(
        f"tokens per server CPU-second: none {arms['none']:.0f}, 3 pages {arms['pages']:.0f}; "
        f"cost {float(result['cost']) * 100:+.2f} % pooled, "  # type: ignore[arg-type]
        f"{float(result['cost_median_of_rounds']) * 100:+.2f} % median of rounds "  # type: ignore[arg-type]
        "(target <= 2 %); "
        f"one snapshot {float(result['build_ms']):.2f} ms"  # type: ignore[arg-type]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ops.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
