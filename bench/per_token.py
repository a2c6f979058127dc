"""`python -m bench.per_token`: what one token costs, stage by stage, in this process.

Each stage of the data path is timed on its own over the same tokens, on uvloop, with a real
loopback TCP connection for the write (its peer drains in the same loop):

- engine step: the synthetic engine's per-token work (`_Run.step`) into a sink that does nothing;
- render: the renderer's templated payload plus the SSE frame;
- log append: `EventLog.append` with one attached reader that does nothing;
- write: HTTP chunk framing + `transport.write` of a rendered event (the syscall);
- metrics: the delivery accounting (clock read, inter-chunk histogram, counters);
- whole path: engine step → stream → log → writer → socket, the server's real objects (and
  once more into a transport that drops the bytes: the Python work alone);
  what it costs beyond the sum of the stages is the glue (calls, attribute lookups);
- floor: the raw floor's per-token work, `transport.write` of a prebuilt frame.

Stages are timed in batches with `perf_counter_ns`; the figure is the median of several
batches (µs per token). The sum of stages should be close to the whole path; the whole path
over the floor is the data plane's own cost. Not counted here: HTTP parsing and the event
loop's own wakeups (once per step, shared by every stream due then), which the saturation
workload of `python -m bench` includes.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import uvloop

from firsttoken.core.registry import StreamRegistry
from firsttoken.core.sender import EventSender
from firsttoken.core.stream import Stream
from firsttoken.engines import GenerationRequest
from firsttoken.engines.synthetic import Script, SyntheticEngine, _Run
from firsttoken.formats.render import ChatRenderer
from firsttoken.resume import EventLog
from firsttoken.telemetry.metrics import Metrics
from firsttoken.wire.exchange import ChunkedBody

__all__ = ["main", "measure", "render_table", "stages"]

_PROMPT = "per-token cost"


class _NullSink:
    def push(self, text: str, finish: str | None = None) -> bool:
        return True

    def finish(self, reason: str) -> None:
        return None

    def fail(self, error: object) -> None:
        return None


class _NoTimers:
    """The engine's loop, for a step timed alone: its next tick is never armed."""

    def call_at(self, when: float, callback: object, *args: object) -> None:
        return None

    def time(self) -> float:
        return 0.0


class _NullTransport:
    def write(self, data: bytes) -> None:
        return None


class _NullReader:
    cursor = 0

    def deliver(self, seq: int, wire: bytes, tokens: int) -> None:
        self.cursor = seq

    def log_closed(self) -> None:
        return None

    def catch_up(self) -> None:
        return None


