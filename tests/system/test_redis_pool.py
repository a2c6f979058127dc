"""A burst of new streams on a server in Redis mode holds Redis to the pool's cap: two clients
per process (stream store, shared limits), each at most --redis-max-connections."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import redis

from tests.redis_server import run_redis
from tests.servers import run_server

CAP = 4
STREAMS = 200

BODY = json.dumps(
    {
        "model": "synthetic",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
).encode()


async def stream(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
        + BODY
    )
    try:
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


async def burst(port: int) -> list[bytes]:
    return await asyncio.gather(*(stream(port) for _ in range(STREAMS)))


def test_a_burst_of_streams_keeps_redis_connections_under_the_cap() -> None:
    with run_redis() as url:
        probe = redis.Redis.from_url(url)
        peak = 0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, int(probe.info("clients")["connected_clients"]) - 1)
                time.sleep(0.005)

        args = ("--redis", url, "--redis-max-connections", str(CAP), "--rate-limit-per-s", "0")
        with run_server(*args, "--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "5") as s:
            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                answers = asyncio.run(burst(s.port))
            finally:
                stop.set()
                sampler.join()
            after = int(probe.info("clients")["connected_clients"]) - 1
            metrics = s.metrics()
        probe.close()
    assert [a.split(b" ", 2)[1] for a in answers] == [b"200"] * STREAMS
    assert all(b"[DONE]" in a for a in answers)
    # A pool keeps what it opened: `after` is the burst's peak too, whatever the sampler missed.
    assert 0 < peak <= 2 * CAP and after <= 2 * CAP, (peak, after)
    # Waiting for a connection is not an outage: nothing fell back, nothing went down.
    assert metrics["firsttoken_redis_limits_fallback_total"] == 0
    assert metrics["firsttoken_redis_outages_total"] == 0
