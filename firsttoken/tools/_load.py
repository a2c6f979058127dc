"""Load mode: M requests, N at a time, each measured like a single run."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from firsttoken.tools._measure import RequestSpec, StreamResult, measure_stream
from firsttoken.tools._verdict import Verdict, judge

__all__ = ["HttpVersions", "LoadRun", "make_client", "run_load"]


@dataclass
class LoadRun:
    url: str
    concurrency: int
    results: list[StreamResult] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def error_counts(self) -> Counter[str]:
        return Counter(r.error["code"] for r in self.results if r.error is not None)

    def verdict_counts(self) -> Counter[str]:
        return Counter(v.label for v in self.verdicts)


def make_client(
    timeout_s: float,
    connections: int,
    verify: bool = True,
    transport: httpx.AsyncBaseTransport | None = None,
    versions: HttpVersions | None = None,
) -> httpx.AsyncClient:
    """`transport` replaces the default one (e.g. `diag --packet-loss` watching its sockets)
    and then carries the HTTP versions itself."""
    v = versions or HttpVersions()
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=timeout_s, write=10.0, pool=None),
        limits=limits(connections),
        verify=verify,
        follow_redirects=True,
        transport=transport,
        http1=v.http1,
        http2=v.http2,
    )


@dataclass(frozen=True, slots=True)
class HttpVersions:
    """Which HTTP versions a client may speak. Over TLS the server picks among those offered
    (ALPN); without TLS, HTTP/2 alone is sent with prior knowledge (h2c)."""

    http1: bool = True
    http2: bool = False

    @classmethod
    def for_url(cls, url: str, http2: bool = False) -> HttpVersions:
        """https offers HTTP/2 beside HTTP/1.1 (what browsers do); http speaks HTTP/1.1, or
        HTTP/2 only when asked (there is no negotiation without TLS)."""
        if urlsplit(url).scheme == "https":
            return cls(http1=True, http2=True)
        return cls(http1=not http2, http2=http2)


def limits(connections: int) -> httpx.Limits:
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections)


async def run_load(
    spec: RequestSpec,
    concurrency: int,
    requests: int,
    timeout_s: float,
    verify: bool = True,
    on_result: Callable[[int, StreamResult], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    versions: HttpVersions | None = None,
) -> LoadRun:
    run = LoadRun(url=spec.url, concurrency=concurrency)
    slots: list[tuple[StreamResult, Verdict] | None] = [None] * requests
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            result = await measure_stream(client, spec)
            slots[i] = (result, judge(result))
            if on_result is not None:
                on_result(i, result)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with make_client(timeout_s, concurrency, verify, transport, versions) as client:
        await asyncio.gather(*(worker(client) for _ in range(min(concurrency, requests))))
    run.wall_s = time.perf_counter() - wall0
    run.cpu_s = time.process_time() - cpu0
    for slot in slots:
        assert slot is not None
        run.results.append(slot[0])
        run.verdicts.append(slot[1])
    return run
