"""The raw asyncio floor in the shape of the other bare servers (mirrors `raw_floor.py`).

    BARE_MODE=stream python -m bench.servers.bare_raw --port PORT

A bare asyncio Protocol on uvloop that parses just enough HTTP to find the end of the body
(as `raw_floor` does), then per `BARE_MODE` (see `bare_common`): no framework, no task per
connection, close-delimited bodies; in `stream` mode the shared ticker calls
`transport.write(frame)` for every stream.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Sequence
from typing import cast

import uvloop

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

__all__ = ["main"]

_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in HEADERS)
    + b"Connection: close\r\n\r\n"
)
_MAX_HEAD = 65536
_MODE = mode()
_TICKER = Ticker(tokens(), itl_s())


class _Connection(asyncio.Protocol):
    __slots__ = ("_buf", "_started", "_tr")

    def __init__(self) -> None:
        self._buf = b""
        self._started = False
        self._tr: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tr = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._started:
            return
        self._buf += data
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD:
                self._tr.close()  # type: ignore[union-attr]
            return
        length = _content_length(self._buf[:end])
        if len(self._buf) - end - 4 < length:
            return
        self._started = True
        self._buf = b""
        self._respond()

    def _respond(self) -> None:
        tr = self._tr
        assert tr is not None
        if _MODE is Mode.BURST:
            tr.write(_HEAD + FRAME)
            tr.close()
        elif _MODE is Mode.IDLE:
            tr.write(_HEAD + COMMENT)
        else:
            tr.write(_HEAD)

            def end() -> None:
                tr.write(DONE)
                tr.close()

            _TICKER.add(id(self), tr.write, end)

    def connection_lost(self, exc: Exception | None) -> None:
        _TICKER.discard(id(self))


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


async def _serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = await loop.create_server(_Connection, sock=sock, backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.servers.bare_raw")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvloop.run(_serve(args.host, args.port))


if __name__ == "__main__":
    main()
