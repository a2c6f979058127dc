"""Coalescing off vs boundary mode: events, server CPU and display smoothness.

    .venv/bin/python -m bench.coalescing [--streams 1000] [--quick]

One firsttoken server; the same workload (engine TTFT 200 ms, ITL 20 ms, 300 tokens) run with
`stream_options.coalesce` "off" then "boundary", back to back. Prints content events per
second, server CPU per 1,000 tokens, and smoothness as the coefficient of variation of each
stream's inter-event gaps (lower is steadier), with boundary ÷ off ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.decode import decode
from bench.expected import RequestSpec
from bench.load import Plan, drive
from bench.procs import ServerProcess
from bench.servers import SERVERS


@dataclass(frozen=True, slots=True)
class CoalescedSpec(RequestSpec):
    coalesce: str = "off"

    def body(self) -> dict[str, Any]:
        return {**RequestSpec.body(self), "stream_options": {"coalesce": self.coalesce}}


async def _run(server: ServerProcess, streams: int, tokens: int, mode: str) -> dict[str, float]:
    specs = [CoalescedSpec(i % 8, tokens, 200, 20, coalesce=mode) for i in range(streams)]
    ramp = 1.0
    plan = Plan(specs, ramp, deadline_s=ramp + 0.2 + tokens * 0.02 * 4 + 10)
    cpu0 = server.cpu_seconds()
    run = await drive(server.host, server.port, plan)
    cpu = server.cpu_seconds() - cpu0
    events = delivered = 0
    cvs: list[float] = []
    span = 0.0
    for cap in run.captures:
        d = decode(cap)
        if d.problem or "".join(d.contents) != "".join(cap.spec.tokens()):
            raise RuntimeError(f"{mode}: stream not token-exact: {d.problem}")
        events += len(d.contents)
        delivered += len(cap.spec.tokens())
        gaps = [b - a for a, b in zip(d.times, d.times[1:], strict=False)]
        if len(gaps) > 2 and statistics.mean(gaps) > 0:
            cvs.append(statistics.pstdev(gaps) / statistics.mean(gaps))
        if d.times:
            span = max(span, d.times[-1] - cap.t_sent)
    return {
        "events_per_s": events / span if span else 0.0,
        "events_per_stream": events / streams,
        "cpu_ms_per_1000_tokens": cpu / delivered * 1e6,
        "gap_cv": statistics.median(cvs) if cvs else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="20 streams of 40 tokens")
    args = parser.parse_args()
    streams, tokens = (20, 40) if args.quick else (args.streams, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess.launch(
            SERVERS["firsttoken"], Path(tmp) / "server.log", ttft_ms=200, itl_ms=20, heartbeat_s=15
        )
        try:
            server.wait_ready()
            results = {
                mode: asyncio.run(_run(server, streams, tokens, mode))
                for mode in ("off", "boundary")
            }
        finally:
            server.stop()
    off, on = results["off"], results["boundary"]
    print(f"{streams} streams × {tokens} tokens, ITL 20 ms; boundary: max wait 50 ms, 1024 B")
    print(f"{'':26}{'off':>12}{'boundary':>12}{'boundary÷off':>14}")
    for key, label in (
        ("events_per_s", "content events / s"),
        ("events_per_stream", "events per stream"),
        ("cpu_ms_per_1000_tokens", "server CPU ms / 1k tokens"),
        ("gap_cv", "gap CV (median stream)"),
    ):
        ratio = on[key] / off[key] if off[key] else float("nan")
        print(f"{label:26}{off[key]:>12.2f}{on[key]:>12.2f}{ratio:>14.2f}")


if __name__ == "__main__":
    main()
