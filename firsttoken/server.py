"""Run the app under uvicorn: uvloop + httptools, TCP_NODELAY, our own bound socket."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import ipaddress
import logging
import signal
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from functools import partial
from types import FrameType
from typing import NoReturn

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from firsttoken.api.gateway import Gateway
from firsttoken.app import asgi_app, create_app, direct_routes
from firsttoken.config import Settings, unknown_variables
from firsttoken.preflight import StartupError, describe, preflight
from firsttoken.reload import Reloader
from firsttoken.telemetry.log import configure_logging, flush_logs, log_event
from firsttoken.wire.connection import ConnectionOptions, StreamingProtocol
from firsttoken.workers import Supervisor

__all__ = ["serve"]

IDLE_TICK_S = 1.0  # uvicorn's main loop ticks every 0.1 s; ours, outside a drain, every 1 s


class _Server(uvicorn.Server):
    """uvicorn's server, with a drain before its shutdown.

    The first SIGTERM/SIGINT starts the drain: `/readyz` and new streams answer 503 at once,
    running streams go on for up to `drain_timeout_s`; what still runs then ends with
    `event: error` `server_shutdown` (never a bare close), and uvicorn's own shutdown follows.
    A second signal cuts the drain short.

    With a shared store (Redis) the streams whose readers resume by themselves (native) are
    handed over at once (`StreamRegistry.hand_over`): their readers get what was generated
    and reconnect, and the instance they reach goes on with them once Redis holds their last
    events and this one's liveness key is gone. The others (an SDK's) finish here, as
    without Redis.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        url: str,
        gateway: Gateway | None,
        drain_timeout_s: float,
        connection: ConnectionOptions | None = None,
    ) -> None:
        super().__init__(config)
        self.connection = connection or ConnectionOptions()
        self.url = url
        self.gateway = gateway
        self.drain_timeout_s = drain_timeout_s
        self._drain_deadline: float | None = None
        self._ending = False
        self._hand_over = False  # streams go to other instances at the next tick
        self.reloader: Reloader | None = None
        self._wake: Callable[[], object] = lambda: None  # set by main_loop

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn's, but the listening is ours: uvicorn leaves a TLS handshake the event
        # loop's 60 s, and here it is under --header-timeout-s as a plain head is.
        await super().startup([])
        if self.should_exit:
            return
        config, loop = self.config, asyncio.get_running_loop()
        protocol = partial(
            StreamingProtocol,
            config=config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
            options=self.connection,
        )
        handshake_s = self.connection.header_timeout_s if config.ssl else None
        for sock in sockets or ():
            server = await loop.create_server(
                protocol,
                sock=sock,
                ssl=config.ssl,
                backlog=config.backlog,
                ssl_handshake_timeout=handshake_s,
            )
            self.servers.append(server)
        reloader = self.reloader
        if reloader is not None:
            # SIGHUP reloads the keys, routes and canned answers files (firsttoken/reload.py),
            # in the loop's own time: the handler only asks.
            signal.signal(signal.SIGHUP, lambda *_: loop.call_soon_threadsafe(reloader.request))
        usage = self.gateway.usage_store if self.gateway is not None else None
        fields: dict[str, str] = {"usage_db": usage} if usage else {}
        if usage == "memory":  # no --usage-db
            fields["note"] = "usage records are kept in memory only: budgets reset on restart"
        log_event("listening", url=self.url, **fields)

    async def main_loop(self) -> None:
        """uvicorn's, ticking once a second instead of ten times while no drain or exit is
        under way (each tick wakes an idle server: a loop turn and, in a VM, an exit from
        its halt); a signal wakes it at once, and a drain ticks every 0.1 s as uvicorn does."""
        loop = asyncio.get_running_loop()
        wakeup = asyncio.Event()
        self._wake = lambda: loop.call_soon_threadsafe(wakeup.set)
        counter = 0
        while not await self.on_tick(counter):
            # uvicorn refreshes its Date header when counter % 10 == 0: every tick here.
            counter = (counter + 10) % 864000
            if self._drain_deadline is not None or self.should_exit:
                await asyncio.sleep(0.1)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(IDLE_TICK_S):
                    await wakeup.wait()
            wakeup.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        try:
            self._handle_exit(sig, frame)
        finally:
            self._wake()  # the main loop sees it now, not at its next tick

    def _handle_exit(self, sig: int, frame: FrameType | None) -> None:
        gw = self.gateway
        if gw is None or self.should_exit or self.drain_timeout_s <= 0:
            self._end_streams()
            super().handle_exit(sig, frame)
            return
        if self._drain_deadline is not None:  # a second signal: cut now
            log_event("drain.cut", signal=signal.Signals(sig).name)
            self._drain_deadline = 0.0
            return
        self._drain_deadline = time.monotonic() + self.drain_timeout_s
        gw.admission.shedder.draining = True
        # In the loop's own time, not in this signal handler (it interrupts any code).
        self._hand_over = gw.registry.store.replicates
        log_event(
            "drain.start",
            signal=signal.Signals(sig).name,
            active_streams=gw.metrics.active_streams,
            drain_timeout_s=self.drain_timeout_s,
        )

    async def on_tick(self, counter: int) -> bool:
        deadline = self._drain_deadline
        if deadline is not None and self.gateway is not None:
            if self._hand_over:
                self._hand_over = False
                log_event("drain.hand_over", streams=await self.gateway.registry.hand_over())
            if self._ending:
                self.should_exit = True  # the ended streams had a tick to write their end
            elif self.gateway.metrics.active_streams == 0 or time.monotonic() >= deadline:
                self._end_streams()
        return await super().on_tick(counter)

    def _end_streams(self) -> None:
        if self.gateway is None or self._ending:
            return
        self._ending = True
        ended = self.gateway.registry.end_all(
            "server_shutdown", "the server is shutting down; retry (the answer may resume)"
        )
        log_event("drain.end", streams_ended=ended)


