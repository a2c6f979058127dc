"""Run the app under uvicorn: uvloop + httptools, TCP_NODELAY, our own bound socket."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket

import uvicorn

from firsttoken.app import RawSendApp, create_app
from firsttoken.config import Settings
from firsttoken.connection import StreamingProtocol
from firsttoken.observability import configure_logging, log_event

__all__ = ["serve"]


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
    url = f"http://{host}:{port}"
    if settings.workers <= 1:
        _run(settings, sock, url)
        return
    if not settings.redis:
        log_event(
            "workers.without_redis",
            logging.WARNING,
            workers=settings.workers,
            note="each worker keeps its own streams, limits and /metrics: a resume or "
            "cancel that lands on another worker gets 404; use --redis",
        )
    _prefork(settings, sock, url)


def _run(settings: Settings, sock: socket.socket, url: str) -> None:
    StreamingProtocol.header_timeout_s = settings.header_timeout_s
    StreamingProtocol.send_buffer_bytes = settings.socket_send_buffer
    config = uvicorn.Config(
        RawSendApp(create_app(settings)),
        loop="uvloop",
        http=StreamingProtocol,
        lifespan="on",
        access_log=False,
        log_level="warning",
        # Streams can run for minutes; on shutdown give them a moment, then cut them.
        timeout_graceful_shutdown=3,
        h11_max_incomplete_event_size=64 * 1024,
    )
    _Server(config, url).run(sockets=[sock])


def _prefork(settings: Settings, sock: socket.socket, url: str) -> None:
    """N processes accept on one listening socket (the kernel spreads connections): the way
    past one core's worth of Python per process."""
    children: list[int] = []
    for _ in range(settings.workers):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _run(settings, sock, url)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        children.append(pid)

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for child in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)
