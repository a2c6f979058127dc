"""Proxy overhead side by side: LiteLLM proxy vs `firsttoken serve --engine openai`, same upstream.

    .venv/bin/python -m bench.proxies [--quick] [--levels 1,10,100] [--no-litellm] [--relay-rev REV]

One firsttoken synthetic upstream (TTFT 200 ms, ITL 20 ms, admission control off) serves three
targets: itself (direct), a firsttoken relay in front of it, and a LiteLLM proxy in front of it.
At each concurrency level the three are driven back to back by the raw load client
(bench/load.py), in a rotating order, round after round, so background noise hits them alike.
Every stream's text is checked against the synthetic engine's (bench/expected.py); LiteLLM may
re-shape chunks, so the check is on the concatenated text, and whether the chunks themselves
matched token for token is reported separately.

Figures per level: TTFT added over direct (p50/p99 of each target minus direct's), inter-chunk
p50/p99, and each proxy's CPU per 1,000 tokens (psutil, the proxy process and its children,
sampled around its own runs only). The headline ratio is LiteLLM's added TTFT ÷ the relay's.

`--relay-rev REV` adds a fourth target, `relay_old`: the relay from firsttoken as of commit REV
(`git archive`, as `bench --baseline-rev` does), driven in the same rounds, so a change to the
relay is measured before and after in one run.

LiteLLM is looked for in `--litellm`, `$BENCH_LITELLM`, `.venv/litellm/bin/litellm` (a separate
venv: litellm[proxy] pins rich<14, the project pins rich 15), `.venv/bin/litellm`, then PATH.
It runs offline: bundled cost map and other remote JSON (LITELLM_LOCAL_*), no master key (as
the relay runs without --api-keys), a config file in the results folder, cwd there too (no
stray .env). If it is missing or does not start, the relay-vs-direct part still runs and the
reason goes into the JSON and the table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.decode import decode
from bench.expected import PROMPT_VARIANTS, RequestSpec
from bench.load import Capture, Plan, Run
from bench.procs import ROOT, ServerProcess, check_out, cpu_sample, raise_fd_limit
from bench.servers import ServerSpec
from bench.stats import loadavg

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
OPEN = ("--rate-limit-per-s", "0", "--ttft-slo-ms", "0", "--breaker-error-rate", "1")
TARGETS = ("direct", "relay", "relay_old", "litellm")
RELAYS = ("relay", "relay_old")  # the working tree's, and --relay-rev's
RATIO_TARGET = 10.0  # LiteLLM added TTFT ÷ relay added TTFT
LITELLM_START_S = 120.0


def _log(msg: str) -> None:
    print(f"[proxies {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    ttft_ms: float = 200.0
    itl_ms: float = 20.0
    tokens: int = 100
    levels: tuple[int, ...] = (1, 10, 100)
    ramp_s: float = 1.0  # streams of one run start evenly over this (level 1: no ramp)
    # Rounds per level: each round runs every target once. More rounds at low levels give the
    # TTFT percentiles enough samples (level 1 × 20 rounds = 20 TTFTs per target).
    rounds: tuple[tuple[int, int], ...] = ((1, 20), (10, 4), (100, 2))
    default_rounds: int = 1

    @classmethod
    def quick(cls) -> Sizes:
        return cls(ttft_ms=50.0, itl_ms=5.0, tokens=20, levels=(1, 5), ramp_s=0.1, rounds=((1, 2),))

    def rounds_at(self, level: int) -> int:
        return dict(self.rounds).get(level, self.default_rounds)

    @property
    def stream_s(self) -> float:
        return (self.ttft_ms + self.tokens * self.itl_ms) / 1000


# --- processes --------------------------------------------------------------------------------


def _spec(name: str, label: str, *extra: str) -> ServerSpec:
    return ServerSpec(name, label, "firsttoken", has_metrics=True, extra=(*OPEN, *extra))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_litellm(given: str | None) -> Path | None:
    candidates = [
        given,
        os.environ.get("BENCH_LITELLM"),
        str(ROOT / ".venv" / "litellm" / "bin" / "litellm"),
        str(ROOT / ".venv" / "bin" / "litellm"),
        shutil.which("litellm"),
    ]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


def litellm_version(binary: Path) -> str | None:
    python = binary.parent / "python"
    try:
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


LITELLM_ENV = {
    # Remote JSON that LiteLLM fetches at start (or on first use): use the bundled copies.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    # No master key, like the relay without --api-keys (LiteLLM refuses to start otherwise).
    "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    "LITELLM_LOG": "ERROR",
    "HF_HUB_OFFLINE": "1",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def litellm_config(upstream_url: str) -> str:
    return (
        "model_list:\n"
        "  - model_name: synthetic\n"
        "    litellm_params:\n"
        "      model: openai/synthetic\n"
        f"      api_base: {upstream_url}/v1\n"
        "      api_key: x\n"
        "litellm_settings:\n"
        "  suppress_debug_info: true\n"
        "general_settings:\n"
        "  disable_spend_logs: true\n"
    )


def launch_litellm(binary: Path, upstream_url: str, out: Path) -> tuple[ServerProcess, float]:
    """Start LiteLLM on a free loopback port; poll /health/liveliness until it answers."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    config = logs / "litellm.yaml"
    config.write_text(litellm_config(upstream_url))
    log = logs / "litellm.log"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy")}
    env.update(LITELLM_ENV, PYTHONUNBUFFERED="1")
    cmd = [str(binary), "--config", str(config), "--port", str(port), "--host", "127.0.0.1"]
    t0 = time.monotonic()
    with log.open("wb") as sink:
        try:
            proc = subprocess.Popen(cmd, cwd=logs, env=env, stdout=sink, stderr=subprocess.STDOUT)
        except OSError as exc:  # a venv moved or half-installed: its interpreter is gone
            raise RuntimeError(f"cannot run {binary}: {exc}") from None
    server = ServerProcess(ServerSpec("litellm", "LiteLLM proxy", "litellm", False), proc, log)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < LITELLM_START_S:
        if proc.poll() is not None:
            raise RuntimeError(f"LiteLLM exited ({proc.returncode}); log tail:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health/liveliness", timeout=2) as resp:
                if resp.status == 200:
                    server.url = url
                    return server, time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"LiteLLM not ready after {LITELLM_START_S:.0f} s; log:\n{_tail(log)}")


