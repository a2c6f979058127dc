"""`python -m bench.relay_chunk`: what a relayed chunk costs on its way to the client, in this
process, so the figure is not lost in the noise of separate processes.

The server's real objects, on uvloop: the engine `--engine openai --upstream URL` builds (a
one-route `RoutedEngine` over a `RelayEngine`), the registry's `_Pulled` task pushing its
deltas into a `Stream`, and an `EventSender` writing its frames. The upstream is a loopback
server in the same loop; once it has answered the head, each timed chunk is handed to the
upstream connection's protocol (`data_received`, as the loop would on a read), and the
writer's transport notes when the client's frame is written. No syscall is timed, only the
gateway's Python and the one loop wake between the protocol and the stream's task.

- per chunk: an upstream chunk's bytes in → the client's frame written, in µs (median over
  the chunks of each stream, then over the streams);
- first chunk: the same, for the stream's first content chunk (its route leg's first-token
  bookkeeping, the stream's first frame);
- request out: from the `_Pulled` task's start to the upstream request's write (the
  request's own path: the route's choice, the leg, its body, the request's bytes), and
  request in: to the upstream's reading its last byte, over loopback;
- floor: bytes handed to a protocol that wakes a task, which writes: the one loop wake that
  any design with a task per stream pays.

`--rev REV` runs the same measurement on another commit's `firsttoken/` (a `git archive` in
a temporary folder), in turns with this tree's, and prints both: the before and after of a
change, on the same machine at the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

__all__ = ["main", "measure"]

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})


def _sse(obj: dict[str, Any]) -> bytes:
    data = b"data: %s\n\n" % orjson.dumps(obj)
    return b"%x\r\n%b\r\n" % (len(data), data)


def _chunk(i: int) -> bytes:
    return _sse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}],
        }
    )


_ROLE = _sse(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
    }
)
_END = (
    _sse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        }
    )
    + _sse({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": {}})
    + b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n")
)


class _Upstream(asyncio.Protocol):
    """One upstream connection: GET /models answered whole; a POST's arrival noted, and its
    event stream written by the bench (`stream`)."""

    def __init__(self, bench: _Bench) -> None:
        self.bench = bench
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head, sep, rest = self.buf.partition(b"\r\n\r\n")
        if not sep:
            return
        if head.startswith(b"GET"):
            self.buf = rest
            assert self.transport is not None
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(_MODELS), _MODELS)
            )
            return
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        if len(rest) < length:
            return
        self.buf = rest[length:]
        self.bench.asked(self)


class _Client:
    """The writer's transport: each frame's time, for the bench to wait on."""

    def __init__(self, bench: _Bench) -> None:
        self.bench = bench

    def write(self, data: bytes) -> None:
        self.bench.arrived(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False


class _Bench:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.asked_at = 0.0
        self.written_at = 0.0
        self.upstream: asyncio.Future[_Upstream] | None = None
        self.frame: asyncio.Future[float] | None = None

    def asked(self, conn: _Upstream) -> None:
        self.asked_at = time.perf_counter()
        if self.upstream is not None and not self.upstream.done():
            self.upstream.set_result(conn)

    def arrived(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.frame is not None and not self.frame.done() and b"tok" in data:
            self.frame.set_result(now)


async def _one_stream(
    bench: _Bench,
    engine: Any,
    registry: Any,
    metrics: Any,
    client: _Client,
    n: int,
    chunks: int,
) -> tuple[float, float, float, list[float]]:
    """(request out s, request in s, first chunk s, later chunks s) of one relayed stream."""
    from firsttoken.core.registry import _Pulled
    from firsttoken.core.stream import Stream

    try:
        from firsttoken.core.sender import EventSender
    except ImportError:  # --rev: a tree from before the rename
        from firsttoken.core.writer import EventWriter as EventSender  # type: ignore[no-redef]
    from firsttoken.formats.render import ChatRenderer
    from firsttoken.generation import GenerationRequest
    from firsttoken.wire.exchange import ChunkedBody

    body = {"model": "m", "messages": [{"role": "user", "content": "bench"}], "stream": True}
    request = GenerationRequest(
        request_id=f"s{n}",
        prompt="user: bench",
        model="m",
        messages=({"role": "user", "content": "bench"},),
        body=body,
        max_tokens=chunks + 8,
    )
    renderer = ChatRenderer("chatcmpl-" + "0" * 32, "m", int(time.time()), False)
    # The stream's API format was `kind` before it was `format` (--rev runs older trees).
    params = inspect.signature(Stream.__init__).parameters
    format_param = "format" if "format" in params else "kind"
    stream = Stream(
        request,
        renderer,
        **{format_param: "openai"},
        trace_id="t",
        grace_s=0,
        prompt_tokens=1,
        max_events=chunks + 64,
        accepted_at=time.perf_counter(),
    )
    writer = EventSender(
        stream,
        registry,
        metrics,
        ChunkedBody(client),
        after=0,
        heartbeat_s=15,
        send_timeout_s=30,
        timestamps=False,
        compressor=None,
    )
    stream.log.attach(writer)
    bench.upstream = bench.loop.create_future()
    pulled = _Pulled(engine, stream, request)
    started = time.perf_counter()
    task = bench.loop.create_task(pulled.run())
    up = await bench.upstream
    request_out = bench.written_at - started
    request_in = bench.asked_at - started
    transport = up.transport
    assert transport is not None
    transport.write(_HEAD + _ROLE)
    for _ in range(2000):  # until the head and the role chunk have come through
        conn = _relaying(engine)
        if conn is not None:
            break
        await asyncio.sleep(0.0005)
    assert conn is not None
    times: list[float] = []
    for i in range(chunks):
        bench.frame = bench.loop.create_future()
        data = _chunk(i)
        sent = time.perf_counter()
        conn.data_received(data)
        times.append(await bench.frame - sent)
    conn.data_received(_END)
    await task
    stream.log.detach(writer)
    assert stream.outcome is not None
    return request_out, request_in, times[0], times[1:]


async def _measure(streams: int, chunks: int) -> dict[str, float]:
    from firsttoken.config import Settings
    from firsttoken.core.registry import StreamRegistry
    from firsttoken.routing.build import build_engine
    from firsttoken.telemetry.metrics import Metrics

    loop = asyncio.get_running_loop()
    bench = _Bench()
    server = await loop.create_server(lambda: _Upstream(bench), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = _Client(bench)
    from firsttoken.engines.upstream import _Connection

    send = _Connection.send

    def sent(conn: Any, data: bytes) -> Any:
        bench.written_at = time.perf_counter()  # the request's bytes, about to be written
        return send(conn, data)

    _Connection.send = sent  # type: ignore[method-assign,assignment]
    settings = Settings(engine="openai", upstream=f"http://127.0.0.1:{port}")
    engine = build_engine(settings)
    await engine.start()
    metrics = Metrics()
    registry = StreamRegistry(engine, metrics, ttl_s=1.0)
    outs: list[float] = []
    ins: list[float] = []
    firsts: list[float] = []
    per_chunk: list[float] = []
    try:
        for n in range(streams + 2):
            out, in_, first, rest = await _one_stream(
                bench, engine, registry, metrics, client, n, chunks
            )
            if n < 2:
                continue  # warm-up: the first connections, the first calls
            outs.append(out)
            ins.append(in_)
            firsts.append(first)
            per_chunk.append(statistics.median(rest))
    finally:
        await engine.close()
        server.close()
    us = 1e6
    return {
        "per chunk": statistics.median(per_chunk) * us,
        "first chunk": statistics.median(firsts) * us,
        "request out": statistics.median(outs) * us,
        "request in": statistics.median(ins) * us,
        "floor": await _floor(chunks) * us,
    }


def _relaying(engine: Any) -> Any:
    """The upstream connection carrying the stream now (the relay's pool's busy one)."""
    for target in engine.targets.values():
        for conn in target.engine._pool._busy:
            if conn.response is not None and conn.response.status_code:
                return conn
    return None


async def _floor(chunks: int) -> float:
    """Median s from bytes handed to a protocol to a task's write of them: one loop wake."""
    loop = asyncio.get_running_loop()
    box: list[bytes] = []
    waiter: list[asyncio.Future[None]] = []
    written: list[asyncio.Future[float]] = []

    def received(data: bytes) -> None:
        box.append(data)
        if waiter and not waiter[0].done():
            waiter[0].set_result(None)

    async def relay() -> None:
        for _ in range(chunks):
            if not box:
                waiter[:] = [loop.create_future()]
                await waiter[0]
            box.clear()
            written[0].set_result(time.perf_counter())

    task = loop.create_task(relay())
    await asyncio.sleep(0)
    times = []
    for i in range(chunks):
        written[:] = [loop.create_future()]
        sent = time.perf_counter()
        received(_chunk(i))
        times.append(await written[0] - sent)
    await task
    return statistics.median(times)


