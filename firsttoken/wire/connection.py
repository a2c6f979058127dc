"""The HTTP connection: uvicorn's httptools protocol plus what streaming needs of it."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, Protocol

import httptools
from starlette.types import Message, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from firsttoken.wire.cycle import Arrival, DirectCycle, DirectRoutes, Flow

__all__ = [
    "ABORT_KEY",
    "ARRIVED_KEY",
    "CONNECTION_KEY",
    "RAW_SEND_KEY",
    "ConnectionListener",
    "ConnectionOptions",
    "Held",
    "RequestTransport",
    "StreamingProtocol",
    "body_arrived",
]

# The scope key under which the app's outermost layer leaves the server's own `send`.
RAW_SEND_KEY = "firsttoken.raw_send"
# The scope key of a callable that resets the connection (set by our uvicorn protocol).
ABORT_KEY = "firsttoken.abort"
# The scope key of when the request's first byte arrived (perf_counter): TTFT starts there.
ARRIVED_KEY = "firsttoken.arrived"
# The scope key of the connection itself (our uvicorn protocol): its transport, and the
# `listener` slot through which it reports pause/resume/loss to the writer.
CONNECTION_KEY = "firsttoken.wire.connection"


class ConnectionListener(Protocol):
    """What an event-stream writer hears from its connection (see `core.sender.EventSender`)."""

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...

    def connection_lost(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ConnectionOptions:
    """What the server sets for every connection (`--header-timeout-s`,
    `--socket-send-buffer`), and the app's hot routes when the connection may serve them."""

    # From accept (a TLS handshake included) to a request's whole head.
    header_timeout_s: float = 10.0
    # SO_SNDBUF; 0 leaves the kernel's autotuning.
    send_buffer_bytes: int = 65536
    # Served past uvicorn's per-request ASGI layers: None when something must wrap the hot
    # routes (CORS does) or uvicorn would add something to them (`root_path`,
    # `limit_concurrency`: the server sets neither).
    direct: DirectRoutes | None = None


_DEFAULTS = ConnectionOptions()


class StreamingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus what streaming needs from the connection:

    - TCP_NODELAY (set by the event loop): every token is a small write; Nagle's algorithm
      would hold it back ~40 ms;
    - a fixed SO_SNDBUF, so what a stalled reader holds in the kernel is bounded;
    - a header deadline, from accept (a TLS handshake included): a slow-loris client
      trickling headers is cut off;
    - pipelined requests answered one at a time: one parsed behind an unfinished answer
      waits for it (at most `max_pipelined`, past which the rest is not read), and the
      connection (`cycle`, flow control, `listener`) stays the answer's until it ends;
    - no upgrades (WebSocket, h2c): such a request gets a plain answer, then the close;
    - an answer given before its request's body was all in (an early 413) closes the
      connection after a short linger, instead of reading the rest of the body;
    - `scope["firsttoken.abort"]`: a reader that takes no bytes can be reset (a graceful
      close would wait for it to read the buffered data, forever);
    - `scope["firsttoken.wire.connection"]` and `listener`: an event stream writes to the
      transport itself and hears pause, resume and loss as callbacks, with no task waiting
      on `receive()` or on uvicorn's drain;
    - `options.direct`: the app's hot routes are served from here (`cycle.DirectCycle`),
      past uvicorn's per-request ASGI layers;
    - what a response's cycle writes goes through `RequestTransport`, which can hold it back
      (`send_held`): a stream's head leaves with its first events, in one system call.

    What a stream's writer needs of it is asked through its methods (`answering`,
    `chunked`, `send_held`, `flow`, `socket_transport`): only this module and `cycle.py`
    know uvicorn's classes.
    """

    write_buffer_high = 8192
    # httptools keeps every header byte it is given: a head past this is cut off while it is
    # parsed. Below it, a head over the API's limits is answered in full (requestlimits.py).
    max_head_bytes = 256 * 1024
    # Requests parsed behind an unfinished answer (each holds its scope and body): past this
    # many, the rest is not read, and the connection closes after the last one's answer.
    max_pipelined = 8
    # How long a connection answered before its request's body was all in reads and drops
    # the rest before it closes: a close with unread bytes resets the connection, and the
    # client may lose the answer (nginx's lingering close).
    linger_s = 2.0
    # Slots for ours: uvicorn's attributes fill the instance dict's shared keys, and one more
    # turned it into a table of its own (~1.5 KiB per connection).
    __slots__ = (
        "_accepted",
        "_deaf",
        "_head_bytes",
        "_header_timer",
        "_reading",
        "listener",
        "options",
    )
    # What the cycles write to (uvicorn's `transport`, typed as asyncio's).
    transport: RequestTransport  # type: ignore[assignment]
    flow: Flow  # type: ignore[assignment]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        options: ConnectionOptions = _DEFAULTS,
    ) -> None:
        self.options = options
        self._header_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        # The request whose head or body is being read: `cycle` (the one being answered),
        # or one pipelined behind it.
        self._reading: Any = None
        # Nothing more is read into a request (see `_stop_reading`).
        self._deaf = False
        self.listener: ConnectionListener | None = None
        super().__init__(config, server_state, app_state, _loop)
        # Made at accept: under TLS, connection_made comes after the handshake.
        self._accepted = self.loop.time()

    # A Transport, as uvicorn's own signature says (asyncio's says BaseTransport).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # TCP_NODELAY is the event loop's own doing: uvloop and asyncio set it on every TCP
        # transport (a test holds it), so no system call of ours per connection for it.
        options = self.options
        sock = transport.get_extra_info("socket") if options.send_buffer_bytes > 0 else None
        if sock is not None:
            try:
                # A fixed kernel buffer (no autotuning up to MBs): a stalled reader holds a
                # bounded amount, and the stream's backpressure starts soon enough.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, options.send_buffer_bytes)
            except OSError:
                pass
        # uvicorn's own connection_made (0.54), with the addresses the event loop already
        # read at accept: uvicorn asks the socket again (two system calls and two socket
        # objects per connection).
        self.connections.add(self)
        # A reader that stops reading is paused after this many bytes wait in the transport.
        # Counted in data bytes, but a token written while the socket is full waits as its own
        # write request (~0.7 KiB of bookkeeping in uvloop and libuv for ~100 bytes of data):
        # at the default 64 KiB a stalled reader of a live stream held ~1.4 MiB, here ~0.2.
        transport.set_write_buffer_limits(high=self.write_buffer_high)
        self.transport = RequestTransport(transport)
        # The event loop's transport: a stream's events are written to it directly.
        self.socket_transport = transport
        # uvicorn's FlowControl, with a waiter made only when a send waits for the drain:
        # its asyncio.Event took a 64-slot deque up front (~620 B per connection).
        self.flow = Flow(transport)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        self._arm_header_timer(self._accepted + options.header_timeout_s - self.loop.time())

    def data_received(self, data: bytes) -> None:
        # uvicorn's, but an upgrade is never handed over (see `on_headers_complete`).
        if self._deaf:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # answered as plain HTTP, and reading stopped at its head
        except httptools.HttpParserError:
            if self._deaf:  # stopped on purpose, mid-data
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # Keys of ours in uvicorn's scope, which its TypedDict does not list.
        self.scope[ABORT_KEY] = self.transport.real.abort  # type: ignore[literal-required]
        self.scope[CONNECTION_KEY] = self  # type: ignore[literal-required]
        # The request's first byte: where TTFT starts (an outside client's clock starts there).
        self.scope[ARRIVED_KEY] = time.perf_counter()  # type: ignore[literal-required]
        if self._header_timer is None:  # still armed from connection_made on a first request
            self._arm_header_timer(self.options.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_bytes = 0
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        answering: RequestResponseCycle | None = self.cycle
        if answering is not None and answering.response_complete:
            answering = None
        if answering is not None and len(self.pipeline) >= self.max_pipelined:
            # The rest is not read: the queued ones are answered, then the connection closes
            # (a client re-sends what was not answered, RFC 9112 9.3.2).
            self.pipeline[0][0].keep_alive = False
            self._stop_reading()
            raise _StopParsing
        direct = self.options.direct
        if direct is None or not self._serve_direct(direct, answering is not None):
            # Started, or queued behind `answering` (uvicorn's pipeline, reading paused).
            super().on_headers_complete()
            # The cycle's arrival flag, without asyncio.Event's up-front waiter deque (the
            # constructor's `message_event`; its task has not run yet).
            self.cycle.message_event = Arrival()  # type: ignore[assignment]
        self._reading = self.cycle
        if answering is not None:
            self.cycle = answering  # still the connection's until its answer ends
        if self.parser.should_upgrade():
            # No upgrade is served: the request gets a plain answer and the connection
            # closes. The parser skips its body, and what follows its head is another
            # protocol's: nothing more is read.
            self._reading.keep_alive = False
            self._deaf = True
            self.flow.pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self._reading
        if cycle is None or cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        cycle = self._reading
        if cycle is None or cycle.response_complete:
            return
        cycle.more_body = False
        cycle.message_event.set()

    def on_response_complete(self) -> None:
        # uvicorn's, with the next pipelined request taking the connection as it starts.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        if self.cycle.more_body:
            self._linger()  # answered before its body was all in
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self.cycle = cycle
            self._start_asgi_task(cycle, app)
        else:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def send_400_response(self, msg: str) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            self._end_after(cycle)  # the bad bytes came after the request being answered
            return
        super().send_400_response(msg)

    def _end_after(self, cycle: Any) -> None:
        """A refusal now would land in (or before) `cycle`'s unfinished answer: that answer
        ends the connection instead, and what waits behind it is dropped."""
        cycle.keep_alive = False
        self.pipeline.clear()
        self._stop_reading()

    def _should_upgrade(self) -> bool:
        return False  # no WebSocket here, whatever uvicorn found installed

    def _stop_reading(self) -> None:
        """Read nothing more into a request."""
        self._deaf = True
        self._reading = None
        self.flow.pause_reading()

    def _linger(self) -> None:
        """Close once the client stops sending, or after `linger_s`; what it still sends is
        read and dropped meanwhile, so the close does not reset the answer away."""
        self._deaf = True
        self._reading = None
        self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm_header_timer(self.linger_s)

    def _serve_direct(self, direct: DirectRoutes, queued: bool) -> bool:
        """Start a hot route's request without uvicorn's ASGI layers, or, `queued` behind the
        answer under way, queue it as uvicorn queues a pipelined one; False leaves it to them
        (HTTP/1.0, an upgrade, `expect: 100-continue`, an escaped or absolute-form path).
        Queued is common, not rare: a client's next request on the connection often comes as
        soon as the last event's chunk, before this side has told the cycle it ended."""
        parser = self.parser
        if self.expect_100_continue or parser.should_upgrade():
            return False
        if parser.get_http_version() != "1.1":
            return False
        raw_path, _, query = self.url.partition(b"?")
        # `find`, not `in` (which formats a TypeError first on bytes: `formats.sse`).
        if raw_path[:1] != b"/" or raw_path.find(b"%") >= 0 or not raw_path.isascii():
            return False
        method = parser.get_method().decode("ascii")
        path = raw_path.decode("ascii")
        route = direct.route(method, path)
        if route is None:
            return False
        scope = self.scope
        scope["method"] = method
        scope["path"] = path
        scope["raw_path"] = raw_path
        scope["query_string"] = query
        cycle = DirectCycle(
            scope,
            self.transport,  # type: ignore[arg-type]  # has what the cycle calls
            self.flow,
            self.server_state.default_headers,
            parser.should_keep_alive(),
            self.on_response_complete,
        )
        self.cycle = cycle
        serve = partial(direct.serve, route)  # the ASGI app the cycle runs
        if queued:
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, serve))  # started by `on_response_complete`
            return True
        task = self.loop.create_task(cycle.run_asgi(serve))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        listener, self.listener = self.listener, None
        super().connection_lost(exc)
        if listener is not None:
            listener.connection_lost()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.listener is not None:
            self.listener.pause_writing()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.listener is not None:
            self.listener.resume_writing()

    # What a stream's writer asks of its connection (`transport.DirectExchange`).

    def answering(self) -> bool:
        """Whether a response is under way here (started, not ended): the request it answers
        owns the connection until it ends, a pipelined one behind it included."""
        cycle = self.cycle
        return cycle is not None and cycle.response_started and not cycle.response_complete

    def chunked(self) -> bool:
        """Whether the response under way is framed in HTTP/1.1 chunks."""
        return bool(self.cycle.chunked_encoding)

    async def send_held(self, send: Send, message: Message) -> bytes:
        """Send `message` through `send` (the cycle's own, or a middleware's around it),
        keeping back the bytes the cycle writes for it: the caller writes them with its own,
        or already has."""
        transport = self.transport
        transport.hold()
        try:
            await send(message)
        finally:
            held = transport.release()
        return held

    def _arm_header_timer(self, delay: float) -> None:
        """Close the connection after `delay`, unless a request's head is in by then."""
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(delay, self._headers_too_slow)

    def _head_too_large(self) -> NoReturn:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self._end_after(cycle)
        else:
            self._stop_reading()
            if not self.transport.is_closing():
                self.transport.write(_HEAD_TOO_LARGE)
                self.transport.close()
        raise _StopParsing  # nothing more of this head, or of what follows it

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A head behind an unfinished answer: reading waits for that answer, and so
            # does the head's deadline.
            self._arm_header_timer(self.options.header_timeout_s)
            return
        if not self.transport.is_closing():
            self.transport.close()


