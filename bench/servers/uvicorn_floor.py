"""Issue 12's experiment as a baseline: the least a server on uvicorn can do per token.

uvicorn (httptools + uvloop) parses HTTP; one plain ASGI coroutine per request reads the body,
sends the head through ASGI and then only waits for the end. ONE shared ticker (a dict of
tick in ms → the streams due then, one loop timer per distinct tick) writes every due
stream's token: the OpenAI chunk rendered per token as a prebuilt prefix +
`orjson.dumps(token)` + suffix, in HTTP chunk framing, straight to the connection's
transport; heartbeats ride the same schedule, and the protocol's `connection_lost` ends a
stream whose client has gone. No event log, no backpressure, no metrics: an upper bound for
any server on uvicorn, not a design. Same schedule, text and options as `raw_floor`.

    python -m bench.servers.uvicorn_floor serve --port 0 --synthetic-ttft-ms 200
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bench.expected import chat_prompt
from bench.servers.baseline_cli import listening_socket, parse_serve_args
from firsttoken.engines.synthetic import synthetic_tokens

__all__ = ["main"]

CONNECTION_KEY = "uvicorn_floor.connection"
_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"text/event-stream"),
        (b"cache-control", b"no-cache, no-transform"),
        (b"x-accel-buffering", b"no"),
    ],
}
_END = {"type": "http.response.body", "body": b"", "more_body": False}
# One OpenAI chat chunk is _DELTA + the delta + its end; for a token, _PREFIX + JSON + _SUFFIX.
_DELTA = (
    b'{"id":"chatcmpl-uvfloor","object":"chat.completion.chunk","created":%d,'
    b'"model":"synthetic","choices":[{"index":0,"delta":' % int(time.time())
)
_PREFIX = _DELTA + b'{"content":'
_SUFFIX = b'},"finish_reason":null}]}'
_ROLE = _DELTA + b'{"role":"assistant","content":""' + _SUFFIX


def _chunk(event: bytes) -> bytes:
    """HTTP chunk framing: uvicorn chose chunked, since the head has no content-length."""
    return b"%x\r\n%b\r\n" % (len(event), event)


def _event(seq: int, data: bytes) -> bytes:
    return _chunk(b"id: %d\ndata: %b\n\n" % (seq, data))


_PING = _chunk(b": ping\n\n")
_DONE = b"data: [DONE]\n\n"


class Connection(HttpToolsProtocol):
    """uvicorn's protocol, in the scope, telling its stream when the client has gone."""

    on_lost: Stream | None = None
    began = 0.0  # the request's first byte (perf_counter), where firsttoken's TTFT starts

    def on_message_begin(self) -> None:
        self.began = time.perf_counter()
        super().on_message_begin()
        self.scope[CONNECTION_KEY] = self  # type: ignore[literal-required]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.on_lost is not None:
            self.on_lost.end()


