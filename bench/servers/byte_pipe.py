"""The floor of a relay in Python: a byte pipe that parses nothing.

Each client connection gets a connection of its own to the upstream, and bytes go across both
ways as they come (asyncio Protocols on uvloop; reading paused on one side while the other
side's buffer is full). No HTTP, no JSON, no pool: whatever a relay does beyond this is its
own. `bench.gateways` measures every gateway against it.

    python -m bench.servers.byte_pipe serve --port 0 --upstream http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from collections.abc import Sequence
from typing import cast
from urllib.parse import urlsplit

import uvloop

__all__ = ["main"]


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Side(asyncio.Protocol):
    """One end of the pipe; `peer` is the other end's transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []  # what arrived before the other end was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
            return
        peer.transport.write(data)

    def pause_writing(self) -> None:  # our outgoing buffer is full: stop reading the peer
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Client(_Side):
    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self._host = host
        self._port = port

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(_Side, self._host, self._port)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        upstream.peer, self.peer = self, upstream
        if self.transport is None or self.transport.is_closing():
            upstream.transport.close()  # type: ignore[union-attr]
            return
        for data in self.pending:
            upstream.transport.write(data)  # type: ignore[union-attr]
        self.pending.clear()


async def _serve(host: str, port: int, upstream: str) -> None:
    parts = urlsplit(upstream)
    up_host, up_port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Client(up_host, up_port), host, port, backlog=4096, reuse_address=True
    )
    bound = server.sockets[0].getsockname()
    print(json.dumps({"msg": "listening", "url": f"http://{bound[0]}:{bound[1]}"}), flush=True)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.servers.byte_pipe")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", required=True, help="http://HOST:PORT to pipe to")
    parser.add_argument("--heartbeat-s", type=float, default=15.0, help="(accepted, unused)")
    args = parser.parse_args(argv)
    uvloop.run(_serve(args.host, args.port, args.upstream))


if __name__ == "__main__":
    main()
