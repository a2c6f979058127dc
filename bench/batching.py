"""Batching simulation: TTFT and throughput as batch_max and load grow.

    .venv/bin/python -m bench.batching            # ~2 minutes: batch_max 1,4,8,16,32 × load 1,8,32
    .venv/bin/python -m bench.batching --quick    # a few seconds
    .venv/bin/python -m bench.batching --batch-max 1,8 --loads 16 --duration-s 5

One real `firsttoken serve --batch-max B` per batch size; for each load, `load` closed-loop
clients stream chat completions (32-96 tokens) back to back for `--duration-s`. Throughput
counts the tokens received in that window (after a short warm-up). Requests still waiting
at the end get a drain of up to 2 s for their first token, then every client hangs up
(abandoned streams leave the batch: the next load starts on an empty one). A request that
never got its first token counts its wait as its TTFT (a lower bound; the `queued` column
says how many), so a saturated setting's p99 is not flattered.
Writes bench/results/batching.png and prints the table with ratios to batch_max=1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


@dataclass(slots=True)
class Run:
    batch_max: int
    load: int
    ttfts_s: list[float] = field(default_factory=list)
    queued: int = 0  # requests with no first token when the run ended
    tokens: int = 0  # content tokens received inside the measuring window
    window_s: float = 0.0

    @property
    def p50_ms(self) -> float:
        return float(np.percentile(self.ttfts_s, 50) * 1000) if self.ttfts_s else float("nan")

    @property
    def p99_ms(self) -> float:
        return float(np.percentile(self.ttfts_s, 99) * 1000) if self.ttfts_s else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.window_s if self.window_s else 0.0


class Server:
    """`python -m firsttoken serve --port 0 ARGS`, its log in a temporary file."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="ft-batching-", suffix=".log")
        cmd = [sys.executable, "-m", "firsttoken", "serve", "--port", "0", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)
        try:
            self.url = self._wait_listening()
        except BaseException:
            self.close()  # never leave a server behind
            raise

    def _wait_listening(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in Path(self.log.name).read_text(errors="replace").splitlines():
                if '"listening"' in line:
                    return str(json.loads(line)["url"])
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("server did not start:\n" + Path(self.log.name).read_text())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def _client(
    session: aiohttp.ClientSession, url: str, run: Run, i: int, t_warm: float, t_end: float
) -> None:
    rng = random.Random(i)  # answer lengths vary, so clients do not finish in lockstep
    n = 0
    while time.monotonic() < t_end:
        n += 1
        body = {
            "messages": [{"role": "user", "content": f"client {i} request {n}"}],
            "stream": True,
            "max_tokens": rng.randint(_MAX_TOKENS // 2, _MAX_TOKENS * 3 // 2),
        }
        sent = time.monotonic()
        first: float | None = None
        try:
            async with session.post(url, json=body) as r:
                async for line in r.content:
                    if line.startswith(b'data: {"id"') and b'"delta":{"content":' in line:
                        now = time.monotonic()
                        if first is None:
                            first = now - sent
                            run.ttfts_s.append(first)
                        if t_warm <= now <= t_end:
                            run.tokens += 1
                        elif now > t_end:
                            break  # its TTFT is in; hang up
        finally:
            if first is None:  # still queued when the drain ran out
                run.ttfts_s.append(time.monotonic() - sent)
                run.queued += 1


async def _drive(url: str, run: Run, duration_s: float, warmup_s: float, drain_s: float) -> None:
    endpoint = url + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic()
        t_warm, t_end = start + warmup_s, start + duration_s
        tasks = [
            asyncio.create_task(_client(session, endpoint, run, i, t_warm, t_end))
            for i in range(run.load)
        ]
        # After the window, requests in flight get `drain_s` more for their first token.
        await asyncio.wait(tasks, timeout=t_end + drain_s - time.monotonic())
        for task in tasks:
            task.cancel()  # hang up mid-stream: those sequences must leave the batch
        await asyncio.gather(*tasks, return_exceptions=True)
    run.window_s = duration_s - warmup_s


_MAX_TOKENS = 64


def sweep(batch_sizes: list[int], loads: list[int], duration_s: float) -> list[Run]:
    runs: list[Run] = []
    warmup_s = min(0.5, duration_s / 4)
    drain_s = min(2.0, duration_s / 3)
    for b in batch_sizes:
        server = Server(
            "--batch-max", str(b),
            "--rate-limit-per-s", "0", "--ttft-slo-ms", "0", "--breaker-error-rate", "1",
            "--max-streams-per-key", "1000",
        )  # fmt: skip
        try:
            for load in loads:
                run = Run(b, load)
                asyncio.run(_drive(server.url, run, duration_s, warmup_s, drain_s))
                runs.append(run)
                print(
                    f"  batch_max={b:<3} load={load:<3} ttft p50 {run.p50_ms:8.1f} ms  "
                    f"p99 {run.p99_ms:8.1f} ms  {run.tokens_per_s:7.1f} tok/s",
                    flush=True,
                )
                time.sleep(0.3)  # the hung-up streams leave the batch at the next step
        finally:
            server.close()
    return runs


def table(runs: list[Run]) -> str:
    base = {r.load: r for r in runs if r.batch_max == 1}
    head = (
        f"{'batch_max':>9} {'load':>5} {'ttft p50 ms':>12} {'ttft p99 ms':>12} "
        f"{'tok/s':>8} {'queued':>6} {'tok/s ×b1':>10} {'p50 ×b1':>8} {'p99 ×b1':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(runs, key=lambda r: (r.load, r.batch_max)):
        b1 = base.get(r.load)

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.2f}" if b else "-"

        lines.append(
            f"{r.batch_max:>9} {r.load:>5} {r.p50_ms:>12.1f} {r.p99_ms:>12.1f} "
            f"{r.tokens_per_s:>8.1f} {r.queued:>6} "
            f"{ratio(r.tokens_per_s, b1.tokens_per_s) if b1 else '-':>10} "
            f"{ratio(r.p50_ms, b1.p50_ms) if b1 else '-':>8} "
            f"{ratio(r.p99_ms, b1.p99_ms) if b1 else '-':>8}"
        )
    return "\n".join(lines)


def chart(runs: list[Run], path: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tps) = plt.subplots(1, 2, figsize=(12, 4.8))
    for load in sorted({r.load for r in runs}):
        rs = sorted((r for r in runs if r.load == load), key=lambda r: r.batch_max)
        xs = [r.batch_max for r in rs]
        (line,) = ax_ttft.plot(xs, [r.p50_ms for r in rs], "o-", label=f"load {load} p50")
        ax_ttft.plot(
            xs, [r.p99_ms for r in rs], "s--", color=line.get_color(), label=f"load {load} p99"
        )
        ax_tps.plot(xs, [r.tokens_per_s for r in rs], "o-", label=f"load {load}")
    for ax in (ax_ttft, ax_tps):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch_max")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT (ms, log)")
    ax_ttft.set_title("TTFT p50 / p99")
    ax_tps.set_ylabel("tokens/s (all streams)")
    ax_tps.set_title("throughput")
    fig.suptitle(f"firsttoken batching simulation ({note})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="tiny sweep, a few seconds")
    ap.add_argument("--batch-max", type=_ints, default=None, help="e.g. 1,4,8,16,32")
    ap.add_argument("--loads", type=_ints, default=None, help="concurrent clients, e.g. 1,8,32")
    ap.add_argument("--duration-s", type=float, default=None, help="seconds per setting")
    ap.add_argument("--out", type=Path, default=RESULTS / "batching.png")
    args = ap.parse_args(argv)
    batch_sizes = args.batch_max or ([1, 8] if args.quick else [1, 4, 8, 16, 32])
    loads = args.loads or ([8] if args.quick else [1, 8, 32])
    duration = args.duration_s or (1.5 if args.quick else 6.0)
    note = (
        f"answers of {_MAX_TOKENS // 2}-{_MAX_TOKENS * 3 // 2} tokens, "
        "step 10 ms + 1.5 ms/seq, batch timeout 50 ms"
    )
    print(f"batching sweep: batch_max {batch_sizes} × load {loads}, {duration:g} s each")
    runs = sweep(batch_sizes, loads, duration)
    print()
    print(table(runs))
    chart(runs, args.out, note)
    print(f"\nchart: {args.out}")


if __name__ == "__main__":
    main()
