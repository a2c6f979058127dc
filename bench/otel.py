"""What `--otlp-endpoint` costs: server CPU per stream and TTFT with export off and on, and
with a collector that is away or slow.

    .venv/bin/python -m bench.otel [--streams N] [--tokens N] [--ramp-s S] [--quick]

Each scenario starts a fresh `firsttoken serve` (synthetic engine, each stream 20 ms to its
first token and 2 ms per token after it) and runs the same N Chat Completions streams, started
evenly over `--ramp-s`, read by the bench's raw socket client (bench/load.py). Scenarios:

- `off`: no export (the default).
- `on`: export to a live OTLP/HTTP receiver on loopback (tests/otlp.py, which decodes every
  request as a collector would: its CPU is its own process's, not the server's).
- `down`: `--otlp-endpoint` at a closed port: every batch fails and its spans are dropped.
- `slow`: a receiver that answers each request after 2 s: the queue fills and spans drop.
- `relay off` / `relay on`: the gateway as a relay (`--engine openai --upstream`) in front of
  a synthetic upstream that does not export; the gateway's CPU is measured (a span and a leg
  span per stream, one histogram record per upstream chunk).

Batches leave every 500 ms (OTEL_BSP_SCHEDULE_DELAY) instead of the SDK's 5 s, so the export
thread's work falls inside the measured window. Figures: the server process's CPU (every
thread: the export thread's encoding and HTTP calls included) over the run and one second
after it, per stream; client-side TTFT p50/p99 (request sent to the first content chunk);
streams completed; spans dropped (`firsttoken_otel_dropped_total`; for `down`, read once the
exporter has given up on the run's batches) and spans the receiver had got by then (warm-up
streams included).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np
import psutil

from bench.expected import RequestSpec
from bench.load import Plan, drive
from tests.otlp import Collector, run_collector
from tests.servers import Server, run_server

OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0", "--ttft-slo-ms", "0")
EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "500", "OTEL_METRIC_EXPORT_INTERVAL": "1000"}


@dataclass
class Result:
    scenario: str
    streams: int
    completed: int
    cpu_us_per_stream: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    dropped: int
    received: int


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_CONTENT = re.compile(rb'"content":"[^"]')  # a content delta with text (not the role's "")


def _ttft_ms(reads: list[tuple[float, bytes]], sent: float) -> float | None:
    for t, data in reads:
        if _CONTENT.search(data):
            return (t - sent) * 1000
    return None


@contextmanager
def _scenario(name: str) -> Iterator[tuple[Server, Collector | None]]:
    """The server under test (and its collector), as the scenario says."""
    with ExitStack() as stack:
        collector: Collector | None = None
        export: tuple[str, ...] = ()
        if name.endswith("on"):
            collector = stack.enter_context(run_collector())
            export = ("--otlp-endpoint", collector.url)
        elif name == "slow":
            collector = stack.enter_context(run_collector(delay_s=2.0))
            export = ("--otlp-endpoint", collector.url)
        elif name == "down":
            export = ("--otlp-endpoint", f"http://127.0.0.1:{_closed_port()}")
        if name.startswith("relay"):
            upstream = stack.enter_context(run_server(*OPEN))
            relay = ("--engine", "openai", "--upstream", upstream.v1)
            server = stack.enter_context(run_server(*relay, *OPEN, *export, env=EXPORT))
        else:
            server = stack.enter_context(run_server(*OPEN, *export, env=EXPORT))
        yield server, collector


def run_one(name: str, streams: int, tokens: int, ramp_s: float) -> Result:
    with _scenario(name) as (server, collector):
        proc = psutil.Process(server.proc.pid)
        specs = [RequestSpec(i, tokens, 20.0, 2.0) for i in range(streams)]
        # A few streams first: imports, caches and the exporter's connection are warm.
        asyncio.run(drive("127.0.0.1", server.port, Plan(specs[:20], 0.2, 30.0)))
        time.sleep(1.0)
        before = proc.cpu_times()
        run = asyncio.run(drive("127.0.0.1", server.port, Plan(specs, ramp_s, ramp_s + 60.0)))
        time.sleep(1.0)  # the batches of the run's last spans leave too
        after = proc.cpu_times()
        cpu_s = (after.user - before.user) + (after.system - before.system)
        ttfts = [_ttft_ms(c.reads, c.t_sent) for c in run.captures]
        measured = np.array([t for t in ttfts if t is not None])
        dropped = int(server.metric("firsttoken_otel_dropped_total"))
        if name == "down":  # a failed batch counts once the exporter gives up on it (5 s)
            deadline = time.monotonic() + 15
            while dropped < streams and time.monotonic() < deadline:
                time.sleep(0.5)
                dropped = int(server.metric("firsttoken_otel_dropped_total"))
        received = 0
        if collector is not None:
            with collector.lock:
                received = len(collector.spans)
        return Result(
            scenario=name,
            streams=streams,
            completed=sum(c.done_seen for c in run.captures),
            cpu_us_per_stream=cpu_s / streams * 1e6,
            ttft_p50_ms=float(np.percentile(measured, 50)) if measured.size else float("nan"),
            ttft_p99_ms=float(np.percentile(measured, 99)) if measured.size else float("nan"),
            dropped=dropped,
            received=received,
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.otel", description=__doc__)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=20, help="tokens per stream")
    parser.add_argument("--ramp-s", type=float, default=10.0, help="streams start over this long")
    parser.add_argument("--quick", action="store_true", help="100 streams over 1 s (a smoke test)")
    parser.add_argument(
        "--scenarios", default="off,on,down,slow,relay off,relay on", help="comma-separated"
    )
    args = parser.parse_args()
    if args.quick:
        args.streams, args.ramp_s = 100, 1.0
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"bench.otel: {args.streams} streams of {args.tokens} tokens over {args.ramp_s:g} s, "
        f"commit {commit}, {psutil.cpu_count()} CPUs, Python {sys.version.split()[0]}"
    )
    header = "scenario    completed  CPU/stream  TTFT p50  TTFT p99  dropped  received"
    print(header)
    for name in args.scenarios.split(","):
        r = run_one(name.strip(), args.streams, args.tokens, args.ramp_s)
        print(
            f"{r.scenario:<11} {r.completed:>5}/{r.streams:<5} {r.cpu_us_per_stream:>7.0f} µs "
            f"{r.ttft_p50_ms:>6.1f} ms {r.ttft_p99_ms:>6.1f} ms {r.dropped:>8} {r.received:>9}",
            flush=True,
        )


if __name__ == "__main__":
    main()
