"""An event stream's HTTP exchange: what the core's writer (`core.sender`) asks of the HTTP
connection it writes to, and how (our connection's methods, HTTP/1.1 chunk framing, ASGI
messages).

Two protocols, each with its implementations here:

- `Body`: where the response's body goes, framed for its connection. `ChunkedBody` writes
  HTTP/1.1 chunks straight to the connection's transport (the hot path: one `write` per event);
  `RawBody` writes unframed bytes (a response uvicorn did not chunk); `AsgiBody` queues
  them for ASGI `send` under another server. Each can hold set-up's writes back for one
  system call (`hold`, `release`).
- `Exchange`: the response around the body: its head, the connection's pause, resume and
  loss callbacks (`attached`), its last message (`end`), and how a stalled reader is cut
  (`abort`). `open_exchange` picks `DirectExchange` (our connection, reached through its
  scope key) or `AsgiExchange` (anything else).

Pinned: `connection.py` and `cycle.py` subclass uvicorn 0.54's protocol and cycle
(`UVICORN_MINOR`, a test holds the installed uvicorn to it); this module asks the connection
only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import anyio
from starlette.types import Receive, Scope, Send

from firsttoken.wire.connection import (
    ABORT_KEY,
    CONNECTION_KEY,
    RAW_SEND_KEY,
    ConnectionListener,
    Held,
    StreamingProtocol,
)

__all__ = [
    "UVICORN_MINOR",
    "AsgiBody",
    "AsgiExchange",
    "Body",
    "ChunkedBody",
    "DirectExchange",
    "Exchange",
    "RawBody",
    "client_gone",
    "open_exchange",
]

# The uvicorn release `connection.py` and `cycle.py` subclass (pyproject pins it).
UVICORN_MINOR = (0, 54)
_CHUNK = b"%x\r\n%b\r\n"  # one HTTP/1.1 chunk: its size in hex, its bytes


class Body(Protocol):
    """An event stream's body on its connection. `write` raises RuntimeError once the
    connection closed under it (its loss callback follows)."""

    ends_body: bool  # `write_last` ends the body itself (the last message then writes nothing)
    # The per-token path's shortcut: `transport.write(chunk % (len(data), data))` is `write`
    # with one Python call less (~7% of a token's in-process CPU); None: call `write`.
    chunk: bytes | None
    transport: Any

    def write(self, data: bytes) -> None: ...

    def write_last(self, data: bytes) -> None:
        """`data` and the end of the body, in one write."""
        ...

    def hold(self, head: bytes) -> None:
        """Keep writes back, after `head`, until `release`: they leave in one system call."""
        ...

    def release(self) -> None: ...

    def held(self) -> int:
        """Bytes held back (0 when not holding)."""
        ...

    def is_closing(self) -> bool: ...

    def unsent(self) -> int:
        """Bytes written but not yet taken by the reader's socket."""
        ...

    def close(self) -> None: ...


class _TransportBody:
    """A body written to an asyncio transport (or, while held, to a `Held` stand-in)."""

    __slots__ = ("real", "transport")
    ends_body = False
    chunk: bytes | None = None

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.real = transport

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def write_last(self, data: bytes) -> None:
        raise NotImplementedError  # only a framed body can end itself

    def hold(self, head: bytes) -> None:
        self.transport = Held(self.real, head)

    def release(self) -> None:
        held = self.transport
        if type(held) is not Held:
            return
        self.transport = self.real
        if held.parts and not self.real.is_closing():
            self.real.write(b"".join(held.parts))  # may pause the writer, right here

    def held(self) -> int:
        held = self.transport
        return held.size if type(held) is Held else 0

    def is_closing(self) -> bool:
        return bool(self.transport.is_closing())

    def unsent(self) -> int:
        # 0 for stand-ins without a buffer of their own: they wait for nobody.
        size = getattr(self.real, "get_write_buffer_size", None)
        return int(size()) if size is not None else 0

    def close(self) -> None:
        self.real.close()


class RawBody(_TransportBody):
    """Unframed: a response sent without chunks (it ends with the connection)."""

    __slots__ = ()


class ChunkedBody(_TransportBody):
    """HTTP/1.1 chunks, the framing the connection chose for our responses: one write per
    event."""

    __slots__ = ()
    ends_body = True
    chunk: bytes | None = _CHUNK

    def write(self, data: bytes) -> None:
        self.transport.write(_CHUNK % (len(data), data))

    def write_last(self, data: bytes) -> None:
        self.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data))


