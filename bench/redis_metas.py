"""What a new stream's meta costs in Redis mode: four commands a stream (as a Redis Cluster
still writes them) against one Lua call per batch (`WRITE_METAS` in `resume/metas.py`), in
process, against a real redis-server, batches interleaved.

    .venv/bin/python -m bench.redis_metas [--batch 100] [--rounds 60]

Prints the client's CPU (this process: packing, the round trip, the replies) and the
redis-server's CPU, per stream, for each way. Each stream carries a stored request of ~600
bytes (what a takeover needs), as a streaming chat request does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import uvloop

from bench.procs import RedisProcess
from firsttoken.eventlog import EventLog
from firsttoken.resume.metas import send
from firsttoken.resume.redis import RedisStore
from firsttoken.resume.store import StreamRecord

WARM_ROUNDS = 5


async def measure(url: str, redis: RedisProcess, batch: int, rounds: int) -> dict[str, float]:
    store = RedisStore(url, max_events=64, max_connections=4)
    spent = {"commands": [0.0, 0.0], "lua": [0.0, 0.0]}
    n = 0
    async with anyio.create_task_group() as tg:
        await tg.start(store.run, lambda _sid: None)
        for r in range(rounds):
            for way in ("commands", "lua") if r % 2 else ("lua", "commands"):
                reps = []
                for _ in range(batch):
                    n += 1
                    record = StreamRecord(
                        f"b{n}", "openai", "d" * 64, "t" * 32, "synthetic", b"r" * 600
                    )
                    reps.append(store._replicas.add(record, 300.0, EventLog(8), hold=False))
                c0, s0 = time.process_time(), redis.cpu_seconds()
                if way == "lua":
                    errors = await store._metas.call(reps)
                else:
                    commands = [c for p in reps for c in store._metas.commands(p)]
                    replies = await send(store.redis, False, commands)
                    errors = [x for x in replies if isinstance(x, BaseException)]
                c1, s1 = time.process_time(), redis.cpu_seconds()
                if errors:
                    raise RuntimeError(f"{way}: {errors[0]!r}")
                if r >= WARM_ROUNDS:
                    spent[way][0] += c1 - c0
                    spent[way][1] += s1 - s0
                for rep in reps:
                    store._replicas.forget(rep.record.id, rep)
        tg.cancel_scope.cancel()
    streams = (rounds - WARM_ROUNDS) * batch
    return {
        f"{way}_{who}_us": value / streams * 1e6
        for way, (client, server) in spent.items()
        for who, value in (("client", client), ("redis", server))
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_metas", description=__doc__)
    parser.add_argument("--batch", type=int, default=100, help="new streams per batch")
    parser.add_argument("--rounds", type=int, default=60, help="batches of each way")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisProcess.start(Path(tmp) / "redis.log")
        try:
            res = uvloop.run(measure(redis.url, redis, args.batch, max(args.rounds, 6)))
        finally:
            redis.stop()
    print(f"µs per new stream's meta, batches of {args.batch}:")
    for way, label in (("commands", "four commands a stream"), ("lua", "one Lua call a batch")):
        client, server = res[f"{way}_client_us"], res[f"{way}_redis_us"]
        both = client + server
        print(f"  {label:24} client {client:6.1f}  redis-server {server:6.1f}  both {both:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
