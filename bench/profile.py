"""`python -m bench.profile`: where firsttoken spends its CPU under the saturation load.

Starts a firsttoken server, drives N concurrent streams at it, samples it with py-spy (not a
dependency of the project; `pip install py-spy`) and prints the hottest frames, by self time
and inclusive time, as shares of the samples in which the server was busy.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import uvloop

from bench import workloads
from bench.procs import RedisProcess, ServerProcess, check_out, raise_fd_limit
from bench.servers import SERVERS
from bench.sizes import Sizes

__all__ = ["main", "top_frames"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _py_spy() -> str:
    local = Path(sys.executable).with_name("py-spy")
    found = str(local) if local.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return found


def top_frames(
    collapsed: str, n: int, *, lines: bool = False
) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """From py-spy's raw (collapsed) output: total samples, top self frames, top inclusive.

    Frames are functions (`name (file)`); with `lines`, each source line counts apart.
    """
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";") if lines else [_function(f) for f in stack.split(";")]
        total += count
        self_counts[frames[-1]] += count
        for frame in set(frames):
            incl_counts[frame] += count
    # Frames on every busy stack (the bootstrap: runpy, asyncio.run, uvicorn.run) say nothing.
    root = max(incl_counts.values(), default=0)
    inclusive = Counter({f: c for f, c in incl_counts.items() if c < root})
    return total, self_counts.most_common(n), inclusive.most_common(n)


def _function(frame: str) -> str:
    """`name (path:line)` → `name (path)`."""
    head, sep, tail = frame.rpartition(":")
    return f"{head})" if sep and tail.rstrip(")").isdigit() else frame


async def _load(server: ServerProcess, sizes: Sizes, streams: int) -> None:
    await workloads.warm_up(server, sizes)
    stats, _ = await workloads.overhead(server, sizes, streams, "profile")
    print(
        f"load: {streams} streams, {stats.tokens_per_s:,.0f} tokens/s, server CPU "
        f"{stats.server_cpu_share:.0%} of a core, {stats.exact}/{stats.streams} exact",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--server", default="firsttoken", choices=list(SERVERS))
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="C frames too (py-spy --native)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--lines", action="store_true", help="per source line, not function")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    args = parser.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    raise_fd_limit(args.streams + 1024)
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / f"profile-{args.server}.txt"
    spec = check_out(SERVERS[args.server], args.out)  # firsttoken_v1: its own package
    redis = RedisProcess.start(args.out / "logs" / "redis-profile.log") if spec.redis else None
    if redis is not None:
        spec = dataclasses.replace(spec, extra=(*spec.extra, "--redis", redis.url))
    server = ServerProcess.launch(
        spec,
        args.out / "logs" / f"{args.server}-profile.log",
        ttft_ms=sizes.ttft_ms,
        itl_ms=sizes.itl_ms,
        heartbeat_s=15.0,
    )
    try:
        server.wait_ready()
        spy = subprocess.Popen(
            [
                *(_py_spy(), "record", "--pid", str(server.proc.pid), "--format", "raw"),
                *("--rate", str(args.rate), "-o", str(raw)),
                # --native needs the process paused per sample; without it, don't pause it.
                *(("--native",) if args.native else ("--nonblocking",)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            uvloop.run(_load(server, sizes, args.streams))
        finally:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            _, err = spy.communicate(timeout=30)
    finally:
        server.stop()
        if redis is not None:
            redis.stop()
    if not raw.exists():
        print(f"py-spy wrote nothing: {err.strip()[-500:]}", file=sys.stderr)
        return 1
    total, by_self, inclusive = top_frames(raw.read_text(), args.top, lines=args.lines)
    print(f"\n{total} busy samples of {args.server} (idle samples excluded)")
    for title, rows in (("SELF time", by_self), ("INCLUSIVE time", inclusive)):
        print(f"\n{title}")
        for frame, count in rows:
            print(f"{100 * count / max(total, 1):5.1f}%  {frame}")
    print(f"\ncollapsed stacks in {raw} (flamegraph.pl or speedscope.app read them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
