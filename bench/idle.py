"""What a server costs while nothing happens: CPU and wake-ups per second, idle.

    .venv/bin/python -m bench.idle [--rev REV] [--seconds 20]

Starts firsttoken (the synthetic engine, in-memory state: `./scripts/serve`'s server), the
relay (`--engine openai --upstream` in front of `bench.servers.mock_upstream`), the same two
from `--rev` when given, and the floors (`uvicorn_floor`, `byte_pipe`) side by side; waits
until they have settled, then reads each process's schedstat over `--seconds`: CPU time, and
the times it was put on a CPU (each a wake-up from sleep: a timer or an I/O event, and in a
VM an exit from the vCPU's halt).

Why it matters beyond the idle machine: a relay at one stream does little else, so its CPU
per relayed token is mostly the cost of its idle wake-ups (`bench.gateways` at c=1), and
every periodic wake-up is a loop turn a request arriving then waits behind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from bench.procs import ROOT, check_out
from bench.servers import ServerSpec
from bench.stats import loadavg

SETTLE_S = 3.0


class Process(NamedTuple):
    proc: subprocess.Popen[bytes]
    url: str


def schedstat(pid: int) -> tuple[int, int]:
    """(ns on a CPU, times put on a CPU), over every thread of `pid`."""
    ns = slices = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                on_cpu, _, count = f.read().split()
        except (OSError, ValueError):
            continue  # a thread that just ended
        ns += int(on_cpu)
        slices += int(count)
    return ns, slices


def _launch(name: str, args: Sequence[str], logs: Path, cwd: Path | None = None) -> Process:
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=cwd or ROOT, stdout=sink, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if '"listening"' in line:
                listening = json.loads(line)
                return Process(proc, listening.get("url") or listening["urls"][0])
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{name} did not start: {log.read_text(errors='replace')[-1500:]}")


def run(rev: str | None, seconds: float, out: Path) -> dict[str, dict[str, float]]:
    logs = out / "logs"
    running: dict[str, Process] = {}
    try:
        mock = running["mock_upstream"] = _launch(
            "mock", ["bench.servers.mock_upstream", "serve"], logs
        )
        serve = ["firsttoken", "serve", "--port", "0"]
        relay = [*serve, "--engine", "openai", "--upstream", mock.url]
        old = None
        if rev:
            spec = ServerSpec("old", "old", "firsttoken", has_metrics=False, rev=rev)
            old = check_out(spec, out).cwd
        subjects: list[tuple[str, list[str], Path | None]] = [
            ("firsttoken", serve, None),
            ("relay", relay, None),
        ]
        if rev:
            subjects += [(f"firsttoken@{rev}", serve, old), (f"relay@{rev}", relay, old)]
        for name, args, cwd in (
            *subjects,
            ("uvicorn_floor", ["bench.servers.uvicorn_floor", "serve"], None),
            ("byte_pipe", ["bench.servers.byte_pipe", "serve", "--upstream", mock.url], None),
        ):
            running[name] = _launch(name.replace("@", "-"), args, logs, cwd)
        time.sleep(SETTLE_S)
        before = {name: schedstat(p.proc.pid) for name, p in running.items()}
        time.sleep(seconds)
        after = {name: schedstat(p.proc.pid) for name, p in running.items()}
    finally:
        for p in running.values():
            p.proc.terminate()
        for p in running.values():
            p.proc.wait(timeout=10)
    return {
        name: {
            "cpu_ms_per_s": (after[name][0] - before[name][0]) / 1e6 / seconds,
            "wakeups_per_s": (after[name][1] - before[name][1]) / seconds,
        }
        for name in before
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__)
    parser.add_argument("--rev", help="also run firsttoken and its relay at this commit")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to read (20)")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error(f"--seconds must be more than 0, not {args.seconds:g}")
    load = loadavg()
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        try:
            res = run(args.rev, args.seconds, Path(tmp))
        except RuntimeError as exc:
            print(f"bench.idle: {exc}", file=sys.stderr)
            return 1
    print(f"idle for {args.seconds:g} s (load average {load})")
    print(f"{'server':<28} {'CPU ms per s':>12} {'wake-ups per s':>15}")
    for name, row in res.items():
        print(f"{name:<28} {row['cpu_ms_per_s']:>12.2f} {row['wakeups_per_s']:>15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