def _drain(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    with conn:
        while conn.recv(1 << 20):
            pass


async def _drained(transport: asyncio.Transport) -> None:
    """Let the peer drain what a stage left buffered (a transport has no drained event)."""
    for _ in range(500):
        if not transport.get_write_buffer_size():
            return
        await asyncio.sleep(0.01)


def _time(batch: Callable[[], int], rounds: int) -> float:
    """Median µs per token over `rounds` batches; `batch` returns the tokens it handled."""
    per: list[float] = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        n = batch()
        per.append((time.perf_counter_ns() - start) / 1000 / n)
    return statistics.median(per)


async def stages(tokens_per_batch: int, rounds: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    # The peer drains from a thread, so writes reach the kernel as they would to a reader
    # that keeps up (a peer in this loop would only read between batches).
    listener = socket.create_server(("127.0.0.1", 0))
    draining = threading.Thread(target=_drain, args=(listener,), daemon=True)
    draining.start()
    transport, _ = await loop.create_connection(
        asyncio.Protocol, "127.0.0.1", listener.getsockname()[1]
    )
    tokens = ["token" if i % 2 else " text" for i in range(tokens_per_batch)]
    renderer = ChatRenderer("chatcmpl-" + "0" * 32, "synthetic", int(time.time()), False)
    frame = b"id: %d\ndata: %s\n\n" % (1, renderer.token(" text"))
    metrics = Metrics()
    out: dict[str, float] = {}

    engine = SyntheticEngine(ttft_ms=0, itl_ms=20)
    engine._loop = _NoTimers()  # type: ignore[assignment]

    def engine_step() -> int:
        run = _Run(engine, "r", Script(), 0.02, None, _NullSink(), 0.0)
        run.tokens, run.stop_at = list(tokens), len(tokens)  # the plan's parts, taken already
        for _ in range(len(tokens) - 1):
            run.step(0.0)
        engine._ticks.clear()
        return len(tokens) - 1

    def render() -> int:
        token, fmt = renderer.token, b"id: %d\ndata: %s\n\n"
        for i, text in enumerate(tokens):
            fmt % (i, token(text))
        return len(tokens)

    def log_append() -> int:
        log = EventLog(len(tokens) + 1)
        log.attach(_NullReader())
        for _ in tokens:
            log.append(frame, 1)
        return len(tokens)

    def write() -> int:
        data = frame
        for _ in tokens:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return len(tokens)

    def account() -> int:
        clock, observe = time.perf_counter, metrics.inter_chunk.observe
        last = clock()
        for _ in tokens:
            now = clock()
            observe(now - last)
            last = now
            metrics.tokens_sent += 1
        return len(tokens)

    def floor() -> int:
        for _ in tokens:
            transport.write(frame)
        return len(tokens)

    registry = StreamRegistry(engine, metrics, ttl_s=1.0)

    def whole_path(out: Any = transport) -> int:
        request = GenerationRequest(request_id="s", prompt=_PROMPT, model="synthetic")
        stream = Stream(
            request,
            renderer,
            format="openai",
            trace_id="t",
            grace_s=0,
            prompt_tokens=1,
            max_events=len(tokens) + 8,
            accepted_at=time.perf_counter(),
            window=4,
        )
        writer = EventSender(
            stream,
            registry,
            metrics,
            ChunkedBody(out),
            after=0,
            heartbeat_s=15,
            send_timeout_s=30,
            timestamps=False,
            compressor=None,
        )
        stream.log.attach(writer)
        run = _Run(engine, "s", Script(), 0.02, None, stream, 0.0)
        run.tokens, run.stop_at = list(tokens), len(tokens)
        for _ in range(len(tokens) - 1):
            run.step(0.0)
        engine._ticks.clear()
        stream.log.detach(writer)
        return len(tokens) - 1

    stages: list[tuple[str, Callable[[], int]]] = [
        ("engine step", engine_step),
        ("render", render),
        ("log append", log_append),
        ("write (syscall)", write),
        ("metrics", account),
        ("whole path", whole_path),
        ("whole path, no syscall", lambda: whole_path(_NullTransport())),
        ("raw floor write", floor),
    ]
    for name, fn in stages:
        fn()  # warm up
        out[name] = _time(fn, rounds)
        await _drained(transport)
    transport.close()
    draining.join(timeout=5)
    listener.close()
    return out


def render_table(costs: dict[str, Any]) -> str:
    floor = costs["raw floor write"]
    parts = ["engine step", "render", "log append", "write (syscall)", "metrics"]
    lines = ["PER-TOKEN COST — µs per token, median of batches (in process, uvloop, loopback TCP)"]
    lines.append(f"{'stage':<22} {'µs/token':>9} {'× floor':>8}")
    for name in [*parts, "whole path", "whole path, no syscall", "raw floor write"]:
        lines.append(f"{name:<22} {costs[name]:>9.2f} {costs[name] / floor:>8.2f}")
    total = sum(costs[p] for p in parts)
    lines.append(f"{'sum of stages':<22} {total:>9.2f} {total / floor:>8.2f}")
    return "\n".join(lines)


def measure(tokens_per_batch: int = 2000, rounds: int = 15) -> dict[str, float]:
    return uvloop.run(stages(tokens_per_batch, rounds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.per_token", description=__doc__)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per timed batch")
    parser.add_argument("--rounds", type=int, default=15, help="batches per stage")
    args = parser.parse_args(argv)
    print(render_table(measure(args.tokens, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
