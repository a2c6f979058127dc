"""The load client: raw asyncio sockets, one Protocol per stream, no parsing while it runs.

While streams run, a stream's only work per read is a clock sample and a list append; HTTP
framing, SSE, JSON and verification all happen afterwards (bench/decode.py). That keeps the
client far cheaper per token than any server under test, so it is not the bottleneck.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from bench.expected import RequestSpec, http_request

__all__ = ["Capture", "Plan", "Run", "drive", "random_hang_ups"]

_DONE = b"[DONE]"


@dataclass(slots=True)
class Plan:
    """What to run: one request per stream, started evenly over `ramp_s`."""

    specs: Sequence[RequestSpec]
    ramp_s: float
    deadline_s: float  # hard bound on the whole run; streams still open are closed
    hang_up_after: Sequence[float | None] | None = None  # per stream: client disconnects
    connect_limit: int = 256  # connects in flight at once (keeps the accept queue sane)


@dataclass(slots=True)
class Capture:
    """Everything one stream saw: when the request went out and every read with its time."""

    spec: RequestSpec
    t_sent: float = 0.0
    reads: list[tuple[float, bytes]] = field(default_factory=list)
    t_closed: float = 0.0
    pings: int = 0
    done_seen: bool = False
    hung_up: bool = False
    error: str | None = None

    @property
    def opened(self) -> bool:
        return bool(self.reads)


class _Stream(asyncio.Protocol):
    __slots__ = ("_closed", "_hang_up", "_request", "_timer", "_tr", "cap")

    def __init__(self, cap: Capture, request: bytes, hang_up: float | None) -> None:
        self.cap = cap
        self._request = request
        self._hang_up = hang_up
        self._tr: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tr = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio subclass
        self._tr.write(self._request)
        self.cap.t_sent = time.perf_counter()
        if self._hang_up is not None:
            self._timer = asyncio.get_running_loop().call_later(self._hang_up, self.hang_up)

    def data_received(self, data: bytes) -> None:
        self.cap.reads.append((time.perf_counter(), data))
        if b": ping" in data:
            self.cap.pings += 1
        if _DONE in data:
            self.cap.done_seen = True
            # The server should close (we asked for Connection: close); don't wait forever.
            self._timer = asyncio.get_running_loop().call_later(2.0, self.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.cap.t_closed = time.perf_counter()
        if exc is not None and not self.cap.hung_up and not self.cap.done_seen:
            self.cap.error = f"connection lost: {exc!r}"
        if self._timer is not None:
            self._timer.cancel()
        if not self._closed.done():
            self._closed.set_result(None)

    def hang_up(self) -> None:
        self.cap.hung_up = True
        self.close()

    def close(self) -> None:
        if self._tr is not None and not self._tr.is_closing():
            self._tr.close()

    async def wait_closed(self) -> None:
        # Shielded: a timed-out wait must not cancel the shared future, or the next wait
        # (close_all after a deadline) raises CancelledError instead of waiting.
        await asyncio.shield(self._closed)


class Run:
    """A plan in progress against host:port: open the streams, wait, close what is left."""

    def __init__(self, host: str, port: int, plan: Plan) -> None:
        self.host = host
        self.port = port
        self.plan = plan
        self.captures = [Capture(spec) for spec in plan.specs]
        self.lag_ms: list[float] = []  # how late the client's own loop woke: its stalls
        self._streams: list[_Stream] = []

    async def watch_lag(self, period_s: float = 0.005) -> None:
        """Until cancelled: sample this loop's wake-up lateness (a stalled client skews gaps)."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + period_s
            await asyncio.sleep(period_s)
            self.lag_ms.append((loop.time() - due) * 1000)

    async def open_all(self) -> None:
        """Start every stream on the ramp; returns when every connect has finished."""
        loop = asyncio.get_running_loop()
        plan = self.plan
        requests = {spec: http_request(spec, self.host, self.port) for spec in set(plan.specs)}
        hang_ups = plan.hang_up_after or [None] * len(self.captures)
        connects = asyncio.Semaphore(plan.connect_limit)
        step = plan.ramp_s / len(self.captures) if self.captures else 0.0

        async def open_stream(cap: Capture, hang_up: float | None) -> None:
            async with connects:
                try:
                    _, proto = await loop.create_connection(
                        lambda: _Stream(cap, requests[cap.spec], hang_up), self.host, self.port
                    )
                except OSError as exc:
                    cap.error = f"connect failed: {exc!r}"
                    return
            self._streams.append(proto)

        start = loop.time()
        tasks: list[asyncio.Task[None]] = []
        for i, (cap, hang_up) in enumerate(zip(self.captures, hang_ups, strict=True)):
            delay = start + i * step - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(open_stream(cap, hang_up)))
        await asyncio.gather(*tasks)

    async def wait_closed(self, within_s: float) -> None:
        """Wait until the server has closed every stream (or `within_s` passes)."""
        try:
            async with asyncio.timeout(within_s):
                await asyncio.gather(*(s.wait_closed() for s in self._streams))
        except TimeoutError:
            pass

    async def close_all(self, *, expected: bool = False) -> None:
        """Close what is still open: a hang-up if `expected`, else an error (deadline hit)."""
        for s in self._streams:
            if not s.cap.t_closed:
                if expected:
                    s.cap.hung_up = True
                elif not s.cap.hung_up:
                    s.cap.error = s.cap.error or "still open at the run's deadline"
            s.close()
        await self.wait_closed(5.0)


async def drive(host: str, port: int, plan: Plan) -> Run:
    """Run the plan to the end; `run.captures` has one Capture per stream, in plan order."""
    run = Run(host, port, plan)
    loop = asyncio.get_running_loop()
    end = loop.time() + plan.deadline_s
    watcher = asyncio.create_task(run.watch_lag())
    try:
        async with asyncio.timeout(plan.deadline_s):
            await run.open_all()
    except TimeoutError:
        pass
    await run.wait_closed(max(0.0, end - loop.time()))
    watcher.cancel()
    await run.close_all()
    return run


def random_hang_ups(n: int, span_s: float, seed: int) -> list[float | None]:
    """Disconnect times for the abandonment workload: uniform over a stream's natural life."""
    rng = random.Random(seed)
    return [rng.uniform(0.0, span_s) for _ in range(n)]
