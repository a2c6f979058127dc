"""Many readers on one instance of streams another instance generates: one shared tail of
Redis serves them all, so they need a few connections, not one each (they once held one
each for a 1 s blocking read, and a 150-reader burst got 503s from a capped pool).
Also: the owner killed under its followers ends them with `stream_lost`."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import psutil
import pytest
import redis

from firsttoken.engines import synthetic_tokens
from tests.events import tokens_of
from tests.rawhttp import RawStream
from tests.redis_server import run_redis
from tests.servers import Server, run_server

TOKENS = 12


@dataclass
class Burst:
    statuses: list[int] = field(default_factory=list)
    exact: int = 0  # answers with every token, in order, and [DONE]
    peak_b: int = 0  # B's own connections to Redis, sampled
    peak_clients: int = 0  # Redis `connected_clients` (everyone's), sampled
    peak_blocked: int = 0  # Redis `blocked_clients`: connections held by a blocking read


async def _get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    try:
        raw = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return status, body


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def _redis_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def read_through_b(a: Server, b: Server, url: str, streams: int, stagger_s: float = 0) -> Burst:
    """Create `streams` native streams on A that have not made a token yet, read them all
    through B (at once, or one every `stagger_s`), and sample the Redis connections."""
    prompts = [f"follow {i}" for i in range(streams)]
    with httpx.Client(timeout=10) as http:
        created = [
            http.post(a.v1 + "/streams", json={"prompt": p, "max_tokens": TOKENS}).json()
            for p in prompts
        ]
        # B's first reader pays B's lazy set-up (imports, its first connections and lane),
        # which a loaded machine can stretch while the next readers pile up: not sampled.
        warm = {"prompt": "warm", "max_tokens": 2, "synthetic": {"ttft_ms": 10}}
        events_url = http.post(a.v1 + "/streams", json=warm).json()["events_url"]
    assert asyncio.run(_get(b.port, events_url))[0] == 200
    probe = redis.Redis.from_url(url)
    port = _redis_port(url)
    b_proc = psutil.Process(b.proc.pid)
    burst = Burst()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            info = probe.info("clients")
            clients = int(info["connected_clients"]) - 1  # less the probe
            mine = sum(
                1
                for c in b_proc.net_connections("tcp")
                if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
            )
            burst.peak_clients = max(burst.peak_clients, clients)
            burst.peak_b = max(burst.peak_b, mine)
            burst.peak_blocked = max(burst.peak_blocked, int(info["blocked_clients"]))
            time.sleep(0.01)

    async def one(i: int, path: str) -> tuple[int, bytes]:
        await asyncio.sleep(i * stagger_s)
        return await _get(b.port, path)

    async def everyone() -> list[tuple[int, bytes]]:
        return await asyncio.gather(*(one(i, c["events_url"]) for i, c in enumerate(created)))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answers = asyncio.run(everyone())
    finally:
        stop.set()
        sampler.join()
        probe.close()
    for prompt, (status, body) in zip(prompts, answers, strict=True):
        burst.statuses.append(status)
        tokens, _, done, error = tokens_of(body)
        if (tokens, done, error) == (synthetic_tokens(prompt, None, TOKENS)[0], True, None):
            burst.exact += 1
    return burst


@pytest.fixture(scope="module")
def owner() -> Iterator[tuple[str, Server]]:
    """Redis, and A, whose streams make no token for 5 s (every reader is attached before
    the first one), then 12 at 20 ms."""
    with run_redis() as url:
        args = ("--redis", url, "--rate-limit-per-s", "0", "--resume-grace-s", "20")
        args += ("--ttft-slo-ms", "0")  # the 5 s first tokens are on purpose
        timing = ("--synthetic-ttft-ms", "5000", "--synthetic-itl-ms", "20")
        with run_server(*args, *timing) as a:
            yield url, a


def reader_args(url: str, *extra: str) -> tuple[str, ...]:
    return ("--redis", url, "--rate-limit-per-s", "0", *extra)


def test_many_followers_through_a_small_pool(owner: tuple[str, Server]) -> None:
    url, a = owner
    streams = 150
    with run_server(*reader_args(url, "--redis-max-connections", "8")) as b:
        burst = read_through_b(a, b, url, streams)
        metrics = b.metrics()
    # One reader each held a connection for its 1 s block: 24 of 150 got a 503 here.
    assert burst.statuses == [200] * streams, sorted(set(burst.statuses))
    assert burst.exact == streams
    assert burst.peak_blocked <= 1, burst  # B's one lane; was 7 (all it had)
    assert metrics["firsttoken_redis_outages_total"] == 0  # waiting for a connection is not one


def test_followers_arriving_one_by_one_hold_few_connections(owner: tuple[str, Server]) -> None:
    url, a = owner
    streams = 150
    with run_server(*reader_args(url)) as b:  # the default pool: 64 connections a client
        burst = read_through_b(a, b, url, streams, stagger_s=0.02)
    assert burst.statuses == [200] * streams, sorted(set(burst.statuses))
    assert burst.exact == streams
    # Not one per reader (before: the pool's 64, and 87 of 150 readers got a 503): one blocked
    # read, and B never needs its whole pool. Alone B peaks at 4-6; in two full-suite runs of
    # 2026-12-01 at 31 and 37 (not reproduced outside the suite, with CPU hogs beside it or
    # after the Redis and cluster modules): readers' short calls overlap while B is behind.
    assert burst.peak_blocked <= 1, burst
    assert burst.peak_b < 64, burst


def test_owner_killed_under_its_followers_is_taken_over_by_their_instance() -> None:
    with run_redis() as url:
        args = ("--redis", url, "--synthetic-ttft-ms", "10", "--synthetic-itl-ms", "50")
        with run_server(*args) as a, run_server(*reader_args(url)) as b:
            body = {"max_tokens": 60}
            created = [
                httpx.post(a.v1 + "/streams", json={**body, "prompt": f"lost {i}"}, timeout=10)
                .json()
                for i in range(3)
            ]
            readers = [RawStream(b.port, "GET", c["events_url"]) for c in created]
            for r in readers:
                while r.body.count(b'{"token":') < 3:
                    r.read_chunk()
            a.kill()
            # Its liveness key lapses (1.2 s): B, where the readers are, goes on with them.
            ends = []
            for r in readers:
                r.sock.settimeout(20)
                ends.append(tokens_of(r.read_all()))
            assert b.metric('firsttoken_takeovers_total{outcome="continued"}') == 3
    for i, (tokens, _, done, error) in enumerate(ends):
        assert done and error is None
        assert tokens == synthetic_tokens(f"lost {i}", None, 60)[0]