class _StopParsing(Exception):
    """Raised from a parser callback to stop parsing the data in hand."""


def _address(info: object) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:  # IPv6 adds flow info and scope id
        return (str(info[0]), int(info[1]))
    return None


_HEAD_BODY = (
    b'{"error":{"message":"the request head is too large","type":"invalid_request_error",'
    b'"code":"headers_too_large","param":null}}'
)
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_HEAD_BODY), _HEAD_BODY)
)


def body_arrived(scope: Scope) -> bool:
    """Whether the connection holds this request's whole body already: one `receive()`
    returns it without waiting (no deadline needed for a slow body). False when unknown."""
    connection = scope.get(CONNECTION_KEY)
    cycle = getattr(connection, "cycle", None)
    return (
        cycle is not None
        and cycle.scope is scope  # not a pipelined request's behind it
        and not cycle.more_body
        and cycle.message_event.is_set()
    )


class RequestTransport:
    """The transport that the connection's response cycles (and uvicorn's protocol) write to:
    the event loop's, with writes that can be held back (`hold`, `release`)."""

    __slots__ = ("_held", "real")

    def __init__(self, real: asyncio.Transport) -> None:
        self.real = real
        self._held: list[bytes] | None = None

    def hold(self) -> None:
        self._held = []

    def release(self) -> bytes:
        """Stop holding; what was held comes back, unwritten."""
        held, self._held = self._held, None
        return b"".join(held) if held else b""

    def write(self, data: bytes) -> None:
        held = self._held
        if held is None:
            self.real.write(data)
        else:
            held.append(data)

    def close(self) -> None:
        self.real.close()  # what is held goes nowhere: the connection is over

    def abort(self) -> None:
        self.real.abort()

    def is_closing(self) -> bool:
        return self.real.is_closing()

    def can_write_eof(self) -> bool:
        return self.real.can_write_eof()

    def write_eof(self) -> None:
        self.real.write_eof()

    def pause_reading(self) -> None:
        self.real.pause_reading()

    def resume_reading(self) -> None:
        self.real.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.real.get_extra_info(name, default)

    def get_write_buffer_size(self) -> int:
        return self.real.get_write_buffer_size()


class Held:
    """A transport stand-in that keeps what is written, to leave in one system call later
    (`transport.Body.hold`)."""

    __slots__ = ("parts", "real", "size")

    def __init__(self, real: Any, head: bytes = b"") -> None:
        self.real = real
        self.parts: list[bytes] = [head] if head else []
        self.size = len(head)

    def write(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)

    def is_closing(self) -> bool:
        return bool(self.real.is_closing())

    def close(self) -> None:
        self.real.close()
