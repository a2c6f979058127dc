"""HTTP server: uvicorn or granian? Bare servers side by side, against the raw asyncio floor.

    .venv/bin/python -m bench.http_servers [--quick] [--idle-conns 3000] [--out DIR]

Issue 12 blames three failing targets (RSS per waiting stream ≤ 12 KiB, burst added TTFT p50
÷ floor ≤ 2, tokens per server CPU-second) partly on uvicorn's per-connection costs. This
measures, in ONE run, what the HTTP layer alone costs under each candidate, with the least
app each allows (nothing of firsttoken in them):

- `raw`: asyncio Protocol on uvloop (mirrors `servers/raw_floor.py`; `servers/bare_raw.py`);
  a token is `transport.write` from the shared ticker.
- `uvicorn`: uvicorn + httptools + uvloop, access log off, serving `servers/bare_asgi.py`;
  a token is ASGI `await send` from the stream's task, woken by the shared tick.
- `uvicorn_direct`: the same, its protocol puts itself in the scope (as firsttoken's
  `wire/connection.py` does); a token is a chunked frame `transport.write` from the shared
  ticker (firsttoken's data plane).
- `granian_asgi`: granian `--interface asginl --loop uvloop --http 1`, the same app; a token
  is ASGI `await send` from the stream's task.
- `granian_asgi_nowait`: the same; granian's ASGI `send` is called from the ticker and not
  awaited. That works under granian (its `send` is a Rust function that does its work when
  called and returns a finished awaitable), outside ASGI's contract.
- `granian_rsgi`: granian `--interface rsgi --loop uvloop --http 1`, `servers/bare_rsgi.py`;
  a token is the RSGI `response_stream` transport's `send_bytes`, called from the ticker, not
  awaited (it queues on an unbounded channel to the Rust side, returns a finished awaitable).

`*_direct`/`*_nowait` run the streaming workload only (idle and burst are the same code as
their plain row). Every server answers the load client's usual request (`POST
/v1/chat/completions`, `Connection: close`; bench/load.py) and reads its body; the mode is
fixed per process (`BARE_MODE`), a fresh process per server and workload:

1. **idle** — N connections (default 3,000) each with an open `text/event-stream` response
   that has sent its headers and one comment (`: open`), and nothing after. RSS of the server
   process tree (granian: the supervisor and its worker process, each with its threads) from
   `/proc/PID/statm`, before (after a warm-up of 20 streams, closed) and with all N open:
   KiB per connection = ΔRSS ÷ N.
2. **burst** — 100 requests at the same instant (no ramp), each answered with one SSE event
   then the end of the response; five rounds. Time to first byte (request written → first
   byte read, client clock) p50/p99 over the 500; server CPU per request = Δ(time on CPU of
   every thread of every process in the tree) ÷ requests, from `/proc/PID/task/TID/schedstat`
   (ns; `/proc/PID/stat`'s utime+stime count 10 ms ticks, too coarse here: kept in the JSON
   as a cross-check).
3. **stream** — 200 streams started over 1 s, 100 tokens each at 20 ms ITL, driven by ONE
   shared loop timer in the server that writes a prebuilt OpenAI chunk frame to every live
   stream per tick (firsttoken's data-plane shape). Server CPU (as in 2.) per token delivered.

Ratios are to `raw`. The machine is shared and noisy: run it twice, trust ratios over
absolutes. Results also go to OUT/http_servers.json (default bench/results/).

granian is **`granian[uvloop]==2.8.9`** (the latest release when this was written), in its
own venv so the project's dependencies do not change; the bench looks for
`.venv/granian/bin/granian` (or `--granian PATH`, `$BENCH_GRANIAN`):

    python3.11 -m venv .venv/granian && .venv/granian/bin/pip install 'granian[uvloop]==2.8.9'

The bare apps it serves import only the standard library (`servers/bare_common.py`). granian
runs with `--http 1` (HTTP/1.1 only, like uvicorn: its default `auto` also listens for
HTTP/2 and costs ~10 KiB more per idle connection, 26–28 against 16–17 KiB here), `--backlog
4096 --backpressure 16384` (its default backpressure, backlog ÷ workers, would cap concurrent
requests per worker at the backlog) and its default runtime threads; `--granian-args` adds
more options (on top of `--http 1`, `--http1-buffer-size 8192` and one blocking thread changed
the idle figure by < 0.1 KiB).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from bench.expected import PROMPT_VARIANTS, RequestSpec
from bench.load import Capture, Plan, Run, drive
from bench.procs import ROOT, cpu_sample, raise_fd_limit

__all__ = ["main"]

GRANIAN_VERSION = "2.8.9"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
WORKLOADS = ("idle", "burst", "stream")
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MARK = b"chat.completion.chunk"  # once per frame (bare_common.FRAME)


def _log(msg: str) -> None:
    print(f"[http_servers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    idle_conns: int = 3000
    burst: int = 100
    burst_rounds: int = 5
    streams: int = 200
    tokens: int = 100
    itl_ms: float = 20.0
    ramp_s: float = 1.0

    @classmethod
    def quick(cls) -> Sizes:
        return cls(idle_conns=200, burst=20, burst_rounds=2, streams=20, tokens=10)


# --- the servers ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bare:
    name: str
    label: str
    granian: str | None  # granian interface, or None for a `python -m` server
    target: str  # module (python -m) or granian target
    direct: bool = False
    workloads: tuple[str, ...] = WORKLOADS

    def command(self, port: int, granian: Path | None, extra: Sequence[str] = ()) -> list[str]:
        if self.granian is None:
            return [sys.executable, "-m", self.target, "--port", str(port)]
        assert granian is not None
        return [
            str(granian),
            "--interface",
            self.granian,
            "--loop",
            "uvloop",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backlog",
            "4096",
            "--backpressure",
            "16384",
            "--no-ws",
            "--http",
            "1",  # HTTP/1.1 only, as uvicorn (auto would sniff for HTTP/2: +10 KiB per conn)
            "--log-level",
            "warning",
            "--working-dir",
            str(ROOT),
            *extra,
            self.target,
        ]


SERVERS = (
    Bare("raw", "raw asyncio floor", None, "bench.servers.bare_raw"),
    Bare("uvicorn", "uvicorn+httptools ASGI", None, "bench.servers.bare_uvicorn"),
    Bare(
        "uvicorn_direct",
        "uvicorn, transport.write",
        None,
        "bench.servers.bare_uvicorn",
        direct=True,
        workloads=("stream",),
    ),
    Bare("granian_asgi", "granian ASGI", "asginl", "bench.servers.bare_asgi:app"),
    Bare(
        "granian_asgi_nowait",
        "granian ASGI, send not awaited",
        "asginl",
        "bench.servers.bare_asgi:app",
        direct=True,
        workloads=("stream",),
    ),
    Bare("granian_rsgi", "granian RSGI", "rsgi", "bench.servers.bare_rsgi:app"),
)


def find_granian(given: str | None) -> Path | None:
    for c in (given, os.environ.get("BENCH_GRANIAN"), str(ROOT / ".venv/granian/bin/granian")):
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


def granian_version(binary: Path) -> str | None:
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.strip().split()[-1] if out.strip() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- /proc ------------------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    """`pid` and every live descendant (granian: supervisor + worker processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                continue
    return out


def _rss(pids: Sequence[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * _PAGE
        except OSError:
            continue
    return total


def _cpu(pids: Sequence[int]) -> float:
    """utime + stime of each process (all its threads), in seconds."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / _CLK_TCK


def _oncpu(pids: Sequence[int]) -> float:
    """Time on CPU of every thread of each process (`/proc/PID/task/TID/schedstat`, ns), in s.

    Nanosecond resolution: `stat`'s utime+stime count 10 ms ticks, too coarse for 100 requests
    at a fraction of a millisecond each. (A thread that exits takes its time with it; `_cpu`
    keeps it, and the JSON has both.)"""
    total = 0
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


def _threads(pids: Sequence[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            out.append(len(os.listdir(f"/proc/{p}/task")))
        except OSError:
            out.append(0)
    return out


class Proc:
    def __init__(
        self,
        bare: Bare,
        workload: str,
        sizes: Sizes,
        granian: Path | None,
        logs: Path,
        granian_args: Sequence[str] = (),
    ):
        self.bare = bare
        self.port = _free_port()
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "BARE_MODE": workload,
            "BARE_TOKENS": str(sizes.tokens),
            "BARE_ITL_MS": str(sizes.itl_ms),
            "BARE_DIRECT": "1" if bare.direct else "0",
            "BARE_SERVER": "granian" if bare.granian else "python",
        }
        logs.mkdir(parents=True, exist_ok=True)
        self.log = logs / f"{bare.name}-{workload}.log"
        with self.log.open("wb") as sink:
            self.proc = subprocess.Popen(
                bare.command(self.port, granian, granian_args),
                cwd=ROOT,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )

    def pids(self) -> list[int]:
        return _tree(self.proc.pid)

    async def ready(self, within_s: float = 30.0) -> None:
        """The port accepts connections (a granian worker may still be starting: the warm-up
        requests wait for it in the backlog)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.bare.name} did not start; log:\n{self.tail()}")

    def tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- workloads --------------------------------------------------------------------------------


def _specs(n: int, sizes: Sizes) -> list[RequestSpec]:
    return [RequestSpec(i % PROMPT_VARIANTS, sizes.tokens, 0.0, sizes.itl_ms) for i in range(n)]


async def _open_and_wait(run: Run, within_s: float) -> int:
    """Open every stream; wait until each has read its first bytes. Returns how many did."""
    await run.open_all()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        opened = sum(1 for c in run.captures if c.reads)
        failed = sum(1 for c in run.captures if c.error or c.t_closed)
        if opened + failed >= len(run.captures):
            break
        await asyncio.sleep(0.1)
    return sum(1 for c in run.captures if c.reads and not c.t_closed)


async def warm_up(proc: Proc, sizes: Sizes, *, n: int = 20, endless: bool = False) -> None:
    """A few requests first (lazy imports, first allocations): not counted in any figure.

    `endless`: the server never ends these responses (idle mode); the client closes them."""
    run = Run("127.0.0.1", proc.port, Plan(_specs(n, sizes), ramp_s=0.2, deadline_s=30))
    await _open_and_wait(run, 30.0)
    await run.wait_closed(0.5 if endless else 10.0)
    await run.close_all(expected=True)
    await asyncio.sleep(1.0)


@dataclass(slots=True)
class Row:
    name: str
    label: str
    processes: int = 0
    threads: list[int] = field(default_factory=list)
    idle: dict[str, Any] = field(default_factory=dict)
    burst: dict[str, Any] = field(default_factory=dict)
    stream: dict[str, Any] = field(default_factory=dict)


async def idle(proc: Proc, sizes: Sizes, row: Row) -> None:
    await warm_up(proc, sizes, endless=True)
    pids = proc.pids()
    rss0 = _rss(pids)
    n = sizes.idle_conns
    plan = Plan(_specs(n, sizes), ramp_s=max(1.0, n / 2000), deadline_s=120)
    run = Run("127.0.0.1", proc.port, plan)
    t0 = time.perf_counter()
    opened = await _open_and_wait(run, 60.0)
    open_s = time.perf_counter() - t0
    await asyncio.sleep(2.0)  # let the server settle (allocator, lazily created objects)
    pids = proc.pids()
    rss1 = _rss(pids)
    still = sum(1 for c in run.captures if c.reads and not c.t_closed)
    row.processes = len(pids)
    row.threads = _threads(pids)
    await run.close_all(expected=True)
    per = (rss1 - rss0) / still / 1024 if still else None
    row.idle = {
        "connections": n,
        "open": still,
        "opened_at_first": opened,
        "open_s": round(open_s, 2),
        "rss_before_mib": round(rss0 / 2**20, 1),
        "rss_open_mib": round(rss1 / 2**20, 1),
        "kib_per_conn": round(per, 2) if per is not None else None,
        "errors": sum(1 for c in run.captures if c.error),
    }


def _ttfb_ms(cap: Capture) -> float | None:
    return (cap.reads[0][0] - cap.t_sent) * 1000 if cap.reads and cap.t_sent else None


async def burst(proc: Proc, sizes: Sizes, row: Row) -> None:
    await warm_up(proc, sizes)
    pids = proc.pids()
    ttfbs: list[float] = []
    cpu_s = tick_s = 0.0
    ok = requests = 0
    for _ in range(sizes.burst_rounds):
        plan = Plan(_specs(sizes.burst, sizes), ramp_s=0.0, deadline_s=30, connect_limit=256)
        c0, t0 = _oncpu(pids), _cpu(pids)
        run = await drive("127.0.0.1", proc.port, plan)
        cpu_s += _oncpu(pids) - c0
        tick_s += _cpu(pids) - t0
        requests += len(run.captures)
        for cap in run.captures:
            t = _ttfb_ms(cap)
            if t is not None:
                ttfbs.append(t)
            if _MARK in b"".join(d for _, d in cap.reads) and not cap.error:
                ok += 1
        await asyncio.sleep(0.5)
    arr = np.asarray(ttfbs)
    row.burst = {
        "requests": requests,
        "answered": ok,
        "ttfb_ms_p50": round(float(np.percentile(arr, 50)), 2) if arr.size else None,
        "ttfb_ms_p99": round(float(np.percentile(arr, 99)), 2) if arr.size else None,
        "cpu_ms_per_request": round(cpu_s / requests * 1000, 3) if requests else None,
        "stat_cpu_ms_per_request": round(tick_s / requests * 1000, 3) if requests else None,
    }


async def stream(proc: Proc, sizes: Sizes, row: Row) -> None:
    await warm_up(proc, sizes, n=5)
    pids = proc.pids()
    plan = Plan(_specs(sizes.streams, sizes), ramp_s=sizes.ramp_s, deadline_s=60)
    s0, c0, t0 = cpu_sample(), _oncpu(pids), _cpu(pids)
    run = await drive("127.0.0.1", proc.port, plan)
    cpu_s = _oncpu(pids) - c0
    tick_s = _cpu(pids) - t0
    wall, client, busy = cpu_sample().since(s0)
    tokens = complete = 0
    gaps: list[np.ndarray] = []
    for cap in run.captures:
        body = b"".join(d for _, d in cap.reads)
        got = body.count(_MARK)
        tokens += got
        complete += got == sizes.tokens and b"[DONE]" in body and not cap.error
        times = [t for t, d in cap.reads if _MARK in d]
        if len(times) > 1:
            gaps.append(np.diff(np.asarray(times)) * 1000)
    gap = np.concatenate(gaps) if gaps else np.zeros(0)
    row.stream = {
        "streams": sizes.streams,
        "complete": complete,
        "tokens": tokens,
        "server_cpu_s": round(cpu_s, 3),
        "stat_cpu_s": round(tick_s, 3),
        "us_per_token": round(cpu_s / tokens * 1e6, 2) if tokens else None,
        "tokens_per_cpu_s": round(tokens / cpu_s) if cpu_s > 0 else None,
        "gap_ms_p99": round(float(np.percentile(gap, 99)), 1) if gap.size else None,
        "server_cores": round(cpu_s / wall, 2) if wall else None,
        "client_cores": round(client / wall, 2) if wall else None,
        "others_cores": round(max(0.0, (busy - cpu_s - client) / wall), 2) if wall else None,
    }


RUNNERS = {"idle": idle, "burst": burst, "stream": stream}


# --- report -----------------------------------------------------------------------------------


def _ratio(value: float | None, floor: float | None) -> str:
    if value is None or not floor:
        return "—"
    return f"×{value / floor:.2f}"


def _f(value: Any, spec: str = ",.2f") -> str:
    return "—" if value is None else format(value, spec)


def report(rows: list[Row], meta: dict[str, Any]) -> str:
    by = {r.name: r for r in rows}
    raw = by.get("raw")
    lines = [
        f"bench.http_servers — {meta['started']} — {meta['cpus']} CPUs (shared), load avg "
        f"{meta['load_start']} → {meta['load_end']}; granian {meta['granian']} "
        f"(--http 1 {' '.join(meta.get('granian_args', []))}), python {meta['python']}",
        "",
        f"IDLE — {meta['sizes']['idle_conns']:,} connections, each an open event stream "
        "(headers + one comment); ΔRSS of the server's processes ÷ connections",
    ]
    head = f"{'server':<22}{'open':>7}{'procs':>6}{'threads':>9}{'RSS base':>10}{'RSS open':>10}"
    head += f"{'KiB/conn':>10}{'÷ raw':>8}"
    lines += [head, "-" * len(head)]
    floor_kib = raw.idle.get("kib_per_conn") if raw else None
    for r in rows:
        if not r.idle:
            continue
        i = r.idle
        lines.append(
            f"{r.name:<22}{i['open']:>7}{r.processes:>6}{'+'.join(map(str, r.threads)):>9}"
            f"{i['rss_before_mib']:>10.1f}{i['rss_open_mib']:>10.1f}{_f(i['kib_per_conn']):>10}"
            f"{_ratio(i['kib_per_conn'], floor_kib):>8}"
        )
    lines += [
        "",
        f"BURST — {meta['sizes']['burst']} requests at the same instant, one SSE event each, "
        f"{meta['sizes']['burst_rounds']} rounds; TTFB = request written → first byte",
    ]
    head = f"{'server':<22}{'answered':>9}{'TTFB p50':>10}{'p99':>8}{'÷ raw p50':>10}"
    head += f"{'CPU ms/req':>11}{'÷ raw':>8}"
    lines += [head, "-" * len(head)]
    fb = raw.burst if raw else {}
    for r in rows:
        if not r.burst:
            continue
        b = r.burst
        lines.append(
            f"{r.name:<22}{b['answered']:>5}/{b['requests']:<3}{_f(b['ttfb_ms_p50']):>10}"
            f"{_f(b['ttfb_ms_p99']):>8}{_ratio(b['ttfb_ms_p50'], fb.get('ttfb_ms_p50')):>10}"
            f"{_f(b['cpu_ms_per_request'], '.3f'):>11}"
            f"{_ratio(b['cpu_ms_per_request'], fb.get('cpu_ms_per_request')):>8}"
        )
    sz = meta["sizes"]
    lines += [
        "",
        f"STREAM — {sz['streams']} streams × {sz['tokens']} tokens at {sz['itl_ms']:g} ms ITL, "
        "one shared timer writing a prebuilt frame to every stream per tick",
    ]
    head = f"{'server':<22}{'complete':>9}{'tokens':>8}{'µs/token':>10}{'tok/CPU-s':>11}"
    head += f"{'÷ raw':>8}{'gap p99':>9}{'srv cores':>10}{'others':>8}"
    lines += [head, "-" * len(head)]
    fs = raw.stream if raw else {}
    for r in rows:
        if not r.stream:
            continue
        s = r.stream
        lines.append(
            f"{r.name:<22}{s['complete']:>5}/{s['streams']:<3}{s['tokens']:>8}"
            f"{_f(s['us_per_token']):>10}{_f(s['tokens_per_cpu_s'], ',.0f'):>11}"
            f"{_ratio(s['tokens_per_cpu_s'], fs.get('tokens_per_cpu_s')):>8}"
            f"{_f(s['gap_ms_p99'], '.1f'):>9}{_f(s['server_cores']):>10}"
            f"{_f(s['others_cores']):>8}"
        )
    lines += ["", "RATIOS TO THE RAW FLOOR (lower is better; tok/CPU-s: raw ÷ server)"]
    head = f"{'server':<22}{'KiB/conn':>10}{'burst TTFB p50':>16}{'burst CPU/req':>15}"
    head += f"{'CPU/token':>11}"
    lines += [head, "-" * len(head)]
    for r in rows:
        if r.name == "raw":
            continue
        lines.append(
            f"{r.name:<22}"
            f"{_ratio(r.idle.get('kib_per_conn'), floor_kib):>10}"
            f"{_ratio(r.burst.get('ttfb_ms_p50'), fb.get('ttfb_ms_p50')):>16}"
            f"{_ratio(r.burst.get('cpu_ms_per_request'), fb.get('cpu_ms_per_request')):>15}"
            f"{_ratio(r.stream.get('us_per_token'), fs.get('us_per_token')):>11}"
        )
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------


async def _run_all(
    servers: Sequence[Bare],
    workloads: Sequence[str],
    sizes: Sizes,
    granian: Path | None,
    out: Path,
    granian_args: Sequence[str],
) -> list[Row]:
    rows = {b.name: Row(b.name, b.label) for b in servers}
    for workload in workloads:  # all servers back to back per workload: noise hits them alike
        for bare in servers:
            if workload not in bare.workloads:
                continue
            _log(f"{workload}: {bare.name}")
            proc = Proc(bare, workload, sizes, granian, out / "logs", granian_args)
            try:
                await proc.ready()
                await RUNNERS[workload](proc, sizes, rows[bare.name])
            except Exception as exc:  # one server's failure must not end the run
                _log(f"{workload}: {bare.name} failed: {exc!r}\n{proc.tail()}")
            finally:
                proc.stop()
    return list(rows.values())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.http_servers")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--idle-conns", type=int, default=None)
    parser.add_argument("--servers", default=",".join(b.name for b in SERVERS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--granian", default=None, help="path to the granian executable")
    parser.add_argument(
        "--granian-args",
        default="",
        help="more granian options, one string (e.g. '--http1-buffer-size 8192')",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.idle_conns:
        sizes = Sizes(**{**asdict(sizes), "idle_conns": args.idle_conns})
    granian = find_granian(args.granian)
    wanted = set(args.servers.split(","))
    servers = [b for b in SERVERS if b.name in wanted and (b.granian is None or granian)]
    if granian is None:
        _log("granian not found (.venv/granian/bin/granian, --granian, $BENCH_GRANIAN): skipped")
    version = granian_version(granian) if granian else None
    if version and version != GRANIAN_VERSION:
        _log(f"granian is {version}, the pinned version is {GRANIAN_VERSION}")
    limit, note = raise_fd_limit(2 * sizes.idle_conns + 1024)
    if note:
        _log(note)
    meta: dict[str, Any] = {
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "granian": version,
        "python": platform.python_version(),
        "sizes": asdict(sizes),
        "fd_limit": limit,
    }
    workloads = [w for w in WORKLOADS if w in args.workloads.split(",")]
    granian_args = args.granian_args.split()
    meta["granian_args"] = granian_args
    rows = uvloop.run(_run_all(servers, workloads, sizes, granian, args.out, granian_args))
    meta["load_end"] = [round(x, 2) for x in os.getloadavg()]
    text = report(rows, meta)
    print(text, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "http_servers.json").write_text(
        json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2)
    )
    (args.out / "http_servers.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