class AsgiBody:
    """A body fed to ASGI `send` from a task (the fallback under another server): slower,
    and never paused."""

    ends_body = False
    chunk: bytes | None = None
    transport: Any = None  # none to reach

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def write(self, data: bytes) -> None:
        self._parts.append(data)
        self._idle.clear()
        self._wakeup.set()

    def write_last(self, data: bytes) -> None:
        raise NotImplementedError  # ASGI's last message ends the body

    def hold(self, head: bytes) -> None:
        pass  # ASGI sent the head: nothing to save

    def release(self) -> None:
        pass

    def held(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def unsent(self) -> int:
        return 0

    def close(self) -> None:
        pass

    async def pump(self, send: Send) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            body, self._parts = b"".join(self._parts), []
            await send({"type": "http.response.body", "body": body, "more_body": True})
            if not self._parts:
                self._idle.set()

    async def drained(self) -> None:
        await self._idle.wait()


class Exchange(Protocol):
    """An event stream's response: opened with its head sent (or held), then written through
    `body` while `attached`, then ended."""

    @property
    def body(self) -> Body: ...

    def attached(self, listener: ConnectionListener) -> AbstractAsyncContextManager[None]:
        """The connection reports pause, resume and loss to `listener` while it is entered."""
        ...

    async def end(self, tail: bytes, timeout_s: float, terminated: bool = False) -> bool:
        """Send the response's last message (`tail`: its last bytes, e.g. a compressor's;
        `terminated`: the body's `write_last` already ended it). False when a paused reader
        held it past `timeout_s`."""
        ...

    def abort(self) -> None:
        """Reset the connection: a reader that takes no bytes would hold a graceful close
        forever."""
        ...


class DirectExchange:
    """Over our protocol (`connection.StreamingProtocol`): the body is written to the
    transport in the engine's step, and the connection's callbacks drive the writer.

    The exchange is its own body (`open`: a `ChunkedBody` or a `RawBody` with these methods
    too), so a waiting stream keeps one object here, not two."""

    __slots__ = ()
    scope: Scope
    send: Send
    connection: StreamingProtocol
    real: Any
    transport: Any

    @staticmethod
    def open(
        scope: Scope, send: Send, connection: StreamingProtocol, head: bytes
    ) -> DirectExchange:
        exchange = (_ChunkedExchange if connection.chunked() else _RawExchange)()
        exchange.scope = scope
        exchange.send = send
        exchange.connection = connection
        exchange.transport = exchange.real = transport = connection.socket_transport
        if not transport.is_closing():
            exchange.hold(head)  # the head leaves with the first events (`release`)
        return exchange

    @property
    def body(self) -> Body:
        return self  # type: ignore[return-value]  # `open` makes it a body too

    def attached(self, listener: ConnectionListener) -> DirectExchange:
        # Its own context manager: `asynccontextmanager` costs every stream a generator and
        # a wrapper object.
        self.connection.listener = listener
        return self

    async def __aenter__(self) -> None:
        pass

    async def __aexit__(self, *exc: object) -> None:
        self.connection.listener = None

    async def end(self, tail: bytes, timeout_s: float, terminated: bool = False) -> bool:
        last = {"type": "http.response.body", "body": tail, "more_body": False}
        connection = self.connection
        sent: Awaitable[Any]
        if terminated:
            # The bytes are out: the cycle is told, and what it writes is dropped.
            sent = connection.send_held(self.send, last)
        else:
            sent = self.send(last)
        if connection.flow.write_paused:
            # The cycle's send waits for a paused transport to drain, with no limit of its
            # own. Only then: a cancel scope costs every stream ~10 µs.
            with anyio.move_on_after(timeout_s) as waited:
                await sent
            return not waited.cancelled_caught
        await sent
        return True

    def abort(self) -> None:
        abort = self.scope.get(ABORT_KEY)
        if abort is not None:
            abort()


class _ChunkedExchange(DirectExchange, ChunkedBody):
    __slots__ = ("connection", "scope", "send")

    def __init__(self) -> None:  # `DirectExchange.open` sets the fields
        pass


class _RawExchange(DirectExchange, RawBody):
    __slots__ = ("connection", "scope", "send")

    def __init__(self) -> None:
        pass


class AsgiExchange:
    """Under another ASGI server (no transport to reach): the body is queued for a task that
    awaits `send`, and a task watches `receive` for the client leaving."""

    __slots__ = ("body", "receive", "send")

    def __init__(self, receive: Receive, send: Send) -> None:
        self.receive = receive
        self.send = send
        self.body = AsgiBody()

    @asynccontextmanager
    async def attached(self, listener: ConnectionListener) -> AsyncIterator[None]:
        body = self.body
        async with anyio.create_task_group() as tg:
            tg.start_soon(body.pump, self.send)
            tg.start_soon(_watch_disconnect, self.receive, listener.connection_lost)
            yield
            await body.drained()
            tg.cancel_scope.cancel()

    async def end(self, tail: bytes, timeout_s: float, terminated: bool = False) -> bool:
        await self.send({"type": "http.response.body", "body": tail, "more_body": False})
        return True

    def abort(self) -> None:
        pass  # nothing to reset: the server owns the connection


async def open_exchange(
    scope: Scope, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]]
) -> DirectExchange | AsgiExchange:
    """Start a 200 event-stream response with `headers`, on the connection itself when our
    protocol serves it (its head then held, to leave with the first events), else over
    ASGI."""
    # The last body message skips the middleware's send wrappers (GZip, error handlers):
    # they only act on the start message.
    body_send: Send = scope.get(RAW_SEND_KEY, send)
    start = {"type": "http.response.start", "status": 200, "headers": headers}
    connection: StreamingProtocol | None = scope.get(CONNECTION_KEY)
    if connection is None:  # another server: ASGI all the way
        await send(start)
        return AsgiExchange(receive, body_send)
    head = await connection.send_held(send, start)
    del start  # a waiting stream's frame keeps neither the message nor its headers
    if not connection.answering():  # the client left before the head went out
        return AsgiExchange(receive, body_send)
    return DirectExchange.open(scope, body_send, connection, head)


async def client_gone(receive: Receive) -> None:
    """Return once the client has left (its request's body read, ASGI says so)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    await client_gone(receive)
    on_disconnect()