class _WatchStartup:
    """Keeps the exception of a failed startup (an engine that cannot start, a Redis that
    went away) for `_run` to report as one line; uvicorn would log Starlette's traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.failure: BaseException | None = None

    # Plain `def` layers return the inner app's coroutine: every `async def` layer would keep
    # a frame alive per open stream (~260 B each, with 10,000 waiting streams).
    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] != "lifespan":
            return self.app(scope, receive, send)
        return self._lifespan(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def quiet(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "lifespan.startup.complete"
            if message["type"] == "lifespan.startup.failed":
                message = {"type": message["type"], "message": ""}
            await send(message)

        try:
            await self.app(scope, receive, quiet)
        except BaseException as exc:
            if not started:
                self.failure = exc
            raise


class _UvicornLog(logging.Handler):
    """uvicorn's own messages as our JSON lines (stdout), tracebacks in a field."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Application startup failed"):
            return  # `_run` reports the cause itself
        fields: dict[str, str] = {"message": message}
        if record.exc_info and record.exc_info[1] is not None:
            fields["traceback"] = "".join(traceback.format_exception(record.exc_info[1]))
        log_event("server.log", record.levelno, **fields)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        why = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            why = "the address is already in use (another server? --port 0 picks a free port)"
        raise StartupError(f"cannot listen on {where}: {why}") from exc
    sock.set_inheritable(True)
    return sock


def serve(settings: Settings) -> None:
    """Run until stopped. A server that cannot start logs one `startup.failed` line and
    exits with status 1 (with the traceback on stderr only at --log-level debug)."""
    configure_logging(settings.log_level)
    for name, close in unknown_variables(named=(settings.admin_key_env,)).items():
        hint = f"; did you mean {close}?" if close else ""
        if close is not None and close == f"{name}_ENV":  # the variable a *_ENV setting names
            hint = f"; to read it, set {close}={name} (its name, not its value)"
        log_event(
            "config.unknown_variable",
            logging.WARNING,
            variable=name,
            note=f"no setting reads it{hint}",
        )
    try:
        preflight(settings)
        sock = bind(settings.host, settings.port)
    except Exception as exc:
        _startup_failed(settings, exc)
    port = sock.getsockname()[1]
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"{'https' if settings.ssl_certfile else 'http'}://{host}:{port}"
    _warn_if_open(settings, sock)
    if settings.workers <= 1:
        _run(settings, sock, url)
        return
    if not settings.redis:
        log_event(
            "workers.without_redis",
            logging.WARNING,
            workers=settings.workers,
            note="each worker keeps its own streams and limits: a resume or "
            "cancel that lands on another worker gets 404; use --redis",
        )
    _prefork(settings, sock, url)