def _tail(log: Path, lines: int = 25) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


# --- driving ----------------------------------------------------------------------------------


def _specs(n: int, sizes: Sizes, *, instant: bool = False) -> list[RequestSpec]:
    ttft, itl = (0.0, 0.0) if instant else (sizes.ttft_ms, sizes.itl_ms)
    return [RequestSpec(i % PROMPT_VARIANTS, sizes.tokens, ttft, itl) for i in range(n)]


async def warm_up(server: ServerProcess, sizes: Sizes) -> None:
    """Instant streams per prompt variant, twice: imports, pools and code paths warm, not timed."""
    specs = _specs(PROMPT_VARIANTS, sizes, instant=True)
    for attempt in range(20):
        caps = (await _drive(server.host, server.port, Plan(specs, 0.0, 30.0))).captures
        if all(c.done_seen for c in caps):
            caps = (await _drive(server.host, server.port, Plan(specs, 0.0, 30.0))).captures
            if all(c.done_seen for c in caps):
                return
        await asyncio.sleep(0.1 * (attempt + 1))
    problems = {c.error for c in caps if c.error} or {"[DONE] missing"}
    raise RuntimeError(f"{server.spec.name}: warm-up streams failed: {problems}")


async def _drive(host: str, port: int, plan: Plan) -> Run:
    """bench.load.drive, with each phase in its own task and bounded by asyncio.wait.

    drive() bounds its phases with asyncio.timeout in the caller's task; on Python 3.11 a
    timeout that fires just as the awaited work completes leaves a cancellation pending, and
    the next await raises CancelledError (seen here when LiteLLM ran past the deadline at 250
    streams). Running each phase as a task keeps that inside the task: the run ends with its
    captures (streams still open marked as errors) instead of the whole bench dying.
    """
    run = Run(host, port, plan)
    loop = asyncio.get_running_loop()
    end = loop.time() + plan.deadline_s
    watcher = asyncio.create_task(run.watch_lag())

    async def phase(coro: Any, within_s: float) -> None:
        task = asyncio.create_task(coro)
        done, _ = await asyncio.wait({task}, timeout=max(0.0, within_s))
        if not done:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    await phase(run.open_all(), end - loop.time())
    await phase(run.wait_closed(max(0.0, end - loop.time())), end - loop.time() + 1.0)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    await phase(run.close_all(), 10.0)
    return run