class Stream:
    """One response on the shared schedule: when its next token and ping are due (loop ms)."""

    __slots__ = (
        "done",
        "finish",
        "hb_ms",
        "i",
        "itl_ms",
        "on_first",
        "ping_at",
        "token_at",
        "tokens",
        "tr",
    )

    def __init__(
        self, tr: Any, tokens: list[str], finish: str, itl_ms: float, hb_ms: float
    ) -> None:
        self.tr, self.tokens, self.finish = tr, tokens, finish
        self.itl_ms, self.hb_ms = itl_ms, hb_ms
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.i, self.token_at, self.ping_at = 0, 0.0, 0.0
        self.on_first: Callable[[], None] | None = None  # --log-ttft: told once it is written

    def step(self, tick: int, now_ms: float) -> float | None:
        """Write what is due at `tick`; when this stream is next due, or None: it has ended."""
        if self.done.done():
            return None  # the client went away: no more writes
        if self.ping_at <= tick:
            self.tr.write(_PING)
            self.ping_at = now_ms + self.hb_ms
        if self.token_at <= tick:
            i, tokens = self.i, self.tokens
            if i < len(tokens):
                self.i = i = i + 1
                self.tr.write(_event(i, _PREFIX + orjson.dumps(tokens[i - 1]) + _SUFFIX))
                if i == 1 and self.on_first is not None:
                    self.on_first()
            if i >= len(tokens):
                finish = _DELTA + b'{},"finish_reason":%b}]}' % orjson.dumps(self.finish)
                self.tr.write(_event(i + 1, finish) + _chunk(_DONE))
                self.end()
                return None
            self.token_at += self.itl_ms
            if self.token_at < now_ms - self.itl_ms:
                self.token_at = now_ms  # fell behind: don't burst to catch up (engine's rule)
        return min(self.token_at, self.ping_at)

    def end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class Ticker:
    """ONE schedule for every stream: tick (int ms) → the streams due then; a timer per tick."""

    def __init__(self) -> None:
        self.due: dict[int, list[Stream]] = {}

    def start(self, stream: Stream, ttft_ms: float) -> None:
        stream.tr.write(_event(0, _ROLE))
        now_ms = asyncio.get_running_loop().time() * 1000
        stream.token_at, stream.ping_at = now_ms + ttft_ms, now_ms + stream.hb_ms
        self._add(stream, min(stream.token_at, stream.ping_at))

    def _add(self, stream: Stream, at_ms: float) -> None:
        tick = math.ceil(at_ms)
        if (streams := self.due.get(tick)) is not None:
            streams.append(stream)
        else:
            self.due[tick] = [stream]
            asyncio.get_running_loop().call_at(tick / 1000, self._step, tick)

    def _step(self, tick: int) -> None:
        now_ms = asyncio.get_running_loop().time() * 1000
        for stream in self.due.pop(tick):
            if (at := stream.step(tick, now_ms)) is not None:
                self._add(stream, at)


def _ttft_logger(connection: Connection, scope: dict[str, Any]) -> Callable[[], None]:
    """The `stream.first_token` line firsttoken logs, for this request: its X-Request-ID as
    the trace id, TTFT from its first byte to the first token's write."""
    began = connection.began
    rid = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")

    def log() -> None:
        ttft_ms = (time.perf_counter() - began) * 1000
        line = {"event": "stream.first_token", "trace_id": rid, "ttft_ms": ttft_ms}
        print(json.dumps({**line, "ts": time.time()}), flush=True)

    return log


def build_app(ttft_s: float, itl_s: float, heartbeat_s: float, log_ttft: bool = False) -> Any:
    ticker = Ticker()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body, message = b"", {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            body += message.get("body", b"")
        request = orjson.loads(body)
        knobs = request.get("synthetic") or {}
        ttft = ttft_s if knobs.get("ttft_ms") is None else knobs["ttft_ms"] / 1000
        itl = itl_s if knobs.get("itl_ms") is None else knobs["itl_ms"] / 1000
        prompt = chat_prompt(request["messages"])
        limit = request.get("max_tokens") or request.get("max_completion_tokens")
        tokens, finish = synthetic_tokens(prompt, request.get("seed"), limit)
        await send(_START)
        connection: Connection = scope[CONNECTION_KEY]
        stream = Stream(connection.transport, tokens, finish, itl * 1000, heartbeat_s * 1000)
        connection.on_lost = stream
        if log_ttft:
            stream.on_first = _ttft_logger(connection, scope)
        ticker.start(stream, ttft * 1000)
        await stream.done
        connection.on_lost = None
        await send(_END)  # uvicorn writes the last chunk (`0\r\n\r\n`), then keeps alive or closes

    return app


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_serve_args("python -m bench.servers.uvicorn_floor", argv)
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    app = build_app(
        args.synthetic_ttft_ms / 1000, args.synthetic_itl_ms / 1000, args.heartbeat_s, args.log_ttft
    )
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=Connection,
        interface="asgi3",
        lifespan="off",
        access_log=False,
        log_level="warning",
        backlog=4096,
        timeout_graceful_shutdown=1,
    )
    print(json.dumps({"msg": "listening", "url": f"http://{host}:{port}"}), flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
