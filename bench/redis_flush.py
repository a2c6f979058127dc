"""`python -m bench.redis_flush`: what Redis mode costs the owner, in process.

A real redis-server (started here, loopback, no persistence), one `RedisStore`, 500 stream
logs replicated to it. Each round appends 3 events to every log (20 ms between tokens is
~2.5 events a flush interval), then flushes everything dirty. Prints, median of rounds:

- the append with the store watching ÷ the bare append (the per-token cost of Redis mode);
- CPU µs per stream per flush (building the runs, the packed Lua call, its reply, the
  confirmation), and the same ÷ one bare append (a rough scale: the flush is per stream per
  50 ms, the append per token).

CPU is this process's (`time.process_time`): redis-server's is its own, reported apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import uvloop

from bench.procs import RedisProcess
from firsttoken.eventlog import EventLog
from firsttoken.resume.redis import RedisStore
from firsttoken.resume.store import StreamRecord

__all__ = ["main"]

WIRE = (
    b'id: 7\ndata: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":" token"}}]}\n\n'
)
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


async def run(streams: int, events: int, rounds: int, out: Path) -> dict[str, float]:
    redis = RedisProcess.start(out / "logs" / "redis-flush.log")
    try:
        store = RedisStore(redis.url, max_events=8192, max_connections=4)
        store.up = False  # the metas go with the first flush, not a task of their own
        logs = []
        for i in range(streams):
            log = EventLog(8192)
            store.open(StreamRecord(f"s{i:06d}", "openai", "d", "t", "m"), 60.0, log)
            logs.append(log)
        store.up = True
        while store._replicas.dirty:
            await store._flusher.flush_batch()
        bare_logs = [EventLog(8192) for _ in range(streams)]
        watched, bare, flush = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for log in bare_logs:
                for _ in range(events):
                    log.append(WIRE, 1)
            t1 = time.perf_counter()
            for log in logs:
                for _ in range(events):
                    log.append(WIRE, 1)
            t2 = time.perf_counter()
            c0 = time.process_time()
            while store._replicas.dirty:
                await store._flusher.flush_batch()
            c1 = time.process_time()
            bare.append((t1 - t0) / (streams * events) * 1e6)
            watched.append((t2 - t1) / (streams * events) * 1e6)
            flush.append((c1 - c0) / streams * 1e6)
        assert store.backlog() == 0, "Redis did not confirm every run"
        await store.redis.aclose()
        return {
            "bare_append_us": statistics.median(bare),
            "watched_append_us": statistics.median(watched),
            "flush_us_per_stream": statistics.median(flush),
            "redis_server_cpu_s": redis.cpu_seconds(),
        }
    finally:
        redis.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_flush", description=__doc__)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--events", type=int, default=3, help="events per stream per flush")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    r = uvloop.run(run(args.streams, args.events, args.rounds, args.out))
    bare = r["bare_append_us"]
    print(f"{args.streams} streams, {args.events} events a flush, {args.rounds} rounds")
    print(
        f"append, store watching ÷ bare append   ×{r['watched_append_us'] / bare:.2f}"
        f"   ({r['watched_append_us']:.3f} vs {bare:.3f} µs)"
    )
    print(
        f"flush, µs CPU per stream               {r['flush_us_per_stream']:.2f}"
        f"   (×{r['flush_us_per_stream'] / bare:.0f} a bare append)"
    )
    print(f"redis-server CPU                       {r['redis_server_cpu_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
