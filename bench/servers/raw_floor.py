"""The raw floor: the least Python can do to stream this answer over SSE.

A bare asyncio Protocol on uvloop. It parses just enough HTTP to read the body, looks the
answer up pre-encoded (every SSE frame built once per distinct answer, no JSON per token) and
writes frames from timer callbacks: no framework, no coroutine per stream, no chunked encoding.
Timing matches the synthetic engine: TTFT, then one token every ITL on a fixed schedule.

    python -m bench.servers.raw_floor serve --port 0 --synthetic-ttft-ms 200 --synthetic-itl-ms 20
"""

from __future__ import annotations

import asyncio
import json
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


class _Stream(asyncio.Protocol):
    __slots__ = (
        "_buf",
        "_due",
        "_frames",
        "_hb",
        "_i",
        "_itl",
        "_loop",
        "_settings",
        "_tick",
        "_tr",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, settings: Settings) -> None:
        self._loop = loop
        self._settings = settings
        self._buf = b""
        self._tr: asyncio.Transport | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._hb: asyncio.TimerHandle | None = None
        self._frames: Frames | None = None
        self._i = 0
        self._due = 0.0
        self._itl = settings.itl_s

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
            self._itl = knobs["itl_ms"] / 1000
        prompt = chat_prompt(request["messages"])
        self._frames = _frames(prompt, request.get("seed"), request.get("max_tokens"))
        assert self._tr is not None
        self._tr.write(self._frames.opening)
        self._due = self._loop.time() + ttft
        self._tick = self._loop.call_at(self._due, self._next_token)
        self._hb = self._loop.call_later(self._settings.heartbeat_s, self._ping)

    def _next_token(self) -> None:
        frames = self._frames
        tr = self._tr
        assert frames is not None and tr is not None
        if self._i < len(frames.tokens):
            tr.write(frames.tokens[self._i])
            self._i += 1
        if self._i >= len(frames.tokens):
            tr.write(frames.closing)
            self._stop_timers()
            tr.close()
            return
        self._due += self._itl
        now = self._loop.time()
        if self._due < now - self._itl:
            self._due = now  # fell behind: don't burst to catch up (same rule as the engine)
        self._tick = self._loop.call_at(self._due, self._next_token)

    def _ping(self) -> None:
        assert self._tr is not None
        self._tr.write(_PING)
        self._hb = self._loop.call_later(self._settings.heartbeat_s, self._ping)

    def _reject(self) -> None:
        assert self._tr is not None
        self._tr.write(_BAD)
        self._tr.close()
        self._frames = Frames(b"", (), b"")

    def _stop_timers(self) -> None:
        for handle in (self._tick, self._hb):
            if handle is not None:
                handle.cancel()
        self._tick = self._hb = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timers()


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
    server = await loop.create_server(
        lambda: _Stream(loop, settings), sock=sock, backlog=4096, reuse_address=True
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
