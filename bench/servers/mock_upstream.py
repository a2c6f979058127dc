"""A zero-delay mock upstream: OpenAI chat chunks from one shared ticker, keep-alive.

The upstream of `bench.gateways` (the method of the public gateway board: a mock that answers
at once and streams a fixed number of chunks a fixed time apart). A bare asyncio Protocol on
uvloop, as `raw_floor` is, so that what a gateway adds is not hidden under the upstream's own
cost: every frame pre-encoded once per distinct answer, one loop timer per distinct tick. It
differs from the raw floor where an upstream must: connections are kept alive (a gateway's
pool reuses them; `Connection: close` is honoured), bodies are chunked, `GET /v1/models`
answers, `max_completion_tokens` counts as `max_tokens`, and it may listen on several ports
(one per target of a route), counting the requests each port took (`GET /stats`).

    python -m bench.servers.mock_upstream serve --port 0 [--ports 3] [--synthetic-itl-ms 20]

Timing per request: `synthetic.ttft_ms` / `synthetic.itl_ms` in the body, else the options
(default TTFT 0, ITL 20 ms). The text is the synthetic engine's for the request (`bench/expected.py`
checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast

import orjson
import uvloop

from bench.expected import chat_prompt
from firsttoken.engines.synthetic import synthetic_tokens

__all__ = ["main"]

_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_END = b"0\r\n\r\n"
_MAX_HEAD = 65536


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _json(status: str, body: bytes, close: bool) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body


@dataclass(frozen=True, slots=True)
class Frames:
    opening: bytes  # HTTP head + the role chunk
    tokens: tuple[bytes, ...]
    closing: bytes  # finish chunk, usage chunk, [DONE], the chunked body's end


@lru_cache(maxsize=256)
def _frames(prompt: str, seed: int | None, max_tokens: int | None) -> Frames:
    tokens, finish = synthetic_tokens(prompt, seed, max_tokens)
    created = int(time.time())

    def chunk(delta: dict[str, str], finish_reason: str | None, **more: Any) -> bytes:
        body = {
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": created,
            "model": "synthetic",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            **more,
        }
        return _chunked(b"data: %s\n\n" % orjson.dumps(body))

    usage = {"prompt_tokens": 8, "completion_tokens": len(tokens), "total_tokens": 8 + len(tokens)}
    usage_chunk = {
        "id": "chatcmpl-mock",
        "object": "chat.completion.chunk",
        "created": created,
        "model": "synthetic",
        "choices": [],
        "usage": usage,
    }
    closing = b"".join(
        (
            chunk({}, finish),
            _chunked(b"data: %s\n\n" % orjson.dumps(usage_chunk)),
            _chunked(b"data: [DONE]\n\n"),
            _END,
        )
    )
    opening = _HEAD + chunk({"role": "assistant", "content": ""}, None)
    return Frames(opening, tuple(chunk({"content": t}, None) for t in tokens), closing)


class _Ticker:
    """ONE schedule for every stream: tick (int ms) → the streams due then; a timer per tick."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: dict[int, list[_Connection]] = {}

    def add(self, conn: _Connection, at_ms: float) -> None:
        tick = math.ceil(at_ms)
        if (due := self._due.get(tick)) is not None:
            due.append(conn)
        else:
            self._due[tick] = [conn]
            self._loop.call_at(tick / 1000, self._step, tick)

    def _step(self, tick: int) -> None:
        now_ms = self._loop.time() * 1000
        for conn in self._due.pop(tick):
            if (at := conn.step(now_ms)) is not None:
                self.add(conn, at)


@dataclass(slots=True)
class Options:
    ttft_ms: float
    itl_ms: float
    counts: list[int]  # requests taken, per listening port
    active: int = 0  # answers streaming now


