"""`python -m bench`: start each server, drive the same workloads at each, print ratios.

Writes bench/results/results.json and bench/results/chart.png (see bench/README.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import per_token, workloads
from bench.chart import draw
from bench.procs import RedisProcess, ServerProcess, check_out, raise_fd_limit
from bench.report import compute_ratios, compute_targets, kept_pace, render, within_itl
from bench.servers import BASELINE, BASELINE_REV, DURABLE, SERVERS, SUBJECT, ServerSpec
from bench.sizes import Sizes
from bench.stats import Samples, loadavg

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
WORKLOADS = ("overhead", "burst", "setup", "saturation", "idle", "abandonment")
FD_HEADROOM = 512


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, sizes: Sizes, specs: Sequence[ServerSpec], out: Path, mode: str) -> None:
        self.sizes = sizes
        self.specs = list(specs)
        self.out = out
        self.notes: list[str] = []
        self.samples: dict[tuple[str, int], Samples] = {}
        self.res: dict[str, Any] = {
            "meta": {
                "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "mode": mode,
                "loadavg_start": loadavg(),
                "sizes": asdict(sizes),
                "servers": [s.name for s in specs],
                "baseline_rev": next((s.rev for s in specs if s.rev), None),
            },
            "overhead": [],
            "burst": [],
            "setup": [],
            "saturation": [],
            "idle": [],
            "abandonment": {},
            "abandonment_light": {},
        }

    def _launch(self, spec: ServerSpec, tag: str, heartbeat_s: float) -> ServerProcess:
        return ServerProcess.launch(
            spec,
            self.out / "logs" / f"{spec.name}-{tag}.log",
            ttft_ms=self.sizes.ttft_ms,
            itl_ms=self.sizes.itl_ms,
            heartbeat_s=heartbeat_s,
        )

    async def run(self, which: Sequence[str]) -> None:
        timed = [w for w in which if w != "idle"]
        # Every server starts now, side by side (an idle one costs nothing): perf instances are
        # measured back to back per level, so background noise hits them alike; idle-capacity
        # instances stay untouched until their turn, so their memory baseline is a fresh one.
        perf = [self._launch(s, "perf", 15.0) for s in self.specs] if timed else []
        # Multi-worker servers are measured for capacity (overhead at the top level, saturation)
        # only: idle memory and abandonment are per-process questions.
        idle = (
            [
                self._launch(s, "idle", self.sizes.idle_heartbeat_s)
                for s in self.specs
                if s.workers == 1
            ]
            if "idle" in which
            else []
        )
        try:
            for p in perf + idle:
                p.wait_ready()
            for p in perf:
                await workloads.warm_up(p, self.sizes)
                _log(f"{p.spec.name} ready at {p.url}")
            if "overhead" in which:
                await self._overhead(perf)
            if "burst" in which:
                await self._burst(perf)
            if "setup" in which:
                await self._setup(perf)
            if "saturation" in which:
                await self._saturation(perf)
            if "abandonment" in which:
                await self._abandonment(perf)
            for p in perf:
                p.stop()
            if idle:
                await self._idle(idle)
        finally:
            for p in perf + idle:
                p.stop()
        # In this process, once the servers are gone: µs per token, stage by stage.
        self.res["per_token"] = await per_token.stages(*self.sizes.per_token)
        self.res["meta"]["loadavg_end"] = loadavg()

    async def _overhead(self, procs: Sequence[ServerProcess]) -> None:
        top = max(self.sizes.levels)
        for level in self.sizes.levels:
            for p in procs:
                if p.spec.workers > 1 and level != top:
                    continue  # --workers 2 is judged at the top level (1,000 started over 1 s)
                rounds = self.sizes.single_stream_rounds if level == 1 else 1
                stats, samples = await workloads.overhead(p, self.sizes, level, rounds=rounds)
                self.res["overhead"].append(stats.to_json())
                self.samples[(p.spec.name, level)] = samples
                _log(
                    f"overhead {level:>5} {p.spec.name:<10} +TTFT p50 "
                    f"{stats.added_ttft_ms_p50 or 0:.2f} ms, gap p99 {stats.gap_ms_p99 or 0:.2f} ms"
                    f", exact {stats.exact}/{stats.streams}"
                )

    async def _burst(self, procs: Sequence[ServerProcess]) -> None:
        for p in procs:
            if p.spec.workers > 1:
                continue
            stats, _ = await workloads.burst(p, self.sizes)
            self.res["burst"].append(stats.to_json())
            _log(
                f"burst {self.sizes.burst_streams:>5} {p.spec.name:<10} +TTFT p50 "
                f"{stats.added_ttft_ms_p50 or 0:.2f} ms, p99 {stats.added_ttft_ms_p99 or 0:.2f} ms"
                f", exact {stats.exact}/{stats.streams}"
            )

    async def _setup(self, procs: Sequence[ServerProcess]) -> None:
        for p in procs:
            if p.spec.workers > 1:
                continue
            stats, _ = await workloads.setup(p, self.sizes)
            self.res["setup"].append(stats.to_json())
            _log(
                f"setup {self.sizes.setup_streams:>5} {p.spec.name:<10} "
                f"{stats.extra['cpu_us_per_stream']:.0f} µs of server CPU per new stream"
                f", exact {stats.exact}/{stats.streams}"
            )

    async def _saturation(self, procs: Sequence[ServerProcess]) -> None:
        climbing = list(procs)
        itl = self.sizes.itl_ms
        for step in self.sizes.saturation:
            behind: set[str] = set()
            for p in climbing:
                stats, _ = await workloads.overhead(p, self.sizes, step, "saturation")
                row = stats.to_json()
                self.res["saturation"].append(row)
                _log(
                    f"saturation {step:>5} {p.spec.name:<10} {stats.tokens_per_s:,.0f} tok/s "
                    f"({stats.delivery:.0%} of pace), {stats.tokens_per_cpu_s or 0:,.0f} tok/CPU-s,"
                    f" gap p99 {stats.gap_ms_p99 or 0:.1f} ms"
                )
                if not kept_pace(row):
                    behind.add(p.spec.name)
                if stats.client_saturated:
                    self.notes.append(
                        f"client CPU saturated ({stats.client_cpu_share:.0%} of a core) at "
                        f"{step} streams against {p.spec.name}: that step's figures are a floor"
                    )
            # Jitter from other tenants can break 2×ITL at any load, so a server climbs on
            # until it stops keeping pace (or fails a stream): the ratios then compare servers
            # at loads where each one's CPU, not the neighbours', is the limit. Every server
            # climbs at least to the targets' step, and firsttoken climbs as long as
            # `--workers 2` does: past the first step it fell behind at, one process may still
            # deliver more, and the workers ratio compares capacities. It climbs to the top
            # step anyway: issue 31 judges its TTFT at the top (2,000 streams over 1 s).
            climbing = [
                p
                for p in climbing
                if p.spec.name not in behind
                or step < self.sizes.target_streams
                or p.spec.name == SUBJECT  # to the top: issue 31 judges 2,000 streams there
            ]
            if not climbing:
                break
        for p in procs:
            rows = [r for r in self.res["saturation"] if r["server"] == p.spec.name]
            if all(within_itl(r, itl) for r in rows):
                self.notes.append(
                    f"{p.spec.name} never exceeded 2×ITL up to {rows[-1]['concurrency']} streams"
                )

    async def _abandonment(self, procs: Sequence[ServerProcess]) -> None:
        for p in procs:
            if p.spec.has_metrics:
                for key, streams in (
                    ("abandonment_light", self.sizes.abandon_light_streams),
                    ("abandonment", self.sizes.abandon_streams),
                ):
                    result = await workloads.abandonment(p, self.sizes, streams)
                    self.res[key][p.spec.name] = result
                    _log(
                        f"abandonment {streams:>5} {p.spec.name}: "
                        f"{result['excess_per_stream']:.2f} extra/stream"
                    )

    async def _idle(self, procs: Sequence[ServerProcess]) -> None:
        nominal = self.sizes.idle_streams
        # Each connection costs a descriptor in this process and one in the server.
        limit, note = raise_fd_limit(nominal + FD_HEADROOM)
        streams = min(nominal, limit - FD_HEADROOM)
        if note:
            msg = f"{note}: idle capacity scaled down to {streams} streams, projected to {nominal}"
            print(msg, flush=True)
            self.notes.append(msg)
        self.res["meta"]["idle_nominal"] = nominal
        self.res["meta"]["fd_limit"] = limit
        for p in procs:
            await workloads.warm_up(p, self.sizes)
            result = await workloads.idle_capacity(p, self.sizes, streams, nominal)
            p.stop()
            self.res["idle"].append(asdict(result))
            _log(
                f"idle {p.spec.name}: {result.opened} open, "
                f"{result.kib_per_stream or 0:.1f} KiB/stream"
            )

    def finish(self) -> str:
        res = self.res
        res["meta"].setdefault("idle_nominal", self.sizes.idle_streams)
        res["meta"].setdefault("loadavg_end", loadavg())
        res["ratios"] = compute_ratios(res)
        res["targets"] = compute_targets(res)
        res["notes"] = self.notes + _honesty_notes(res)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(res, indent=2, default=str))
        if res["overhead"] or res["saturation"]:
            draw(
                self.out / "chart.png",
                self.samples,
                self.sizes.levels,
                res["saturation"],
                self.sizes.itl_ms,
            )
        return render(res)


def _honesty_notes(res: dict[str, Any]) -> list[str]:
    notes: list[str] = []
    itl = res["meta"]["sizes"]["itl_ms"]
    top = max(res["meta"]["sizes"]["levels"])
    at_top = [r for r in res["overhead"] if r["concurrency"] == top]
    if at_top and all((r["gap_ms_p99"] or 1e9) > 2 * itl for r in at_top):
        notes.append(
            f"no server kept p99 inter-chunk within 2×ITL at {top} streams on this machine "
            f"({res['meta']['cpus']} shared cores): the ITL at that level cannot be met here"
        )
    busy = [r["others_cpu_share"] for r in res["overhead"] + res["saturation"]]
    if busy and max(busy) > 0.5:
        notes.append(
            f"other processes used up to {max(busy):.1f} cores during some runs: "
            "absolute figures are noisy, ratios less so"
        )
    if any(r["client_saturated"] for r in res["overhead"]):
        notes.append("the load client saturated a core in some overhead runs (marked '!')")
    rows = res["overhead"] + res["burst"] + res.get("setup", []) + res["saturation"]
    bad = [r for r in rows if r["exact"] != r["streams"]]
    for r in bad:
        notes.append(
            f"{r['server']} at {r['concurrency']} streams ({r['workload']}): only "
            f"{r['exact']}/{r['streams']} streams token-exact; problems {r['problems']}"
        )
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds): smoke test")
    # Redis mode's durable and baseline variants only when named: --redis costs are theirs.
    default = [n for n in SERVERS if n not in (DURABLE, "firsttoken_v1_redis")]
    parser.add_argument(
        "--servers", default=",".join(default), help=f"comma list of {', '.join(SERVERS)}"
    )
    parser.add_argument(
        "--baseline-rev",
        default=BASELINE_REV,
        metavar="REV",
        help=f"git commit whose firsttoken/ runs as {BASELINE} (default {BASELINE_REV}; "
        "'none' leaves it out)",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--idle-streams", type=int, help="idle-capacity streams (default 10000)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.idle_streams:
        sizes = sizes.scaled_idle(args.idle_streams)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    which = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [n for n in names if n not in SERVERS] + [w for w in which if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown server or workload: {unknown}")
    specs = [SERVERS[n] for n in names]
    if args.baseline_rev.lower() == "none":
        specs = [s for s in specs if s.name != BASELINE]
    else:
        rev = args.baseline_rev
        specs = [
            replace(s, rev=rev, label=s.label.replace(BASELINE_REV, rev)) if s.rev else s
            for s in specs
        ]
    try:  # the baseline's package is extracted once per run, into the results folder
        specs = [check_out(s, args.out) for s in specs]
    except RuntimeError as exc:
        parser.exit(2, f"python -m bench: {exc} (--baseline-rev none leaves it out)\n")
    raise_fd_limit(max(sizes.saturation + sizes.levels) + 4 * 512)
    redis = None
    if any(s.redis for s in specs):  # one redis-server for the --redis servers, for the run
        try:
            redis = RedisProcess.start(args.out / "logs" / "redis-server.log")
        except RuntimeError as exc:
            parser.exit(2, f"python -m bench: {exc} (leave firsttoken_redis out)\n")
        with_url = ("--redis", redis.url)
        specs = [replace(s, extra=(*s.extra, *with_url)) if s.redis else s for s in specs]
    bench = Bench(sizes, specs, args.out, "quick" if args.quick else "full")
    try:
        import uvloop

        uvloop.run(bench.run(which))
    finally:
        if redis is not None:
            bench.res["meta"]["redis_server_cpu_s"] = round(redis.cpu_seconds(), 2)
            redis.stop()
        text = bench.finish()
        print(text, flush=True)
        (args.out / "report.txt").write_text(text + "\n")
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'chart.png'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
