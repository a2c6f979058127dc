"""What admission adds per new stream: in memory vs. one shared Redis.

    .venv/bin/python -m bench.admission_latency [--redis redis://127.0.0.1:6379/0]

Prints µs per admit+release, as ratios to a dict lookup and a Redis PING measured in the
same run.
Without --redis it starts a throwaway redis-server (needs redis-server on PATH).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from firsttoken.admission import Admission
from firsttoken.config import Settings
from firsttoken.core.stream import Outcome
from firsttoken.telemetry.metrics import Metrics

N = 2000


async def _ping(url: str) -> float:
    from redis.asyncio import Redis

    redis = Redis.from_url(url)
    await redis.ping()
    start = time.perf_counter()
    for _ in range(N):
        await redis.ping()
    elapsed = (time.perf_counter() - start) / N * 1e6
    await redis.aclose()
    return elapsed


async def _measure(settings: Settings) -> float:
    admission = Admission(settings, Metrics())
    key = admission.keys.find("sk-bench") if admission.keys else None
    assert key is not None
    start = time.perf_counter()
    for _ in range(N):
        ticket = await admission.admit(key)
        await ticket.release(Outcome.COMPLETED)
    return (time.perf_counter() - start) / N * 1e6


def _baseline() -> float:
    d = {"sk-bench": 1}
    start = time.perf_counter()
    for _ in range(N):
        d.get("sk-bench")
    return (time.perf_counter() - start) / N * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.toml"
        keys.write_text('[[keys]]\nname = "bench"\nkey = "sk-bench"\n')
        base = dict(
            api_keys=str(keys),
            rate_limit_per_s=1e9,
            rate_limit_burst=10**9,
            max_streams_per_key=10**6,
        )
        memory_us = asyncio.run(_measure(Settings(**base)))
        if args.redis:
            redis_us = asyncio.run(_measure(Settings(**base, redis=args.redis)))
            ping_us = asyncio.run(_ping(args.redis))
        else:
            from tests.redis_server import run_redis

            with run_redis() as url:
                redis_us = asyncio.run(_measure(Settings(**base, redis=url)))
                ping_us = asyncio.run(_ping(url))
    floor = _baseline()
    print(f"dict lookup (floor)     {floor:8.2f} µs")
    print(f"admission, in memory    {memory_us:8.2f} µs  ({memory_us / floor:6.0f}× floor)")
    print(f"Redis PING round trip   {ping_us:8.2f} µs")
    print(
        f"admission, Redis        {redis_us:8.2f} µs  ({redis_us / ping_us:6.1f}× a PING; "
        "admit is one script call, release one ZREM)"
    )


if __name__ == "__main__":
    main()
