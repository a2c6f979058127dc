"""A bare RSGI app for `bench.http_servers`, served by `granian --interface rsgi`.

RSGI's streamed response (`proto.response_stream`) hands back a transport whose `send_bytes`
queues the bytes on an unbounded channel to granian's Rust side and returns an already-finished
awaitable (granian 2.x; its source says the method "doesn't need to be async anymore"). So in
`stream` mode the shared ticker calls `send_bytes(frame)` for every stream without awaiting it:
the analogue of writing to uvicorn's transport from the engine step, with no task wakeup per
token. The response ends when the handler returns and the transport is dropped.

Standard library only (granian runs it from its own venv).
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.servers.bare_common import (
    COMMENT,
    DONE,
    FRAME,
    HEADERS,
    Mode,
    Ticker,
    itl_s,
    mode,
    tokens,
)

__all__ = ["app"]

_MODE = mode()
_HEADERS = list(HEADERS)
_TICKER = Ticker(tokens(), itl_s())


async def app(scope: Any, proto: Any) -> None:
    if scope.proto != "http":
        return
    await proto()  # the request body
    transport = proto.response_stream(200, _HEADERS)
    if _MODE is Mode.BURST:
        await transport.send_bytes(FRAME)
    elif _MODE is Mode.IDLE:
        await transport.send_bytes(COMMENT)
        await proto.client_disconnect()
    else:
        done = asyncio.get_running_loop().create_future()

        def end() -> None:
            transport.send_bytes(DONE)
            if not done.done():
                done.set_result(None)

        _TICKER.add(id(done), transport.send_bytes, end)
        try:
            await done
        finally:
            _TICKER.discard(id(done))
