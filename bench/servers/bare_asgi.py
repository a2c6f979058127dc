"""A bare ASGI app for `bench.http_servers`: the least an ASGI app can do for each mode.

Served by uvicorn (`bare_uvicorn`) and by granian (`granian --interface asginl
bench.servers.bare_asgi:app`); standard library only (granian runs it from its own venv).
It reads the request body (every real server does), sends the headers, then per `BARE_MODE`
(see `bare_common`). In `stream` mode a token reaches the wire through ASGI `send`, from the
stream's own task, woken by the shared tick (`TickWaiter`): ASGI gives no other way to write.
Under uvicorn with `BARE_DIRECT=1`, the stream instead writes chunked frames straight to the
connection's transport from the shared ticker (firsttoken's data plane; see `bare_uvicorn`).
Under granian with `BARE_DIRECT=1`, the shared ticker calls granian's ASGI `send` for every
stream without awaiting it: granian's `send` is a Rust function that does its work when called
and returns an already-finished awaitable, so this works there (not under ASGI's contract,
which says `send` must be awaited; under uvicorn it would do nothing).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from bench.servers.bare_common import (
    COMMENT,
    DONE,
    FRAME,
    HEADERS,
    Mode,
    Ticker,
    TickWaiter,
    itl_s,
    mode,
    tokens,
)

__all__ = ["CONNECTION_KEY", "app"]

CONNECTION_KEY = "bare.connection"  # set by bare_uvicorn's protocol when BARE_DIRECT=1
_MODE = mode()
_TOKENS = tokens()
_HEADERS = [(k.encode(), v.encode()) for k, v in HEADERS]
_START = {"type": "http.response.start", "status": 200, "headers": _HEADERS}
_WAITER = TickWaiter(itl_s())
_TICKER = Ticker(_TOKENS, itl_s())
_NOWAIT = os.environ.get("BARE_DIRECT") == "1" and os.environ.get("BARE_SERVER") == "granian"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    message = await receive()
    while message.get("more_body"):
        message = await receive()
    await send(_START)
    if _MODE is Mode.BURST:
        await send({"type": "http.response.body", "body": FRAME, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif _MODE is Mode.IDLE:
        await send({"type": "http.response.body", "body": COMMENT, "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
    elif scope.get(CONNECTION_KEY) is not None:
        await _stream_direct(scope[CONNECTION_KEY], send)
    elif _NOWAIT:
        await _stream_nowait(send)
    else:
        await _stream_asgi(send)


async def _stream_asgi(send: Any) -> None:
    body = {"type": "http.response.body", "body": FRAME, "more_body": True}
    _WAITER.join()
    try:
        for _ in range(_TOKENS):
            await _WAITER.next()
            await send(body)
    finally:
        _WAITER.leave()
    await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def _stream_direct(connection: Any, send: Any) -> None:
    transport = connection.transport
    done = asyncio.get_running_loop().create_future()

    def write(frame: bytes) -> None:
        transport.write(b"%x\r\n%b\r\n" % (len(frame), frame))  # uvicorn chose chunked

    def end() -> None:
        if not done.done():
            done.set_result(None)

    _TICKER.add(id(done), write, end)
    try:
        await done
    finally:
        _TICKER.discard(id(done))
    await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def _stream_nowait(send: Any) -> None:
    body = {"type": "http.response.body", "body": FRAME, "more_body": True}
    done = asyncio.get_running_loop().create_future()

    def write(frame: bytes) -> None:
        send(body)  # granian: queued when called; the returned awaitable is already done

    def end() -> None:
        if not done.done():
            done.set_result(None)

    _TICKER.add(id(done), write, end)
    try:
        await done
    finally:
        _TICKER.discard(id(done))
    await send({"type": "http.response.body", "body": DONE, "more_body": False})