class _Connection(asyncio.Protocol):
    """One client connection: requests one after another (no pipelining), each streamed."""

    def __init__(self, ticker: _Ticker, options: Options, port_index: int) -> None:
        self._ticker = ticker
        self._options = options
        self._port_index = port_index
        self._buf = b""
        self._tr: asyncio.Transport | None = None
        self._frames: Frames | None = None  # the answer in progress
        self._i = 0
        self._token_at = 0.0
        self._itl_ms = 0.0
        self._close_after = False
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tr = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._frames is None:
            self._next_request()

    def _next_request(self) -> None:
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD:
                self._reply(_json("400 Bad Request", b"{}", True))
            return
        head = buf[:end].lower()
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip() == b"content-length":
                length = int(value.strip() or b"0")
        if len(buf) < end + 4 + length:
            return
        body, self._buf = buf[end + 4 : end + 4 + length], buf[end + 4 + length :]
        self._close_after = b"\r\nconnection: close" in head
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0]
        if method == b"get" and path.startswith(b"/v1/models"):
            models = {"object": "list", "data": [{"id": "synthetic", "object": "model"}]}
            self._reply(_json("200 OK", orjson.dumps(models), self._close_after))
        elif method == b"get" and path.startswith(b"/stats"):
            stats = {"requests": self._options.counts, "active": self._options.active}
            self._reply(_json("200 OK", orjson.dumps(stats), self._close_after))
        elif method == b"post":
            try:
                self._start(orjson.loads(body))
            except (ValueError, KeyError, TypeError):
                self._reply(_json("400 Bad Request", b'{"error": {"message": "bad"}}', True))
        else:
            self._reply(_json("404 Not Found", b"{}", self._close_after))

    def _reply(self, data: bytes) -> None:
        assert self._tr is not None
        self._tr.write(data)
        if self._close_after or b"Connection: close" in data[:200]:
            self._tr.close()
        elif self._buf:
            self._next_request()

    def _start(self, request: dict[str, Any]) -> None:
        opts = self._options
        opts.counts[self._port_index] += 1
        opts.active += 1
        knobs = request.get("synthetic") or {}
        ttft = knobs.get("ttft_ms")
        ttft = opts.ttft_ms if ttft is None else float(ttft)
        itl = knobs.get("itl_ms")
        self._itl_ms = opts.itl_ms if itl is None else float(itl)
        limit = request.get("max_tokens") or request.get("max_completion_tokens")
        prompt = chat_prompt(request["messages"])
        self._frames = _frames(prompt, request.get("seed"), limit)
        self._i = 0
        assert self._tr is not None
        self._tr.write(self._frames.opening)
        self._token_at = asyncio.get_running_loop().time() * 1000 + ttft
        if ttft <= 0:
            self._write_due(self._token_at)
        if self._frames is not None:
            self._ticker.add(self, self._token_at)

    def step(self, now_ms: float) -> float | None:
        """Write what is due; when this connection is next due, or None."""
        if self._lost or self._frames is None:
            return None
        return self._write_due(now_ms)

    def _write_due(self, now_ms: float) -> float | None:
        frames, tr = self._frames, self._tr
        assert frames is not None and tr is not None
        if self._token_at > now_ms + 0.5:
            return self._token_at
        i = self._i
        if i < len(frames.tokens):
            tr.write(frames.tokens[i])
            self._i = i = i + 1
        if i >= len(frames.tokens):
            tr.write(frames.closing)
            self._frames = None
            self._options.active -= 1
            if self._close_after:
                tr.close()
            elif self._buf:
                self._next_request()
            return None
        self._token_at += self._itl_ms
        if self._token_at < now_ms - self._itl_ms:
            self._token_at = now_ms  # fell behind: no burst to catch up (the engine's rule)
        return self._token_at

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._frames is not None:
            self._frames = None
            self._options.active -= 1


async def _serve(host: str, port: int, ports: int, options: Options) -> None:
    loop = asyncio.get_running_loop()
    ticker = _Ticker(loop)
    servers = []
    urls = []
    for index in range(ports):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port + index if port else 0))

        def factory(index: int = index) -> _Connection:
            return _Connection(ticker, options, index)

        servers.append(await loop.create_server(factory, sock=sock, backlog=4096))
        bound = sock.getsockname()
        urls.append(f"http://{bound[0]}:{bound[1]}")
    print(json.dumps({"msg": "listening", "url": urls[0], "urls": urls}), flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.servers.mock_upstream")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ports", type=int, default=1, help="listen on this many ports")
    parser.add_argument("--synthetic-ttft-ms", type=float, default=0.0)
    parser.add_argument("--synthetic-itl-ms", type=float, default=20.0)
    parser.add_argument("--heartbeat-s", type=float, default=15.0, help="(accepted, unused)")
    args = parser.parse_args(argv)
    options = Options(args.synthetic_ttft_ms, args.synthetic_itl_ms, [0] * args.ports)
    uvloop.run(_serve(args.host, args.port, args.ports, options))


if __name__ == "__main__":
    main()