def measure(streams: int = 30, chunks: int = 200) -> dict[str, float]:
    import uvloop

    return uvloop.run(_measure(streams, chunks))


def _tree(rev: str, into: Path) -> Path:
    """`rev`'s firsttoken/ in `into`, beside this file's bench/ (the measurement stays)."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "firsttoken"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "bench").mkdir()
    shutil.copy(root / "bench" / "__init__.py", into / "bench" / "__init__.py")
    shutil.copy(Path(__file__), into / "bench" / "relay_chunk.py")
    return into


def _run_in(tree: Path, streams: int, chunks: int) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.relay_chunk",
            "--json",
            "--streams",
            str(streams),
            "--chunks",
            str(chunks),
        ],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        check=True,
        capture_output=True,
    ).stdout
    result: dict[str, float] = orjson.loads(out)
    return result


def _table(results: dict[str, list[dict[str, float]]]) -> str:
    names = list(results)
    lines = [
        "RELAYED CHUNK — µs, median of runs (in process, uvloop, loopback upstream and client)"
    ]
    lines.append(f"{'':14}" + "".join(f"{n:>14}" for n in names))
    for figure in ("per chunk", "first chunk", "request out", "request in", "floor"):
        row = [statistics.median(r[figure] for r in results[n]) for n in names]
        lines.append(f"{figure:14}" + "".join(f"{v:>14.1f}" for v in row))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_chunk", description=__doc__)
    parser.add_argument("--streams", type=int, default=30, help="streams per run")
    parser.add_argument("--chunks", type=int, default=200, help="chunks per stream")
    parser.add_argument("--runs", type=int, default=3, help="runs per tree, in turns")
    parser.add_argument("--rev", help="also measure this commit's firsttoken/, in turns")
    parser.add_argument("--json", action="store_true", help="one run's figures as JSON")
    args = parser.parse_args(argv)
    if args.json:
        sys.stdout.write(orjson.dumps(measure(args.streams, args.chunks)).decode())
        return 0
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": here}
        if args.rev:
            trees[args.rev] = _tree(args.rev, Path(tmp))
        results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.runs):
            for name, tree in trees.items():
                results[name].append(_run_in(tree, args.streams, args.chunks))
    print(_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
