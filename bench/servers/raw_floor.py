"""The raw floor: the least Python can do to stream this answer over SSE.

A bare asyncio Protocol on uvloop. It parses just enough HTTP to read the body, looks the
answer up pre-encoded (every SSE frame built once per distinct answer, no JSON per token) and
writes frames from ONE shared ticker (tick in ms → the streams due then, one loop timer per
distinct tick, as the experiment and the synthetic engine do; heartbeats ride it too): no
framework, no coroutine per stream, no timer per stream, no chunked encoding. Timing matches
the synthetic engine: TTFT, then one token every ITL on a fixed schedule.

    python -m bench.servers.raw_floor serve --port 0 --synthetic-ttft-ms 200 --synthetic-itl-ms 20
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import orjson
import uvloop

from bench.expected import chat_prompt
from bench.servers.baseline_cli import parse_serve_args
from firsttoken.engines.synthetic import synthetic_tokens

__all__ = ["main"]

_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache, no-transform\r\n"
    b"X-Accel-Buffering: no\r\n"
    b"Connection: close\r\n\r\n"
)
_BAD = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_PING = b": ping\n\n"
_MAX_HEAD = 65536


@dataclass(frozen=True, slots=True)
class Settings:
    ttft_s: float
    itl_s: float
    heartbeat_s: float


@dataclass(frozen=True, slots=True)
class Frames:
    opening: bytes  # HTTP head + the role chunk
    tokens: tuple[bytes, ...]
    closing: bytes  # finish chunk + [DONE]


@lru_cache(maxsize=256)
def _frames(prompt: str, seed: int | None, max_tokens: int | None) -> Frames:
    tokens, finish = synthetic_tokens(prompt, seed, max_tokens)
    created = int(time.time())

    def chunk(seq: int, delta: dict[str, str], finish_reason: str | None) -> bytes:
        body = {
            "id": "chatcmpl-rawfloor",
            "object": "chat.completion.chunk",
            "created": created,
            "model": "synthetic",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        return b"id: %d\ndata: %s\n\n" % (seq, orjson.dumps(body))

    opening = _HEAD + chunk(0, {"role": "assistant", "content": ""}, None)
    frames = tuple(chunk(i + 1, {"content": t}, None) for i, t in enumerate(tokens))
    closing = chunk(len(tokens) + 1, {}, finish) + b"data: [DONE]\n\n"
    return Frames(opening, frames, closing)


class _Ticker:
    """ONE schedule for every stream: tick (int ms) → the streams due then; a timer per tick."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._due: dict[int, list[_Stream]] = {}

    def add(self, stream: _Stream, at_ms: float) -> None:
        tick = math.ceil(at_ms)
        if (streams := self._due.get(tick)) is not None:
            streams.append(stream)
        else:
            self._due[tick] = [stream]
            self._loop.call_at(tick / 1000, self._step, tick)

    def _step(self, tick: int) -> None:
        now_ms = self._loop.time() * 1000
        for stream in self._due.pop(tick):
            if (at := stream.step(tick, now_ms)) is not None:
                self.add(stream, at)


class _Stream(asyncio.Protocol):
    __slots__ = (
        "_buf",
        "_closed",
        "_frames",
        "_i",
        "_itl_ms",
        "_ping_at",
        "_settings",
        "_ticker",
        "_token_at",
        "_tr",
    )

    def __init__(self, ticker: _Ticker, settings: Settings) -> None:
        self._ticker = ticker
        self._settings = settings
        self._buf = b""
        self._tr: asyncio.Transport | None = None
        self._frames: Frames | None = None
        self._closed = False
        self._i = 0
        self._token_at = self._ping_at = 0.0  # loop ms
        self._itl_ms = settings.itl_s * 1000

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tr = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio subclass

    def data_received(self, data: bytes) -> None:
        if self._frames is not None:
            return  # one request per connection
        self._buf += data
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD:
                self._reject()
            return
        length = _content_length(self._buf[:end])
        if length is None:
            self._reject()
            return
        body = self._buf[end + 4 : end + 4 + length]
        if len(body) < length:
            return
        try:
            self._start(orjson.loads(body))
        except (ValueError, KeyError, TypeError):
            self._reject()

    def _start(self, request: dict) -> None:
        knobs = request.get("synthetic") or {}
        ttft = self._settings.ttft_s
        if knobs.get("ttft_ms") is not None:
            ttft = knobs["ttft_ms"] / 1000
        if knobs.get("itl_ms") is not None:
            self._itl_ms = knobs["itl_ms"]
        prompt = chat_prompt(request["messages"])
        self._frames = _frames(prompt, request.get("seed"), request.get("max_tokens"))
        assert self._tr is not None
        self._tr.write(self._frames.opening)
        now_ms = asyncio.get_running_loop().time() * 1000
        self._token_at = now_ms + ttft * 1000
        self._ping_at = now_ms + self._settings.heartbeat_s * 1000
        self._ticker.add(self, min(self._token_at, self._ping_at))

    def step(self, tick: int, now_ms: float) -> float | None:
        """Write what is due at `tick`; when this stream is next due, or None: it has ended."""
        frames, tr = self._frames, self._tr
        if self._closed or frames is None or tr is None:
            return None  # the client went away: no more writes
        if self._ping_at <= tick:
            tr.write(_PING)
            self._ping_at = now_ms + self._settings.heartbeat_s * 1000
        if self._token_at <= tick:
            i, tokens = self._i, frames.tokens
            if i < len(tokens):
                tr.write(tokens[i])
                self._i = i = i + 1
            if i >= len(tokens):
                tr.write(frames.closing)
                self._closed = True
                tr.close()
                return None
            self._token_at += self._itl_ms
            if self._token_at < now_ms - self._itl_ms:
                self._token_at = now_ms  # fell behind: don't burst to catch up (engine's rule)
        return min(self._token_at, self._ping_at)

    def _reject(self) -> None:
        assert self._tr is not None
        self._tr.write(_BAD)
        self._tr.close()
        self._frames = Frames(b"", (), b"")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True  # the ticker drops it at its next due tick


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


async def _serve(host: str, port: int, settings: Settings) -> None:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    ticker = _Ticker(loop)
    server = await loop.create_server(
        lambda: _Stream(ticker, settings), sock=sock, backlog=4096, reuse_address=True
    )
    bound = sock.getsockname()
    print(json.dumps({"msg": "listening", "url": f"http://{bound[0]}:{bound[1]}"}), flush=True)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_serve_args("python -m bench.servers.raw_floor", argv)
    settings = Settings(
        args.synthetic_ttft_ms / 1000, args.synthetic_itl_ms / 1000, args.heartbeat_s
    )
    uvloop.run(_serve(args.host, args.port, settings))


if __name__ == "__main__":
    main()
