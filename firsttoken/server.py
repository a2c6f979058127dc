"""Run the app under uvicorn: uvloop + httptools, TCP_NODELAY, our own bound socket."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from firsttoken.app import create_app
from firsttoken.config import Settings
from firsttoken.observability import configure_logging, log_event

__all__ = ["serve"]


class _NoDelayProtocol(HttpToolsProtocol):
    """Every token is a small write: Nagle's algorithm would hold it back ~40 ms."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        super().connection_made(transport)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, url: str) -> None:
        super().__init__(config)
        self.url = url

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            log_event("listening", url=self.url)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(settings: Settings) -> None:
    configure_logging(settings.log_level)
    sock = bind(settings.host, settings.port)
    port = sock.getsockname()[1]
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config = uvicorn.Config(
        create_app(settings),
        loop="uvloop",
        http=_NoDelayProtocol,
        lifespan="on",
        access_log=False,
        log_level="warning",
        # Streams can run for minutes; on shutdown give them a moment, then cut them.
        timeout_graceful_shutdown=3,
        h11_max_incomplete_event_size=64 * 1024,
    )
    _Server(config, f"http://{host}:{port}").run(sockets=[sock])