def _warn_if_open(settings: Settings, sock: socket.socket) -> None:
    if settings.api_keys:
        return
    address = str(sock.getsockname()[0])
    if ipaddress.ip_address(address.split("%", 1)[0]).is_loopback:
        return
    log_event(
        "open_to_the_network",
        logging.WARNING,
        address=address,
        note="listening beyond loopback without --api-keys: anyone who can reach this port "
        "can stream, with no per-key limits; give it a keys file or put an authenticating "
        "proxy in front",
    )


def _startup_failed(settings: Settings, exc: BaseException) -> NoReturn:
    log_event("startup.failed", logging.ERROR, error=describe(exc))
    if settings.log_level == "debug":
        traceback.print_exception(exc, file=sys.stderr)
    raise SystemExit(1)


def _run(settings: Settings, sock: socket.socket, url: str) -> None:
    try:
        starlette = create_app(settings)
        outer = asgi_app(starlette)
        app = _WatchStartup(outer)
    except Exception as exc:
        _startup_failed(settings, exc)
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.handlers[:] = [_UvicornLog()]
    uvicorn_log.propagate = False
    config = uvicorn.Config(
        app,
        loop="uvloop",
        interface="asgi3",  # the outer layers are plain callables: don't let uvicorn guess
        http=StreamingProtocol,  # what `_Server.startup` serves each connection with
        lifespan="on",
        access_log=False,
        log_config=None,  # uvicorn's lines go through _UvicornLog
        log_level="warning",
        ws="none",  # no WebSocket is served (the protocol refuses upgrades either way)
        # The drain (`_Server`) has ended every stream by the time uvicorn shuts down: this
        # only bounds the wait for their last bytes.
        timeout_graceful_shutdown=3,
        h11_max_incomplete_event_size=64 * 1024,
        # HTTPS: each worker loads the pair into its own context; the socket stays plain TCP
        # and uvicorn wraps each accepted connection (preflight has loaded the pair once).
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )
    connection = ConnectionOptions(
        header_timeout_s=settings.header_timeout_s,
        send_buffer_bytes=settings.socket_send_buffer,
        # Our config sets neither `root_path` nor `limit_concurrency`, which the direct path
        # skips.
        direct=direct_routes(outer),
    )
    _tune_gc()
    try:
        server = _Server(config, url, starlette.state.gateway, settings.drain_timeout_s, connection)
        server.reloader = starlette.state.reloader
        server.run(sockets=[sock])
    except SystemExit:
        if app.failure is None:
            raise
    finally:
        flush_logs()  # the loop's last turn may have ended before its flush
    if app.failure is not None:  # uvicorn exits with 3 after a failed startup; we say why
        _startup_failed(settings, app.failure)


def _prefork(settings: Settings, sock: socket.socket, url: str) -> None:
    """N processes accept on one listening socket (the kernel spreads connections): the way
    past one core's worth of Python per process. A supervisor replaces the ones that die and
    `/metrics` on any of them is the sum of all (`firsttoken.workers`)."""
    code = Supervisor(settings.workers, lambda: _run(settings, sock, url)).run()
    if code:
        raise SystemExit(code)


def _tune_gc() -> None:
    """The cyclic collector cost ~9% of the CPU under load (measured with gc.callbacks at
    500 streams): every full pass walked every live stream's objects. Objects made so far
    (modules, the app) leave its books for good, and young passes run every 50,000
    allocations instead of 700, so a full pass is rare."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
