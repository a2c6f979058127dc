"""Run the app under uvicorn: uvloop + httptools, TCP_NODELAY, our own bound socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from firsttoken.app import RawSendApp, create_app
from firsttoken.config import Settings
from firsttoken.observability import configure_logging, log_event
from firsttoken.response import ABORT_KEY

__all__ = ["serve"]


class _StreamingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus what streaming needs from the connection:

    - TCP_NODELAY: every token is a small write; Nagle's algorithm would hold it back ~40 ms;
    - a fixed SO_SNDBUF, so what a stalled reader holds in the kernel is bounded;
    - a header deadline: a slow-loris client trickling headers is cut off;
    - `scope["firsttoken.abort"]`: a reader that takes no bytes can be reset (a graceful
      close would wait for it to read the buffered data, forever).
    """

    header_timeout_s = 10.0
    send_buffer_bytes = 65536
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.send_buffer_bytes > 0:
                    # A fixed kernel buffer (no autotuning up to MBs): a stalled reader holds
                    # a bounded amount, and the stream's backpressure starts soon enough.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            except OSError:
                pass
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[ABORT_KEY] = self.transport.abort  # type: ignore[literal-required]
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        loop = asyncio.get_running_loop()
        self._header_timer = loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


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
    _StreamingProtocol.header_timeout_s = settings.header_timeout_s
    _StreamingProtocol.send_buffer_bytes = settings.socket_send_buffer
    config = uvicorn.Config(
        RawSendApp(create_app(settings)),
        loop="uvloop",
        http=_StreamingProtocol,
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