@dataclass(slots=True)
class Acc:
    """One target at one level, over all its rounds."""

    captures: list[Capture] = field(default_factory=list)
    proxy_cpu_s: float = 0.0
    upstream_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    machine_busy_s: float = 0.0
    wall_s: float = 0.0
    lag_ms: list[float] = field(default_factory=list)


async def run_once(
    target: ServerProcess, upstream: ServerProcess, sizes: Sizes, level: int, acc: Acc
) -> None:
    ramp = sizes.ramp_s if level > 1 else 0.0
    plan = Plan(_specs(level, sizes), ramp, ramp + 3 * sizes.stream_s + 10.0)
    p0, u0, c0 = target.cpu_seconds(), upstream.cpu_seconds(), cpu_sample()
    run = await _drive(target.host, target.port, plan)
    p1, u1, c1 = target.cpu_seconds(), upstream.cpu_seconds(), cpu_sample()
    wall, client, busy = c1.since(c0)
    acc.captures += run.captures
    acc.proxy_cpu_s += p1 - p0
    acc.upstream_cpu_s += u1 - u0
    acc.client_cpu_s += client
    acc.machine_busy_s += busy
    acc.wall_s += wall
    acc.lag_ms += run.lag_ms


def _pct(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    arr = np.asarray(values, dtype=float)
    return float(np.percentile(arr, q)) if arr.size else None


def summarize(name: str, level: int, acc: Acc, sizes: Sizes) -> dict[str, Any]:
    problems: Counter[str] = Counter()
    ttfts: list[float] = []
    gaps: list[np.ndarray] = []
    text_exact = chunk_exact = tokens = 0
    self_overhead: list[float] = []
    durations: list[float] = []  # request sent → last content event, completed streams
    for cap in acc.captures:
        d = decode(cap)
        expected = cap.spec.tokens()
        text = "".join(d.contents)
        if d.problem:
            problems[d.problem.split(":", 1)[0][:80]] += 1
        pos = 0
        for token in expected:  # tokens delivered: the longest prefix of the expected text
            if not text.startswith(token, pos):
                break
            pos += len(token)
            tokens += 1
        if d.done and text == "".join(expected):
            text_exact += 1
            chunk_exact += tuple(d.contents) == expected
        elif not d.problem:
            problems["text differs from the engine's"] += 1
        if d.times and d.done:
            durations.append(d.times[-1] - cap.t_sent)
        if d.times:
            ttfts.append((d.times[0] - cap.t_sent) * 1000)
            gaps.append(np.diff(np.asarray(d.times)) * 1000)
        if "x-litellm-overhead-duration-ms" in d.headers:
            try:
                self_overhead.append(float(d.headers["x-litellm-overhead-duration-ms"]))
            except ValueError:
                pass
    gap_all = np.concatenate(gaps) if gaps else np.zeros(0)
    lag = np.asarray(acc.lag_ms)
    wall = acc.wall_s or 1e-9
    cpu_s = acc.proxy_cpu_s if name != "direct" else acc.upstream_cpu_s
    row: dict[str, Any] = {
        "target": name,
        "concurrency": level,
        "streams": len(acc.captures),
        "text_exact": text_exact,
        "chunk_exact": chunk_exact,
        "problems": dict(problems),
        "ttft_ms_p50": _pct(ttfts, 50),
        "ttft_ms_p99": _pct(ttfts, 99),
        "ttft_ms_max": max(ttfts) if ttfts else None,
        "gap_ms_p50": _pct(gap_all, 50),
        "gap_ms_p99": _pct(gap_all, 99),
        "gap_ms_max": float(gap_all.max()) if gap_all.size else None,
        "content_events": int(sum(g.size + 1 for g in gaps)),
        "tokens": tokens,
        # The process this target adds: the proxy for relay/litellm, the upstream for direct.
        "cpu_s": cpu_s,
        "cpu_ms_per_1k_tokens": cpu_s / tokens * 1e6 if tokens else None,
        "cpu_share": cpu_s / wall,
        "upstream_cpu_s": acc.upstream_cpu_s,
        "upstream_cpu_ms_per_1k_tokens": acc.upstream_cpu_s / tokens * 1e6 if tokens else None,
        "client_cpu_share": acc.client_cpu_s / wall,
        "client_lag_ms_p99": _pct(lag, 99),
        "client_lag_ms_max": float(lag.max()) if lag.size else None,
        "others_cpu_share": max(
            0.0, (acc.machine_busy_s - acc.proxy_cpu_s - acc.upstream_cpu_s - acc.client_cpu_s)
        )
        / wall
        if name != "direct"
        else max(0.0, acc.machine_busy_s - acc.upstream_cpu_s - acc.client_cpu_s) / wall,
        "wall_s": acc.wall_s,
    }
    if durations:
        ideal = (sizes.ttft_ms + (sizes.tokens - 1) * sizes.itl_ms) / 1000
        row["stream_s_p50_vs_schedule"] = _pct(durations, 50) / ideal
        row["stream_s_max_vs_schedule"] = max(durations) / ideal
    if self_overhead:
        row["self_reported_overhead_ms_p50"] = _pct(self_overhead, 50)
        row["self_reported_overhead_ms_p99"] = _pct(self_overhead, 99)
    return row


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def compare(rows: list[dict[str, Any]], levels: Sequence[int]) -> list[dict[str, Any]]:
    """Per level: added TTFT over direct, ratios to direct, and LiteLLM ÷ relay."""
    out: list[dict[str, Any]] = []
    for level in levels:
        by = {r["target"]: r for r in rows if r["concurrency"] == level}
        direct = by.get("direct")
        if direct is None:
            continue
        c: dict[str, Any] = {"concurrency": level}
        for name in (*RELAYS, "litellm"):
            r = by.get(name)
            if r is None:
                continue
            for q in ("p50", "p99"):
                added = None
                if r[f"ttft_ms_{q}"] is not None and direct[f"ttft_ms_{q}"] is not None:
                    added = r[f"ttft_ms_{q}"] - direct[f"ttft_ms_{q}"]
                c[f"{name}_added_ttft_ms_{q}"] = added
                c[f"{name}_ttft_{q}_vs_direct"] = _div(r[f"ttft_ms_{q}"], direct[f"ttft_ms_{q}"])
                c[f"{name}_gap_{q}_vs_direct"] = _div(r[f"gap_ms_{q}"], direct[f"gap_ms_{q}"])
        if "relay" in by and "litellm" in by:
            for q in ("p50", "p99"):
                lit, rel = c[f"litellm_added_ttft_ms_{q}"], c[f"relay_added_ttft_ms_{q}"]
                c[f"added_ttft_{q}_litellm_over_relay"] = _div(lit, rel)
                # A relay that adds nothing measurable (≤ 0) makes the ratio unbounded: it
                # passes if LiteLLM adds anything at all beyond a millisecond.
                if lit is None or rel is None:
                    verdict = None
                elif rel <= 0:
                    verdict = lit > 1.0
                else:
                    verdict = lit / rel >= RATIO_TARGET
                c[f"target_{q}_pass"] = verdict
            c["cpu_per_token_litellm_over_relay"] = _div(
                by["litellm"]["cpu_ms_per_1k_tokens"], by["relay"]["cpu_ms_per_1k_tokens"]
            )
        if "relay_old" in by and "litellm" in by:
            for q in ("p50", "p99"):
                c[f"added_ttft_{q}_litellm_over_relay_old"] = _div(
                    c[f"litellm_added_ttft_ms_{q}"], c[f"relay_old_added_ttft_ms_{q}"]
                )
        out.append(c)
    return out


# --- report -----------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:.1f}", signed: bool = False) -> str:
    if x is None:
        return "—"
    return (("+" if signed and x >= 0 else "") + fmt).format(x)


def _r(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×" if x < 100 else f"{x:.0f}×"


def _added_ratio(c: dict[str, Any], q: str) -> str:
    rel = c.get(f"relay_added_ttft_ms_{q}")
    if rel is not None and rel <= 0:
        return "relay ≤ 0"  # the relay's percentile was at or below direct's: noise
    return _r(c.get(f"added_ttft_{q}_litellm_over_relay"))


def line(label: str, cells: list[str], ratios: list[str], lvl: str = "") -> str:
    s = f"{lvl:>7}  {label:<26}" + "".join(f"{x:>10}" for x in cells)
    widths = (11, 12, 15)
    return s + "".join(f"{x:>{w}}" for x, w in zip(ratios, widths, strict=False))


def _vs_direct(c: dict[str, Any], key: str, have_litellm: bool) -> list[str]:
    cells = [_r(c.get(f"relay_{key}_vs_direct"))]
    if have_litellm:
        cells.append(_r(c.get(f"litellm_{key}_vs_direct")))
    return cells


def render(res: dict[str, Any]) -> str:
    meta = res["meta"]
    rows = res["runs"]
    have_litellm = any(r["target"] == "litellm" for r in rows)
    lines = [
        f"proxy overhead — {meta['date']}, {meta['cpus']} CPUs, load avg "
        f"{meta['loadavg_start']} → {meta.get('loadavg_end')}, upstream TTFT "
        f"{meta['sizes']['ttft_ms']:g} ms, ITL {meta['sizes']['itl_ms']:g} ms, "
        f"{meta['sizes']['tokens']} tokens per stream",
        f"LiteLLM: {meta['litellm']['status']}",
        "",
    ]
    have_old = any(r["target"] == "relay_old" for r in rows)
    names = ["direct", "relay", *(["relay_old"] if have_old else [])]
    names += ["litellm"] if have_litellm else []
    head = f"{'streams':>7}  {'figure':<26}" + "".join(f"{n:>10}" for n in names)
    head += f"{'relay/dir':>11}" + (
        f"{'LiteLLM/dir':>12}{'LiteLLM÷relay':>15}" if have_litellm else ""
    )
    lines.append(head)
    lines.append("-" * len(head))
    for c in res["comparison"]:
        level = c["concurrency"]
        by = {r["target"]: r for r in rows if r["concurrency"] == level}

        for i, q in enumerate(("p50", "p99")):
            lines.append(
                line(
                    f"TTFT {q} (ms)",
                    [_f(by[n][f"ttft_ms_{q}"]) for n in names],
                    _vs_direct(c, f"ttft_{q}", have_litellm),
                    str(level) if i == 0 else "",
                )
            )
        for q in ("p50", "p99"):
            cells = ["0"] + [_f(c.get(f"{n}_added_ttft_ms_{q}"), signed=True) for n in names[1:]]
            ratios = ["", ""] if have_litellm else [""]
            if have_litellm:
                ratios.append(_added_ratio(c, q))
            lines.append(line(f"added TTFT {q} (ms)", cells, ratios))
        for q in ("p50", "p99"):
            lines.append(
                line(
                    f"inter-chunk {q} (ms)",
                    [_f(by[n][f"gap_ms_{q}"], "{:.2f}") for n in names],
                    _vs_direct(c, f"gap_{q}", have_litellm),
                )
            )
        pace = [_f(by[n].get("stream_s_p50_vs_schedule"), "{:.2f}×") for n in names]
        lines.append(line("stream time p50 ÷ schedule", pace, []))
        cpu = [_f(by[n]["cpu_ms_per_1k_tokens"], "{:.0f}") for n in names]
        ratios = [
            _r(_div(by["relay"]["cpu_ms_per_1k_tokens"], by["direct"]["cpu_ms_per_1k_tokens"]))
        ]
        if have_litellm:
            ratios.append(
                _r(
                    _div(
                        by["litellm"]["cpu_ms_per_1k_tokens"], by["direct"]["cpu_ms_per_1k_tokens"]
                    )
                )
            )
            ratios.append(_r(c.get("cpu_per_token_litellm_over_relay")))
        lines.append(line("CPU ms / 1k tokens *", cpu, ratios))
        lines.append(
            line("text exact", [f"{by[n]['text_exact']}/{by[n]['streams']}" for n in names], [])
        )
        lines.append(
            line("  of which chunk = token", [str(by[n]["chunk_exact"]) for n in names], [])
        )
        lines.append("")
    lines.append(
        "* CPU of the process each target adds: the upstream for direct, the proxy for the others "
        "(user+system, psutil, over its own runs)."
    )
    if have_litellm:
        lines.append("")
        lines.append(
            f"TARGET LiteLLM added TTFT ÷ firsttoken-relay added TTFT ≥ {RATIO_TARGET:g}×:"
        )
        for c in res["comparison"]:
            for q in ("p50", "p99"):
                verdict = c.get(f"target_{q}_pass")
                mark = "n/a" if verdict is None else "PASS" if verdict else "FAIL"
                lines.append(f"  {c['concurrency']:>5} streams, {q}: {_added_ratio(c, q)} {mark}")
    if have_old:
        lines.append("")
        lines.append(
            f"BEFORE/AFTER: relay_old is the relay at {meta.get('relay_rev')}, same rounds"
        )
        for c in res["comparison"]:
            for q in ("p50", "p99"):
                old, new = c.get(f"relay_old_added_ttft_ms_{q}"), c.get(f"relay_added_ttft_ms_{q}")
                text = (
                    f"  {c['concurrency']:>5} streams, {q}: added TTFT {_f(old, signed=True)} → "
                    f"{_f(new, signed=True)} ms"
                )
                if have_litellm:
                    text += (
                        f"; LiteLLM ÷ relay {_r(c.get(f'added_ttft_{q}_litellm_over_relay_old'))} "
                        f"→ {_added_ratio(c, q)}"
                    )
                lines.append(text)
    if res["notes"]:
        lines.append("")
        lines.append("NOTES")
        lines.extend(f"- {n}" for n in res["notes"])
    return "\n".join(lines)


def notes(res: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for r in res["runs"]:
        if r["text_exact"] != r["streams"]:
            out.append(
                f"{r['target']} at {r['concurrency']} streams: only {r['text_exact']}/"
                f"{r['streams']} streams text-exact; problems {r['problems']}"
            )
        elif r["chunk_exact"] != r["streams"]:
            out.append(
                f"{r['target']} at {r['concurrency']} streams: text exact, but "
                f"{r['streams'] - r['chunk_exact']} streams re-chunked (not one event per token)"
            )
        if r["client_cpu_share"] > 0.9:
            out.append(
                f"load client used {r['client_cpu_share']:.0%} of a core against {r['target']} "
                f"at {r['concurrency']}: those figures are partly the client's"
            )
        if r.get("self_reported_overhead_ms_p50") is not None:
            out.append(
                f"LiteLLM's own x-litellm-overhead-duration-ms header at {r['concurrency']} "
                f"streams: p50 {r['self_reported_overhead_ms_p50']:.1f} ms, p99 "
                f"{r['self_reported_overhead_ms_p99']:.1f} ms (its measure, not this client's)"
            )
    for r in res["runs"]:
        pace = r.get("stream_s_p50_vs_schedule")
        if r["target"] != "direct" and pace is not None and pace > 1.1:
            out.append(
                f"{r['target']} could not keep pace at {r['concurrency']} streams (median stream "
                f"took {pace:.2f}× its schedule, proxy at {r['cpu_share']:.0%} of a core): its "
                "TTFT there is queueing behind its own CPU, not a per-request cost"
            )
    others = [r["others_cpu_share"] for r in res["runs"]]
    if others and max(others) > 0.5:
        out.append(
            f"other processes used up to {max(others):.1f} cores during some runs: absolute "
            "figures are noisy; the ratios are measured minutes apart in the same run"
        )
    lag = [r["client_lag_ms_max"] or 0 for r in res["runs"]]
    if lag and max(lag) > 20:
        out.append(
            f"the load client's own event loop stalled up to {max(lag):.0f} ms in some runs "
            "(descheduled on the shared cores): it inflates every target's tails alike"
        )
    return out


# --- orchestration ----------------------------------------------------------------------------


async def bench(args: argparse.Namespace, sizes: Sizes, res: dict[str, Any]) -> None:
    out: Path = args.out
    logs = out / "logs"
    # The upstream's own defaults are the spec'd 200/20 ms; every request also carries its
    # timing in the "synthetic" body field (both proxies pass it on), which --quick shortens.
    timing = {"ttft_ms": 200.0, "itl_ms": 20.0, "heartbeat_s": 15.0}
    procs: list[ServerProcess] = []
    try:
        upstream = ServerProcess.launch(
            _spec("upstream", "upstream"), logs / "upstream.log", **timing
        )
        procs.append(upstream)
        upstream.wait_ready()
        relay = ServerProcess.launch(
            _spec("relay", "firsttoken relay", "--engine", "openai", "--upstream", upstream.url),
            logs / "relay.log",
            **timing,
        )
        procs.append(relay)
        relay.wait_ready()
        targets: dict[str, ServerProcess] = {"direct": upstream, "relay": relay}
        if args.relay_rev:
            spec = _spec(
                "relay_old",
                f"firsttoken relay at {args.relay_rev}",
                "--engine",
                "openai",
                "--upstream",
                upstream.url,
            )
            spec = check_out(replace(spec, rev=args.relay_rev), out)
            old = ServerProcess.launch(spec, logs / "relay_old.log", **timing)
            procs.append(old)
            old.wait_ready()
            targets["relay_old"] = old
        binary = None if args.no_litellm else find_litellm(args.litellm)
        if args.no_litellm:
            res["meta"]["litellm"]["status"] = "skipped (--no-litellm)"
        elif binary is None:
            res["meta"]["litellm"]["status"] = (
                "not installed (looked in --litellm, $BENCH_LITELLM, .venv/litellm/bin, "
                ".venv/bin, PATH); relay vs direct only"
            )
        else:
            version = litellm_version(binary)
            res["meta"]["litellm"].update(binary=str(binary), version=version)
            try:
                lite, startup_s = launch_litellm(binary, upstream.url, out)
            except RuntimeError as exc:
                res["meta"]["litellm"]["status"] = f"did not start: {exc}"
                _log(res["meta"]["litellm"]["status"])
            else:
                procs.append(lite)
                targets["litellm"] = lite
                res["meta"]["litellm"].update(startup_s=round(startup_s, 1))
                res["meta"]["litellm"]["status"] = (
                    f"litellm {version} ({binary}), ready in {startup_s:.1f} s, offline"
                )
        for name, p in targets.items():
            await warm_up(p, sizes)
            _log(f"{name} ready at {p.url}")
        order = list(targets)
        for level in sizes.levels:
            accs = {name: Acc() for name in targets}
            rounds = sizes.rounds_at(level)
            for i in range(rounds):
                # Rotate the order each round: no target always runs first (or last).
                k = i % len(order)
                for name in order[k:] + order[:k]:
                    await run_once(targets[name], upstream, sizes, level, accs[name])
            for name, acc in accs.items():
                row = summarize(name, level, acc, sizes)
                res["runs"].append(row)
                _log(
                    f"{level:>4} streams x {rounds} {name:<8} TTFT p50 "
                    f"{row['ttft_ms_p50'] or 0:.1f} p99 {row['ttft_ms_p99'] or 0:.1f}, gap p99 "
                    f"{row['gap_ms_p99'] or 0:.1f}, exact {row['text_exact']}/{row['streams']}"
                )
    finally:
        for p in reversed(procs):
            p.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.proxies", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--levels", help="comma list of concurrent streams (default 1,10,100)")
    parser.add_argument("--tokens", type=int, help="max_tokens per stream (default 100)")
    parser.add_argument("--rounds", type=int, help="rounds at every level (default 20/4/2/1)")
    parser.add_argument("--litellm", help="path to the `litellm` command")
    parser.add_argument("--no-litellm", action="store_true", help="relay vs direct only")
    parser.add_argument(
        "--relay-rev", help="also run the relay of this git commit (target relay_old)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.levels:
        levels = tuple(int(x) for x in args.levels.split(",") if x.strip())
        sizes = replace(sizes, levels=levels)
    if args.tokens:
        sizes = replace(sizes, tokens=args.tokens)
    if args.rounds:
        sizes = replace(sizes, rounds=(), default_rounds=args.rounds)
    raise_fd_limit(max(sizes.levels) * 4 + 1024)
    res: dict[str, Any] = {
        "meta": {
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mode": "quick" if args.quick else "full",
            "loadavg_start": loadavg(),
            "sizes": {**asdict(sizes), "rounds": {lv: sizes.rounds_at(lv) for lv in sizes.levels}},
            "upstream": "python -m firsttoken serve " + " ".join(OPEN),
            "litellm": {"status": "not tried"},
            "relay_rev": args.relay_rev,
        },
        "runs": [],
    }
    try:
        import uvloop

        uvloop.run(bench(args, sizes, res))
    finally:
        res["meta"]["loadavg_end"] = loadavg()
        res["comparison"] = compare(res["runs"], sizes.levels)
        res["notes"] = notes(res)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "proxies.json").write_text(json.dumps(res, indent=2, default=str))
        text = render(res)
        print(text, flush=True)
        (args.out / "proxies.txt").write_text(text + "\n")
    print(f"\nwrote {args.out / 'proxies.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
