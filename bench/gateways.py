"""What one hop through a gateway adds: firsttoken's relay and routes, a byte pipe and LiteLLM,
on the same zero-delay mock upstream, in one run.

    .venv/bin/python -m bench.gateways                    # about 8 minutes with LiteLLM
    .venv/bin/python -m bench.gateways --quick --no-litellm   # seconds: the smoke test
    .venv/bin/python -m bench.gateways --relay-rev 565f71b --targets direct,relay,relay_old \\
        --levels none                                     # the relay before/after, c=1 only

The upstream (`bench/servers/mock_upstream.py`) answers at once and streams 64 chunks 20 ms
apart (the method of the public gateway board), keep-alive, on three ports. In front of it:

- `direct`: the mock itself (what the client and the mock cost; every "added" is over it);
- `pipe`: `bench/servers/byte_pipe.py`, a Python byte pipe that parses nothing: the floor of a
  relay in Python;
- `relay`: `firsttoken serve --engine openai --upstream URL`;
- `route1`: `firsttoken serve --routes FILE`, one route with one `kind = "openai"` target;
- `route3`: one route over three targets (the mock's three ports), `continuation = "vllm"`,
  hedging on (the default): hedging must add no upstream request when the first answers;
- `litellm`: the LiteLLM proxy (found and run as `bench.proxies` does: `.venv/litellm`);
- `relay_old` (with `--relay-rev REV`): the relay as of another commit, same rounds;
- `relay_w2` (only when `--targets` names it): the relay with `--workers 2` (pinned with the
  other gateways under `--pin both`, so compare it with `--pin client`).

Figures:

- **c=1, paired per round**: each round sends one stream to every target in turn (the order
  rotates); a target's added TTFT in a round is its TTFT minus direct's in the same round,
  and p50/p99 are over those differences.
- **N at once** (64, 256, 1,024; `--levels`): N streams requested at the same instant; TTFT
  p50/p99, inter-chunk p99, streams complete (every token, in order, and `[DONE]`).
- **Holds**: the highest N of the ladder (`--ladder`, 64 … 1,024) at which a target keeps
  inter-chunk p99 ≤ 2× the cadence with every stream complete; a target climbs until it fails.
- **CPU**: the gateway process's CPU (schedstat, children included) over its runs at a level
  ÷ tokens delivered: CPU-seconds per million relayed tokens, and what that costs at
  `--vcpu-hour-usd` (default 0.05) per vCPU-hour.
- **Upstream requests per stream**: the mock counts what each port took.

TTFT runs from the request's write (the connection is open) to the first content chunk.
On a machine with two or more cores the load client and the mock run on core 0 and every
gateway on the other cores (`os.sched_setaffinity`; `--pin client` pins only the client and
the mock, `--pin none` nothing), so the client's and the upstream's work do not take the
gateway's CPU. On a machine shared with other work, a gateway pinned to one core also waits
behind whatever else runs there: compare `--pin client`. AIPerf is not run here
(`bench.ttft_agreement` compares an outside client with the server's own clock).
Writes `bench/results/gateways.json` and `gateways.txt`.
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
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.decode import decode
from bench.expected import PROMPT_VARIANTS, RequestSpec
from bench.load import Capture, Plan
from bench.procs import ROOT, ServerProcess, check_out, cpu_sample, raise_fd_limit
from bench.proxies import _drive as drive
from bench.proxies import find_litellm, launch_litellm, litellm_version
from bench.servers import ServerSpec
from bench.stats import loadavg

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
OPEN = ("--rate-limit-per-s", "0", "--ttft-slo-ms", "0", "--breaker-error-rate", "1")
TARGETS = ("direct", "pipe", "relay", "route1", "route3", "litellm", "relay_old")
OPTIONAL = ("relay_w2",)  # only when named in --targets
FIRSTTOKEN = ("relay", "route1", "route3", "relay_old")
LABELS = {
    "direct": "direct (mock)",
    "pipe": "byte pipe (floor)",
    "relay": "firsttoken relay",
    "route1": "route, 1 target",
    "route3": "route, 3 targets, hedged",
    "litellm": "LiteLLM",
    "relay_old": "relay (old)",
    "relay_w2": "relay, --workers 2",
}


def _log(msg: str) -> None:
    print(f"[gateways {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    tokens: int = 64
    itl_ms: float = 20.0
    rounds: int = 20  # c=1 rounds, every target once a round
    levels: tuple[int, ...] = (64, 256, 1024)  # the table's "at once" levels
    ladder: tuple[int, ...] = (64, 128, 256, 512, 1024)  # the climb for "holds"
    deadline_s: float = 60.0  # one run's bound: a gateway far behind is cut off here

    @classmethod
    def quick(cls) -> Sizes:
        return cls(tokens=8, itl_ms=10.0, rounds=2, levels=(8,), ladder=(8,), deadline_s=10.0)

    @property
    def stream_s(self) -> float:
        return self.tokens * self.itl_ms / 1000


# --- processes --------------------------------------------------------------------------------


@contextmanager
def pinned(cores: set[int] | None) -> Iterator[None]:
    """Processes started inside inherit `cores` (this process's affinity for the moment)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def launch(name: str, cmd: list[str], logs: Path, cwd: Path | None = None) -> ServerProcess:
    """A server that prints a `"listening"` JSON line; its CPU is read from schedstat."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd, cwd=cwd or ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    server = ServerProcess(ServerSpec(name, LABELS.get(name, name), cmd[2], False), proc, log)
    server.wait_ready()
    return server


def routes_file(out: Path, urls: Sequence[str]) -> tuple[Path, Path]:
    """The one-target and the three-target routes files (the route is named `synthetic`,
    what the load client asks for)."""
    one = (
        '[targets.mock]\nkind = "openai"\n'
        f'url = "{urls[0]}/v1"\nmodel = "synthetic"\n\n'
        '[models.synthetic]\ntargets = ["mock"]\n'
    )
    three = ""
    for i, url in enumerate(urls[:3]):
        three += (
            f'[targets.mock-{i + 1}]\nkind = "openai"\nurl = "{url}/v1"\n'
            'model = "synthetic"\ncontinuation = "vllm"\n\n'
        )
    three += '[models.synthetic]\ntargets = ["mock-1", "mock-2", "mock-3"]\nhedge = true\n'
    out.mkdir(parents=True, exist_ok=True)
    p1, p3 = out / "route1.toml", out / "route3.toml"
    p1.write_text(one)
    p3.write_text(three)
    return p1, p3


def mock_stats(mock: ServerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(mock.url + "/stats", timeout=5) as resp:
        stats: dict[str, Any] = json.loads(resp.read())
    return stats


def upstream_counts(mock: ServerProcess) -> list[int]:
    return list(mock_stats(mock)["requests"])


async def settle(target: ServerProcess, mock: ServerProcess, within_s: float = 90.0) -> None:
    """Wait until the last run is over for the gateway too: no answer streaming from the mock
    and the gateway nearly idle (a gateway far behind keeps working after its clients left,
    and would take the next one's CPU and upstream)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    before, asked = target.cpu_seconds(), sum(upstream_counts(mock))
    quiet = 0
    while loop.time() < end and quiet < 2:  # quiet for two samples in a row (0.5 s)
        await asyncio.sleep(0.25)
        now, stats = target.cpu_seconds(), mock_stats(mock)
        total = sum(stats["requests"])
        calm = now - before < 0.025 and not stats["active"] and total == asked
        quiet = quiet + 1 if calm else 0
        before, asked = now, total


# --- driving ----------------------------------------------------------------------------------


def _specs(n: int, sizes: Sizes, *, instant: bool = False) -> list[RequestSpec]:
    itl = 0.0 if instant else sizes.itl_ms
    return [RequestSpec(i % PROMPT_VARIANTS, sizes.tokens, 0.0, itl) for i in range(n)]


async def warm_up(server: ServerProcess, sizes: Sizes) -> None:
    """Instant streams per prompt variant, three times: imports, pools and code paths warm."""
    specs = _specs(PROMPT_VARIANTS, sizes, instant=True)
    ok = 0
    caps: list[Capture] = []
    for attempt in range(30):
        caps = (await drive(server.host, server.port, Plan(specs, 0.0, 30.0))).captures
        ok = ok + 1 if all(c.done_seen for c in caps) else 0
        if ok >= 3:
            return
        await asyncio.sleep(0.1 * (attempt + 1))
    problems = {c.error for c in caps if c.error} or {"[DONE] missing"}
    raise RuntimeError(f"{server.spec.name}: warm-up streams failed: {problems}")


@dataclass(slots=True)
class Acc:
    """One target at one level: its streams, and the CPU its process spent on them."""

    captures: list[Capture] = field(default_factory=list)
    cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    machine_busy_s: float = 0.0
    wall_s: float = 0.0
    upstream_requests: list[int] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)


async def run_once(
    target: ServerProcess, mock: ServerProcess, n: int, sizes: Sizes, acc: Acc
) -> None:
    plan = Plan(_specs(n, sizes), 0.0, sizes.deadline_s)
    before = upstream_counts(mock)
    p0, c0 = target.cpu_seconds(), cpu_sample()
    run = await drive(target.host, target.port, plan)
    p1, c1 = target.cpu_seconds(), cpu_sample()
    await settle(target, mock)
    after = upstream_counts(mock)  # a laggard's late requests are its own
    wall, client, busy = c1.since(c0)
    acc.captures += run.captures
    acc.cpu_s += p1 - p0
    acc.client_cpu_s += client
    acc.machine_busy_s += busy
    acc.wall_s += wall
    acc.lag_ms += run.lag_ms
    diff = [b - a for a, b in zip(before, after, strict=True)]
    acc.upstream_requests = [
        x + y for x, y in zip(acc.upstream_requests or [0] * len(diff), diff, strict=True)
    ]


def _pct(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    arr = np.asarray(values, dtype=float)
    return float(np.percentile(arr, q)) if arr.size else None


@dataclass(slots=True)
class Streams:
    """What a target's streams at one level came to."""

    ttfts_ms: list[float]
    gaps_ms: np.ndarray
    complete: int
    tokens: int
    problems: dict[str, int]


def streams(captures: Sequence[Capture]) -> Streams:
    problems: Counter[str] = Counter()
    ttfts: list[float] = []
    gaps: list[np.ndarray] = []
    complete = tokens = 0
    for cap in captures:
        d = decode(cap)
        expected = cap.spec.tokens()
        tokens += d.received_tokens(expected)
        if d.problem:
            problems[d.problem.split(":", 1)[0][:80]] += 1
        elif d.done and "".join(d.contents) == "".join(expected):
            complete += 1
        else:
            problems["incomplete or text differs"] += 1
        if d.times:
            ttfts.append((d.times[0] - cap.t_sent) * 1000)
            gaps.append(np.diff(np.asarray(d.times)) * 1000)
        elif cap.error and not d.problem:
            problems[cap.error.split(":", 1)[0][:80]] += 1
    gap_all = np.concatenate(gaps) if gaps else np.zeros(0)
    return Streams(ttfts, gap_all, complete, tokens, dict(problems))


def level_row(name: str, n: int, acc: Acc, sizes: Sizes, price: float) -> dict[str, Any]:
    s = streams(acc.captures)
    gap_p99 = _pct(s.gaps_ms, 99)
    per_mtok = acc.cpu_s / s.tokens * 1e6 if s.tokens else None
    wall = acc.wall_s or 1e-9
    holds = s.complete == len(acc.captures) and gap_p99 is not None
    holds = holds and gap_p99 <= 2 * sizes.itl_ms  # type: ignore[operator]
    lag = np.asarray(acc.lag_ms)
    return {
        "target": name,
        "at_once": n,
        "streams": len(acc.captures),
        "complete": s.complete,
        "problems": s.problems,
        "ttft_ms_p50": _pct(s.ttfts_ms, 50),
        "ttft_ms_p99": _pct(s.ttfts_ms, 99),
        "gap_ms_p50": _pct(s.gaps_ms, 50),
        "gap_ms_p99": gap_p99,
        "holds": holds,
        "tokens": s.tokens,
        "cpu_s": acc.cpu_s,
        "cpu_s_per_mtok": per_mtok,
        "usd_per_mtok": per_mtok / 3600 * price if per_mtok is not None else None,
        "cpu_share": acc.cpu_s / wall,
        "client_cpu_share": acc.client_cpu_s / wall,
        "client_lag_ms_max": float(lag.max()) if lag.size else None,
        "others_cores": max(0.0, acc.machine_busy_s - acc.cpu_s - acc.client_cpu_s) / wall,
        "upstream_requests": acc.upstream_requests,
        "upstream_requests_per_stream": sum(acc.upstream_requests) / len(acc.captures)
        if acc.captures and acc.upstream_requests
        else None,
    }


def paired_row(
    name: str, ttfts: list[float | None], direct: list[float | None], acc: Acc, price: float
) -> dict[str, Any]:
    """c=1: this target's TTFT minus direct's, round by round."""
    added = [t - d for t, d in zip(ttfts, direct, strict=True) if t is not None and d is not None]
    s = streams(acc.captures)
    per_mtok = acc.cpu_s / s.tokens * 1e6 if s.tokens else None
    return {
        "target": name,
        "rounds": len(ttfts),
        "complete": s.complete,
        "problems": s.problems,
        "ttft_ms_p50": _pct([t for t in ttfts if t is not None], 50),
        "added_ttft_ms_p50": _pct(added, 50),
        "added_ttft_ms_p99": _pct(added, 99),
        "added_ttft_ms_mean": float(np.mean(added)) if added else None,
        "gap_ms_p99": _pct(s.gaps_ms, 99),
        "cpu_s_per_mtok": per_mtok,
        "usd_per_mtok": per_mtok / 3600 * price if per_mtok is not None else None,
        "upstream_requests": acc.upstream_requests,
    }


# --- orchestration ----------------------------------------------------------------------------


async def bench(args: argparse.Namespace, sizes: Sizes, res: dict[str, Any]) -> None:
    out: Path = args.out
    logs = out / "gateway-logs"
    cores = sorted(os.sched_getaffinity(0))
    client_core = gateway_core = None
    if args.pin != "none" and len(cores) >= 2:
        client_core = {cores[0]}
        where = f"load client and mock upstream on core {cores[0]}"
        if args.pin == "both":
            gateway_core = set(cores[1:])
            where += f", every gateway on core(s) {','.join(map(str, cores[1:]))}"
        else:
            where += ", gateways unpinned"
        res["meta"]["pinning"] = where
    else:
        res["meta"]["pinning"] = "none (--pin none, or one core)"
    wanted = [t for t in args.targets.split(",") if t] if args.targets else list(TARGETS)
    if "relay_old" in wanted and not args.relay_rev:
        wanted.remove("relay_old")
    if args.relay_rev and "relay_old" not in wanted:
        wanted.append("relay_old")
    if args.no_litellm and "litellm" in wanted:
        wanted.remove("litellm")
        res["meta"]["litellm"]["status"] = "skipped (--no-litellm)"
    if "direct" not in wanted:
        wanted.insert(0, "direct")
    procs: list[ServerProcess] = []
    py = sys.executable
    try:
        with pinned(client_core):
            mock = launch(
                "direct",
                [py, "-m", "bench.servers.mock_upstream", "serve", "--ports", "3"],
                logs,
            )
        procs.append(mock)
        urls = json.loads(
            next(line for line in mock.log.read_text().splitlines() if '"listening"' in line)
        )["urls"]
        r1, r3 = routes_file(logs, urls)
        targets: dict[str, ServerProcess] = {"direct": mock}
        ft = [py, "-m", "firsttoken", "serve", "--port", "0", *OPEN]
        commands: dict[str, tuple[list[str], Path | None]] = {
            "pipe": (
                [py, "-m", "bench.servers.byte_pipe", "serve", "--upstream", urls[0]],
                None,
            ),
            "relay": ([*ft, "--engine", "openai", "--upstream", urls[0]], None),
            "relay_w2": (
                [*ft, "--workers", "2", "--engine", "openai", "--upstream", urls[0]],
                None,
            ),
            "route1": ([*ft, "--routes", str(r1)], None),
            "route3": ([*ft, "--routes", str(r3)], None),
        }
        if "relay_old" in wanted:
            spec = ServerSpec("relay_old", "relay (old)", "firsttoken", True, rev=args.relay_rev)
            spec = check_out(spec, out)
            commands["relay_old"] = (
                [*ft, "--engine", "openai", "--upstream", urls[0]],
                spec.cwd,
            )
        with pinned(gateway_core):
            for name in wanted:
                if name in commands:
                    cmd, cwd = commands[name]
                    targets[name] = launch(name, cmd, logs, cwd)
                    procs.append(targets[name])
            if "litellm" in wanted:
                lite = _start_litellm(args, urls[0], out, res)
                if lite is not None:
                    targets["litellm"] = lite
                    procs.append(lite)
        if client_core is not None:
            os.sched_setaffinity(0, client_core)  # the load client, for the rest of the run
        for name, p in targets.items():
            await warm_up(p, sizes)
            _log(f"{name} ready at {p.url}")
        order = list(targets)
        res["meta"]["targets"] = order
        if sizes.rounds:
            await _paired(targets, mock, sizes, args.vcpu_hour_usd, order, res)
        await _levels(targets, mock, sizes, args.vcpu_hour_usd, order, res)
    finally:
        for p in reversed(procs):
            p.stop()


def _start_litellm(
    args: argparse.Namespace, upstream: str, out: Path, res: dict[str, Any]
) -> ServerProcess | None:
    binary = find_litellm(args.litellm)
    if binary is None:
        res["meta"]["litellm"]["status"] = (
            "not installed (looked in --litellm, $BENCH_LITELLM, .venv/litellm/bin, "
            ".venv/bin, PATH)"
        )
        return None
    version = litellm_version(binary)
    res["meta"]["litellm"].update(binary=str(binary), version=version)
    try:
        lite, startup_s = launch_litellm(binary, upstream, out)
    except RuntimeError as exc:
        res["meta"]["litellm"]["status"] = f"did not start: {exc}"
        _log(res["meta"]["litellm"]["status"])
        return None
    res["meta"]["litellm"]["status"] = f"litellm {version}, ready in {startup_s:.1f} s, offline"
    return lite


async def _paired(
    targets: dict[str, ServerProcess],
    mock: ServerProcess,
    sizes: Sizes,
    price: float,
    order: list[str],
    res: dict[str, Any],
) -> None:
    accs = {name: Acc() for name in targets}
    ttfts: dict[str, list[float | None]] = {name: [] for name in targets}
    for i in range(sizes.rounds):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            acc = accs[name]
            seen = len(acc.captures)
            await run_once(targets[name], mock, 1, sizes, acc)
            s = streams(acc.captures[seen:])
            ttfts[name].append(s.ttfts_ms[0] if s.ttfts_ms else None)
    for name in targets:
        row = paired_row(name, ttfts[name], ttfts["direct"], accs[name], price)
        res["c1"].append(row)
        _log(
            f"c=1 x {sizes.rounds} {name:<10} added TTFT p50 "
            f"{_f(row['added_ttft_ms_p50'], '{:+.2f}')} p99 "
            f"{_f(row['added_ttft_ms_p99'], '{:+.2f}')} ms, complete {row['complete']}"
        )


async def _levels(
    targets: dict[str, ServerProcess],
    mock: ServerProcess,
    sizes: Sizes,
    price: float,
    order: list[str],
    res: dict[str, Any],
) -> None:
    steps = sorted(set(sizes.levels) | set(sizes.ladder))
    failed: set[str] = set()
    for i, n in enumerate(steps):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            if name in failed and n not in sizes.levels:
                continue  # past what it holds: only the table's levels still run
            acc = Acc()
            await run_once(targets[name], mock, n, sizes, acc)
            row = level_row(name, n, acc, sizes, price)
            res["levels"].append(row)
            if not row["holds"]:
                failed.add(name)
            _log(
                f"{n:>5} at once {name:<10} TTFT p99 {_f(row['ttft_ms_p99'])} ms, gap p99 "
                f"{_f(row['gap_ms_p99'])} ms, complete {row['complete']}/{row['streams']}, "
                f"{_f(row['cpu_s_per_mtok'], '{:.0f}')} CPU-s/Mtok"
            )
    for name in targets:
        held = [r["at_once"] for r in res["levels"] if r["target"] == name and r["holds"]]
        ladder = [r for r in res["levels"] if r["target"] == name and r["at_once"] in steps]
        # The highest step below the first failure (a target may pass again higher up by luck).
        top = 0
        for r in sorted(ladder, key=lambda r: r["at_once"]):
            if not r["holds"]:
                break
            top = r["at_once"]
        res["holds"][name] = {
            "at_once": top,
            "top_of_ladder": bool(held) and top == max(steps),
        }


# --- report -----------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "—"
    return f"{a / b:.2f}×"


def render(res: dict[str, Any]) -> str:
    meta = res["meta"]
    sizes = meta["sizes"]
    names = [n for n in meta.get("targets", []) if n != "direct"]
    c1 = {r["target"]: r for r in res["c1"]}
    lv = {(r["target"], r["at_once"]): r for r in res["levels"]}
    price = meta["vcpu_hour_usd"]
    lines = [
        f"gateways — {meta['date']}, {meta['cpus']} CPUs, load avg {meta['loadavg_start']} → "
        f"{meta.get('loadavg_end')}; mock upstream: {sizes['tokens']} chunks "
        f"{sizes['itl_ms']:g} ms apart, no delay before the first",
        f"pinning: {meta.get('pinning')}",
        f"LiteLLM: {meta['litellm']['status']}",
        "",
    ]
    width = 26
    head = f"{'':<34}" + "".join(f"{LABELS[n]:>{width}}" for n in names)
    lines += [head, "-" * len(head)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"{label:<34}" + "".join(f"{c:>{width}}" for c in cells))

    if c1:
        row(
            f"c=1 added TTFT p50 / p99 (ms, {sizes['rounds']} rounds)",
            [
                f"{_f(c1[n]['added_ttft_ms_p50'], '{:+.2f}')} / "
                f"{_f(c1[n]['added_ttft_ms_p99'], '{:+.2f}')}"
                if n in c1
                else "—"
                for n in names
            ],
        )
        row(
            "c=1 CPU-s per 1M tokens",
            [_f(c1[n]["cpu_s_per_mtok"], "{:.0f}") if n in c1 else "—" for n in names],
        )
    for n_at in sorted({r["at_once"] for r in res["levels"]}):
        cells = []
        for n in names:
            r = lv.get((n, n_at))
            cells.append(
                "—"
                if r is None
                else f"{_f(r['ttft_ms_p99'], '{:.0f}')} / {_f(r['gap_ms_p99'])} / "
                f"{r['complete']}/{r['streams']}"
            )
        row(f"{n_at} at once: TTFT p99 / gap p99 / done", cells)
    for n_at in sorted({r["at_once"] for r in res["levels"]}):
        cells = []
        for n in names:
            r = lv.get((n, n_at))
            cells.append(
                "—"
                if r is None or r["cpu_s_per_mtok"] is None
                else f"{r['cpu_s_per_mtok']:.0f} s / ${r['usd_per_mtok']:.4f}"
            )
        row(f"{n_at} at once: CPU-s, $ per 1M tok", cells)
    if res["holds"]:
        row(
            "holds (gap p99 ≤ 2× cadence, all done)",
            [
                (
                    ("≥ " if res["holds"][n]["top_of_ladder"] else "")
                    + str(res["holds"][n]["at_once"])
                )
                if n in res["holds"]
                else "—"
                for n in names
            ],
        )
    reqs = []
    for n in names:
        rs = [r for r in res["levels"] if r["target"] == n]
        total = sum(sum(r["upstream_requests"]) for r in rs)
        streams_ = sum(r["streams"] for r in rs)
        by_port = [sum(r["upstream_requests"][i] for r in rs) for i in range(3)] if rs else []
        reqs.append(f"{total / streams_:.2f} {by_port}" if streams_ else "—")
    row("upstream requests / stream [by port]", reqs)
    lines.append("")
    lines.append(
        f"CPU: the gateway process (and children) over its own runs, schedstat; $ at "
        f"${price:g} per vCPU-hour. TTFT from the request's write to the first content chunk."
    )
    pipe = {r["at_once"]: r for r in res["levels"] if r["target"] == "pipe"}
    relay = {r["at_once"]: r for r in res["levels"] if r["target"] == "relay"}
    if pipe and relay:
        lines.append("")
        for n_at in sorted(set(pipe) & set(relay)):
            lines.append(
                f"relay ÷ byte pipe, TTFT p99 at {n_at} at once: "
                f"{_ratio(relay[n_at]['ttft_ms_p99'], pipe[n_at]['ttft_ms_p99'])}"
            )
    if "relay" in c1 and "litellm" in c1:
        for q in ("p50", "p99"):
            lines.append(
                f"LiteLLM ÷ relay, c=1 added TTFT {q}: "
                f"{_ratio(c1['litellm'][f'added_ttft_ms_{q}'], c1['relay'][f'added_ttft_ms_{q}'])}"
            )
    if "relay_old" in c1 and "relay" in c1:
        lines.append(
            f"relay at {meta.get('relay_rev')} → now, c=1 added TTFT p50 "
            f"{_f(c1['relay_old']['added_ttft_ms_p50'], '{:+.2f}')} → "
            f"{_f(c1['relay']['added_ttft_ms_p50'], '{:+.2f}')} ms, p99 "
            f"{_f(c1['relay_old']['added_ttft_ms_p99'], '{:+.2f}')} → "
            f"{_f(c1['relay']['added_ttft_ms_p99'], '{:+.2f}')} ms"
        )
    notes = _notes(res)
    if notes:
        lines += ["", "NOTES", *(f"- {n}" for n in notes)]
    return "\n".join(lines)


def _notes(res: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for r in res["levels"]:
        if r["problems"]:
            out.append(f"{r['target']} at {r['at_once']} at once: problems {r['problems']}")
        if r["client_cpu_share"] > 0.9:
            out.append(
                f"the load client used {r['client_cpu_share']:.0%} of a core against "
                f"{r['target']} at {r['at_once']}: its figures there are partly the client's"
            )
    for r in res["c1"]:
        if r["problems"]:
            out.append(f"{r['target']} at c=1: problems {r['problems']}")
    others = [r["others_cores"] for r in res["levels"]]
    if others and max(others) > 0.5:
        out.append(
            f"other processes used up to {max(others):.1f} cores during some runs (the machine "
            "is shared): absolute figures are noisy"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateways", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument(
        "--targets",
        help=f"comma list of {','.join(TARGETS + OPTIONAL)} (default all but {','.join(OPTIONAL)})",
    )
    parser.add_argument(
        "--levels", type=_counts, help="comma list of streams at once (default 64,256,1024; none)"
    )
    parser.add_argument(
        "--ladder", type=_counts, help="comma list for 'holds' (default 64,...,1024; none)"
    )
    parser.add_argument("--rounds", type=int, help="c=1 rounds (default 20; 0: none)")
    parser.add_argument("--vcpu-hour-usd", type=float, default=0.05, help="price of CPU")
    parser.add_argument("--litellm", help="path to the `litellm` command")
    parser.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out")
    parser.add_argument("--relay-rev", help="also run the relay of this git commit")
    parser.add_argument(
        "--pin",
        choices=("both", "client", "none"),
        default="both",
        help="both: client and mock on core 0, gateways on the others (default); client: "
        "only the client and mock pinned; none",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.levels is not None:
        # `--levels none` is c=1 only: no ladder either, unless one is named.
        sizes = replace(sizes, levels=args.levels, ladder=sizes.ladder if args.levels else ())
    if args.ladder is not None:
        sizes = replace(sizes, ladder=args.ladder)
    if args.rounds is not None:
        sizes = replace(sizes, rounds=args.rounds)
    raise_fd_limit(max((*sizes.levels, *sizes.ladder, 1)) * 4 + 1024)
    res: dict[str, Any] = {
        "meta": {
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mode": "quick" if args.quick else "full",
            "loadavg_start": loadavg(),
            "sizes": asdict(sizes),
            "vcpu_hour_usd": args.vcpu_hour_usd,
            "litellm": {"status": "not tried"},
            "relay_rev": args.relay_rev,
        },
        "c1": [],
        "levels": [],
        "holds": {},
    }
    try:
        import uvloop

        uvloop.run(bench(args, sizes, res))
    finally:
        res["meta"]["loadavg_end"] = loadavg()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gateways.json").write_text(json.dumps(res, indent=2, default=str))
        text = render(res)
        print(text, flush=True)
        (args.out / "gateways.txt").write_text(text + "\n")
    print(f"\nwrote {args.out / 'gateways.json'}", flush=True)
    return 0


def _counts(value: str) -> tuple[int, ...]:
    """`--levels`/`--ladder`: stream counts, comma-separated, or `none`."""
    if value == "none":
        return ()
    try:
        counts = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: stream counts like 64,256, or none") from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"{value!r}: stream counts must be 1 or more")
    return counts


if __name__ == "__main__":
    sys.exit(main())
