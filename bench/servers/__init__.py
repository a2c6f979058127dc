"""The servers under test: how to start each one on an ephemeral loopback port.

Each prints one JSON line containing "listening" and "url" when it accepts connections, the
same contract as `firsttoken serve`, so one launcher (bench/procs.py) handles all of them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BASELINE",
    "BASELINE_REV",
    "DURABLE",
    "REDIS",
    "SERVERS",
    "SUBJECT",
    "WORKERS2",
    "ServerSpec",
]

# The firsttoken server as of the last commit before the data-plane rewrite (issue 12): run side
# by side with the working tree's, so "before" and "after" come from one run (`--baseline-rev`).
BASELINE_REV = "a7a7677"
SUBJECT, BASELINE, WORKERS2 = "firsttoken", "firsttoken_v1", "firsttoken_w2"
REDIS = "firsttoken_redis"  # the same with --redis: a redis-server the bench starts
DURABLE = "firsttoken_durable"  # --redis --durable: readers see only what Redis confirmed


@dataclass(frozen=True, slots=True)
class ServerSpec:
    name: str
    label: str
    module: str  # run as `python -m MODULE serve --port 0 ...`
    has_metrics: bool  # serves firsttoken's /metrics (needed by the abandonment workload)
    extra: tuple[str, ...] = ()  # further `serve` options
    rev: str | None = None  # run the `firsttoken/` package of this git commit, not the tree's
    cwd: Path | None = None  # where that package was extracted (set per run; see procs.py)
    workers: int = 1
    redis: bool = False  # the bench starts a redis-server and passes `--redis URL`

    def command(self, ttft_ms: float, itl_ms: float, heartbeat_s: float) -> list[str]:
        # Another engine (a relay) takes its pace from its upstream, and firsttoken refuses
        # the synthetic engine's knobs beside it.
        pace: tuple[str, ...] = ()
        if "--engine" not in self.extra:
            pace = ("--synthetic-ttft-ms", _num(ttft_ms), "--synthetic-itl-ms", _num(itl_ms))
        return [
            sys.executable,
            "-m",
            self.module,
            "serve",
            "--port",
            "0",
            *pace,
            "--heartbeat-s",
            _num(heartbeat_s),
            *self.extra,
        ]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# Admission control would turn the load away (429/503) instead of streaming it: the bench
# measures the streaming path, so the rate limit and TTFT-SLO shedding are off.
OPEN = ("--rate-limit-per-s", "0", "--ttft-slo-ms", "0")

SERVERS: dict[str, ServerSpec] = {
    spec.name: spec
    for spec in (
        ServerSpec(SUBJECT, "firsttoken", "firsttoken", has_metrics=True, extra=OPEN),
        ServerSpec(
            BASELINE,
            f"firsttoken at {BASELINE_REV}",
            "firsttoken",
            has_metrics=True,
            extra=OPEN,
            rev=BASELINE_REV,
        ),
        ServerSpec(
            REDIS, "firsttoken --redis", "firsttoken", has_metrics=True, extra=OPEN, redis=True
        ),
        ServerSpec(
            "firsttoken_v1_redis",
            f"firsttoken at {BASELINE_REV} --redis",
            "firsttoken",
            has_metrics=True,
            extra=OPEN,
            rev=BASELINE_REV,
            redis=True,
        ),
        ServerSpec(
            DURABLE,
            "firsttoken --redis --durable",
            "firsttoken",
            has_metrics=True,
            extra=(*OPEN, "--durable"),
            redis=True,
        ),
        ServerSpec(
            WORKERS2,
            "firsttoken --workers 2",
            "firsttoken",
            has_metrics=False,  # each worker has its own /metrics
            extra=(*OPEN, "--workers", "2"),
            workers=2,
        ),
        ServerSpec("raw_floor", "raw asyncio floor", "bench.servers.raw_floor", has_metrics=False),
        # Issue 12's experiment: uvicorn + httptools + uvloop, one shared ticker writing every
        # due stream's token straight to its transport. The floor for any server on uvicorn.
        ServerSpec(
            "uvicorn_floor",
            "bare uvicorn experiment",
            "bench.servers.uvicorn_floor",
            has_metrics=False,
        ),
        ServerSpec(
            "tutorial", "FastAPI+sse-starlette", "bench.servers.tutorial", has_metrics=False
        ),
    )
}

# Relay mode (firsttoken's relay against a LiteLLM proxy, one upstream) is its own command,
# `python -m bench.proxies` (bench/proxies.py): it needs an upstream and LiteLLM's venv.
