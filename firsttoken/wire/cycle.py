"""A request the connection serves itself: uvicorn's response cycle, minus what it does for
every ASGI app.

The streaming routes are the server's hot path, and each of uvicorn's per-request layers
(the proxy-headers middleware, the app's outer layers and their dispatch, an `asyncio.Event`
per request) is paid once per new stream. Our protocol
(`connection.StreamingProtocol`) hands a hot route's request to `DirectRoutes.serve` with this
cycle's `receive` and `send`: uvicorn's own (it is uvicorn's class, pinned at 0.54), so the
ASGI messages, bodies and keep-alive bookkeeping are the same; only the set-up is lighter.

Also the connection's flow control (`Flow`, what uvicorn's `FlowControl` is to its protocol
and cycle) and the arrival flag both use (`Arrival`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

if TYPE_CHECKING:
    from uvicorn._types import HTTPScope

__all__ = ["Arrival", "DirectCycle", "DirectRoutes", "Flow"]

_LOGGER = logging.getLogger("uvicorn.error")  # what uvicorn's own cycle logs a crash to


class DirectRoutes(Protocol):
    """The app's side: which requests it serves straight from the connection, and how."""

    def route(self, method: str, path: str) -> Any | None:
        """A route for `method` and `path` (handed back to `serve`), or None: ASGI serves it."""

    def serve(self, route: Any, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """Answer the request (as an ASGI app would, with the route already found)."""


class Arrival:
    """What `asyncio.Event` is to uvicorn's cycle (the body arrived, or the client left),
    with no waiter queue until a request's body is actually waited for."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        while not self._set:
            if self._waiter is None or self._waiter.done():
                self._waiter = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._waiter)  # one cancelled waiter must not break the next
        return True


class Flow:
    """A connection's flow control, as uvicorn's protocol and cycle use it (`read_paused`,
    `write_paused`, `drain` and the four switches): its own, with an `Arrival` where
    uvicorn's keeps an `asyncio.Event` (a 64-slot waiter deque on every connection)."""

    __slots__ = ("_transport", "_writable", "read_paused", "write_paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable = Arrival()
        self._writable.set()

    async def drain(self) -> None:
        await self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            self._writable.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            self._writable.set()


class DirectCycle(RequestResponseCycle):
    """uvicorn's `RequestResponseCycle` for a request the protocol serves itself."""

    def __init__(
        self,
        scope: HTTPScope,
        transport: asyncio.Transport,
        flow: Flow,
        default_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        on_response: Callable[[], None],
    ) -> None:
        # uvicorn's own, with no access log (ours is off), no `expect: 100-continue` (such a
        # request goes the ASGI way) and a lighter arrival flag than asyncio.Event, both
        # through its constructor's fields (their types say FlowControl and Event).
        super().__init__(
            scope,
            transport,
            flow,  # type: ignore[arg-type]
            _LOGGER,
            _LOGGER,
            False,
            default_headers,
            Arrival(),  # type: ignore[arg-type]
            False,
            keep_alive,
            on_response,
        )
