"""The workloads: overhead, burst, saturation, idle capacity, abandonment.

Each takes a running server, drives it from this process, and returns figures; none of them
prints. CPU is sampled around the drive only (decoding and checking come after).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bench.expected import PROMPT_VARIANTS, RequestSpec
from bench.load import Capture, Plan, Run, drive, random_hang_ups
from bench.procs import ServerProcess, cpu_sample
from bench.sizes import Sizes
from bench.stats import RunStats, Samples, summarize

__all__ = [
    "IdleResult",
    "abandonment",
    "burst",
    "idle_capacity",
    "overhead",
    "setup",
    "warm_up",
]


def _specs(
    n: int, sizes: Sizes, *, ttft_ms: float | None = None, tokens: int | None = None
) -> list[RequestSpec]:
    return [
        RequestSpec(
            i % PROMPT_VARIANTS,
            sizes.tokens if tokens is None else tokens,
            sizes.ttft_ms if ttft_ms is None else ttft_ms,
            sizes.itl_ms,
        )
        for i in range(n)
    ]


def _deadline(sizes: Sizes, ramp_s: float) -> float:
    # Three times a stream's natural length plus the ramp: a server that slow has failed anyway.
    return ramp_s + 3 * sizes.stream_s + 10.0


async def warm_up(server: ServerProcess, sizes: Sizes) -> None:
    """One instant stream per prompt variant: imports, caches and code paths warm, not timed."""
    specs = [RequestSpec(v, sizes.tokens, 0.0, 0.0) for v in range(PROMPT_VARIANTS)]
    for attempt in range(20):
        caps = (await drive(server.host, server.port, Plan(specs, 0.0, 30.0))).captures
        if all(c.done_seen for c in caps):
            return
        await asyncio.sleep(0.1 * (attempt + 1))
    problems = {c.error for c in caps if c.error}
    raise RuntimeError(f"{server.spec.name}: warm-up streams failed: {problems}")


async def overhead(
    server: ServerProcess,
    sizes: Sizes,
    concurrency: int,
    workload: str = "overhead",
    *,
    rounds: int = 1,
    hang_ups: list[float | None] | None = None,
) -> tuple[RunStats, Samples]:
    """`concurrency` streams started over the ramp (repeated `rounds` times in a row)."""
    ramp = sizes.ramp_s if concurrency > 1 else 0.0
    plan = Plan(_specs(concurrency, sizes), ramp, _deadline(sizes, ramp), hang_ups)
    cpu0, c0 = server.cpu_seconds(), cpu_sample()
    captures: list[Capture] = []
    lag: list[float] = []
    for _ in range(rounds):
        run = await drive(server.host, server.port, plan)
        captures += run.captures
        lag += run.lag_ms
    cpu1, c1 = server.cpu_seconds(), cpu_sample()
    wall, client, busy = c1.since(c0)
    stats, _, samples = summarize(
        server.spec.name,
        workload,
        captures,
        engine_ttft_ms=sizes.ttft_ms,
        wall_s=wall,
        server_cpu_s=cpu1 - cpu0,
        client_cpu_s=client,
        machine_busy_s=busy,
        # From the first request to the last token, were the server exactly on schedule.
        ideal_window_s=ramp + (sizes.ttft_ms + (sizes.tokens - 1) * sizes.itl_ms) / 1000,
    )
    stats.concurrency = concurrency
    stats.client_lag_ms_p99 = float(np.percentile(lag, 99)) if lag else None
    stats.client_lag_ms_max = max(lag) if lag else None
    return stats, samples


async def burst(server: ServerProcess, sizes: Sizes) -> tuple[RunStats, Samples]:
    """`burst_streams` requested at the same instant: no ramp, every connect started at once.

    What a burst of new streams costs per stream (routing, parsing, admission, set-up, the
    first write) shows in the added TTFT: the last stream set up waits for all the others.
    """
    burst_sizes = replace(sizes, ramp_s=0.0, tokens=sizes.burst_tokens)
    return await overhead(
        server, burst_sizes, sizes.burst_streams, "burst", rounds=sizes.burst_rounds
    )


async def setup(server: ServerProcess, sizes: Sizes) -> tuple[RunStats, Samples]:
    """What a new stream costs the server, set-up to close: `setup_streams` requested at once,
    `setup_tokens` tokens each, `setup_rounds` bursts in a row. The server's CPU over the
    rounds ÷ the streams is `extra["cpu_us_per_stream"]` (the tokens are a few µs of it)."""
    setup_sizes = replace(sizes, ramp_s=0.0, tokens=sizes.setup_tokens)
    stats, samples = await overhead(
        server, setup_sizes, sizes.setup_streams, "setup", rounds=sizes.setup_rounds
    )
    streams = sizes.setup_streams * sizes.setup_rounds
    stats.extra["cpu_us_per_stream"] = stats.server_cpu_s / streams * 1e6
    return stats, samples


async def abandonment(server: ServerProcess, sizes: Sizes, streams: int) -> dict[str, Any]:
    """Every client hangs up at a random point; count tokens generated that nobody received."""
    before = server.metrics()
    hang_ups = random_hang_ups(streams, sizes.stream_s, seed=7)
    started = time.monotonic()
    stats, _ = await overhead(server, sizes, streams, "abandonment", hang_ups=hang_ups)
    # Wait until every stream would have finished on its own, so a server that never stops
    # generating shows its whole answer in the counter.
    settle = sizes.ramp_s + sizes.stream_s + 1.0 - (time.monotonic() - started)
    await asyncio.sleep(max(0.5, settle))
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    generated = delta("firsttoken_tokens_generated_total")
    excess = generated - stats.tokens
    outcomes = {
        k.split('outcome="', 1)[1].rstrip('"}'): delta(k)
        for k in after
        if k.startswith("firsttoken_streams_total{") and 'outcome="' in k
    }
    return {
        "streams": streams,
        "tokens_received": stats.tokens,
        "tokens_generated": generated,
        "tokens_sent": delta("firsttoken_tokens_sent_total"),
        # Generated but never written: the server ran ahead of the socket or missed the hang-up.
        "generated_not_sent": generated - delta("firsttoken_tokens_sent_total"),
        "client_lag_ms_max": stats.client_lag_ms_max,
        "excess_tokens": excess,
        "excess_per_stream": excess / streams if streams else 0.0,
        "active_streams_after": after.get("firsttoken_active_streams"),
        "outcomes": outcomes,
        "prefix_exact": stats.exact,
        "problems": stats.problems,
    }


@dataclass(slots=True)
class IdleResult:
    server: str
    streams: int
    opened: int = 0
    pinged: int = 0
    rss_base_mib: float = 0.0
    rss_open_mib: float = 0.0
    kib_per_stream: float | None = None
    projected_mib: float | None = None  # baseline + per-stream cost x the nominal stream count
    open_s: float = 0.0
    heartbeat_cpu_share: float = 0.0  # server CPU (of one core) while the streams only wait
    client_rss_mib: float = 0.0
    notes: list[str] = field(default_factory=list)


async def idle_capacity(
    server: ServerProcess, sizes: Sizes, streams: int, nominal: int
) -> IdleResult:
    """Open `streams` streams that wait on a long TTFT, with heartbeats; measure server RSS."""
    import psutil

    result = IdleResult(server.spec.name, streams)
    await asyncio.sleep(0.5)
    base = server.rss_bytes()
    plan = Plan(
        _specs(streams, sizes, ttft_ms=sizes.idle_ttft_ms, tokens=5),
        0.0,
        sizes.idle_ttft_ms / 1000,
    )
    run = Run(server.host, server.port, plan)
    t0 = time.monotonic()
    await run.open_all()
    opened = [c for c in run.captures if c.t_sent and not c.error]
    # Wait for the response head and one heartbeat on every stream.
    polls = int((3 * sizes.idle_heartbeat_s + 20.0) / 0.1)
    for _ in range(polls):
        if all(c.pings for c in opened):
            break
        await asyncio.sleep(0.1)
    result.open_s = time.monotonic() - t0
    result.opened = sum(1 for c in run.captures if c.reads and not c.t_closed)
    result.pinged = sum(1 for c in run.captures if c.pings and not c.t_closed)
    cpu0, w0 = server.cpu_seconds(), time.monotonic()
    await asyncio.sleep(sizes.idle_hold_s)
    result.heartbeat_cpu_share = (server.cpu_seconds() - cpu0) / (time.monotonic() - w0)
    rss = server.rss_bytes()
    result.client_rss_mib = psutil.Process().memory_info().rss / 2**20
    await run.close_all(expected=True)
    result.rss_base_mib = base / 2**20
    result.rss_open_mib = rss / 2**20
    if result.opened:
        per = (rss - base) / result.opened
        result.kib_per_stream = per / 1024
        result.projected_mib = (base + per * nominal) / 2**20
    errors = {c.error for c in run.captures if c.error}
    if errors:
        result.notes.append(f"stream errors: {sorted(errors)[:3]}")
    if result.pinged < result.opened:
        result.notes.append(f"{result.opened - result.pinged} open streams saw no heartbeat")
    return result
