"""A lean HTTP/1.1 client for the relay's upstream leg: one keep-alive pool per origin on
asyncio protocols, the request in one write, the response parsed by httptools (llhttp).

Why not httpx here: between the client's request and the upstream's, httpx spent ~3 ms building
and sending (headers and body in two writes ~1 ms apart), more than the rest of the hop. This
client does the least a streaming POST needs, and no more:

- the request line, headers and body go out in ONE `transport.write` (one segment on loopback;
  TCP_NODELAY, so nothing waits for an ACK);
- the response head is parsed by `httptools.HttpResponseParser` (no home-made HTTP parser),
  bounded at `MAX_HEAD_BYTES` so a hostile upstream cannot grow it without end;
- the body (chunked, content-length or close-delimited) is an async iterator of bytes chunks;
  what arrived since the consumer last looked comes as one chunk;
- flow control: past `HIGH_WATER` buffered bytes the transport stops reading until the consumer
  catches up, so a fast upstream and a slow client do not fill memory;
- timeouts: `connect_timeout` bounds the connect (and TLS handshake); `read_timeout` bounds the
  wait for the upstream's next bytes (not time the consumer spends behind: reading is paused);
- a connection goes back to the pool only when its response ended cleanly (llhttp's message
  complete, keep-alive allowed); any other end — an error, a timeout, `close()` before the
  end — closes it, so the upstream sees its client leave at once.

A reused connection that the upstream closed before answering (an idle-timeout race: the
upstream closed as the request went out) is retried once on a fresh connection; nothing was
answered, so nothing is sent twice to the client.

A warm origin (`warm(url, spare)`) keeps `spare` connections open ahead of the requests: one
opened at start, and another in the background each time a request takes one or the upstream
closes an idle one (its keep-alive timeout; at most once a second per origin), so a request
rarely waits for a connect (a loopback connect is a round trip and a socket's set-up; a
remote one, a TLS handshake too).
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import re
import socket
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Mapping
from datetime import UTC
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = [
    "HIGH_WATER",
    "MAX_ERROR_BODY",
    "MAX_HEAD_BYTES",
    "ConnectError",
    "ConnectTimeout",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "StreamClosed",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "drain",
    "plain_text",
    "retry_after",
]

MAX_HEAD_BYTES = 64 * 1024  # status line + headers of one response
HIGH_WATER = 256 * 1024  # body bytes buffered before the transport stops reading
MAX_IDLE_PER_ORIGIN = 256
MAX_ERROR_BODY = 64 * 1024  # what is read of an error answer
REFILL_MIN_S = 1.0  # an idle connection the upstream closed is replaced at most this often


class UpstreamError(Exception):
    """Any failure of an upstream request."""


class ConnectError(UpstreamError):
    """The connect (or TLS handshake) failed: refused, unreachable, bad certificate."""


class ConnectTimeout(UpstreamError):
    """The connect took longer than `connect_timeout`."""


class ReadTimeout(UpstreamError):
    """The upstream sent nothing for `read_timeout`."""


class ReadError(UpstreamError):
    """The connection ended before the response did."""


class RemoteProtocolError(UpstreamError):
    """The upstream's bytes are not an HTTP/1.1 response (or its head is too large)."""


class StreamClosed(ReadError):
    """The response was closed by its reader (`close()`/`aclose()`) before its end."""


Origin = tuple[str, str, int]  # scheme, host, port


class UpstreamResponse:
    """One response: status and headers once its head arrived, then its body as it comes.

    `headers` maps lower-cased names to values (repeated headers joined with ", ").
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_head",
        "_waiter",
        "headers",
        "status_code",
    )

    def __init__(self, conn: _Connection, head: asyncio.Future[None]) -> None:
        self._conn: _Connection | None = conn
        self._head = head
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- reading ---------------------------------------------------------------------------

    def take(self) -> bytes:
        """What arrived since the last look, joined (b"" when nothing has); raises the
        response's failure once nothing is left before it. With `ended` and `wait()`, a
        reader that decodes in its own loop reads the body with no generator between."""
        chunks = self._chunks
        if chunks:
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._buffered = 0
            conn = self._conn
            if conn is not None and conn.paused:
                conn.resume()
            return data
        if self._error is not None:
            raise self._error
        return b""

    @property
    def ended(self) -> bool:
        """The body ended cleanly and every byte of it was taken."""
        return self._done and not self._chunks

    async def wait(self) -> None:
        """Until bytes, the body's end or a failure arrive (at once if one has)."""
        if self._chunks or self._done or self._error is not None:
            return
        waiter = self._waiter = self._head.get_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives, undecoded; raises an `UpstreamError` if it breaks off."""
        while True:
            data = self.take()
            if data:
                yield data
            elif self._done:
                return
            else:
                await self.wait()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body decoded per Content-Encoding (gzip, deflate; others come as they are)."""
        encoding = self.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("gzip", "x-gzip", "deflate"):
            async for data in self.aiter_raw():
                yield data
            return
        # wbits 32 + 15: a zlib or gzip header, detected; "deflate" without the zlib
        # header (some servers send it raw) is retried as raw on its first bytes.
        decoder = zlib.decompressobj(47)
        first = True
        async for data in self.aiter_raw():
            try:
                out = decoder.decompress(data)
            except zlib.error:
                if encoding != "deflate" or not first:
                    raise RemoteProtocolError(f"a body that is not {encoding}") from None
                decoder = zlib.decompressobj(-zlib.MAX_WBITS)
                try:
                    out = decoder.decompress(data)
                except zlib.error:
                    raise RemoteProtocolError("a body that is not deflate") from None
            first = False
            if out:
                yield out
        tail = decoder.flush()
        if tail:
            yield tail

    async def read_bounded(self, limit: int = MAX_ERROR_BODY) -> bytes:
        """The body (decoded), up to about `limit` bytes: an error page, not a stream."""
        raw = b""
        async for chunk in self.aiter_bytes():
            raw += chunk
            if len(raw) >= limit:
                break
        return raw

    def close(self) -> None:
        """Stop reading: before the body's end this closes the connection (never reused)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if not self._done:
            if self._error is None:
                self._error = StreamClosed("the response was closed before its end")
            conn.close()
            self._wake()
        self._chunks.clear()

    async def aclose(self) -> None:
        self.close()

    # -- fed by the connection -------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> int:
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()
        return self._buffered

    def _finish(self) -> None:
        self._done = True
        self._conn = None  # the connection is no longer this response's to close
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._done or self._error is not None:
            return
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request in flight (no pipelining)."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.paused = False
        self.response: UpstreamResponse | None = None
        self.received = 0  # bytes of the current response so far
        self._parser: httptools.HttpResponseParser | None = None
        self._head_bytes = 0
        self._head_done = False
        self._informational = False
        self._framed = False  # Content-Length or chunked: the body's end is in the bytes
        self._headers: list[tuple[bytes, bytes]] = []
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.idle = False  # in the pool's idle list

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass  # not TCP (a test's unix socket): nothing to do

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if self.response is None or parser is None:
            self.close()  # bytes nobody asked for: the connection is not in a known state
            return
        self._last = self.loop.time()
        self.received += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._error(
                cause if isinstance(cause, UpstreamError) else RemoteProtocolError(str(exc))
            )
            return
        except httptools.HttpParserError as exc:
            self._error(RemoteProtocolError(f"not an HTTP/1.1 response ({exc})"))
            return
        if not self._head_done and self.response is not None:
            # llhttp holds a header's bytes until it ends: bound what it may hold.
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._error(_head_too_large())

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost settles the response

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._parser = None  # it holds our callbacks: a cycle the collector would have to free
        self._cancel_timer()
        self.pool._forget(self)
        resp, self.response = self.response, None
        if resp is None:
            return
        if self._head_done and not self._framed and exc is None:
            resp._finish()  # a close-delimited body ends with the connection
        elif not self._head_done:
            resp._fail(ReadError("the upstream closed the connection without answering"))
        else:
            resp._fail(ReadError("the upstream closed the connection before the body's end"))

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.response is None:
            raise RemoteProtocolError("bytes after the response's end")

    def on_status(self, status: bytes) -> None:
        self._count(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None and self._parser is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # 100 Continue and friends: the real answer follows
            self._informational = True
            self._headers = []
            return
        headers: dict[str, str] = {}
        for raw_name, raw_value in self._headers:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._headers = []
        self._framed = (
            "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
        )
        self._head_done = True
        resp.status_code = status
        resp.headers = headers
        if not resp._head.done():
            resp._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.response
        assert resp is not None
        if resp._feed(body) > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        resp, self.response = self.response, None
        assert resp is not None and self._parser is not None
        keep = self._parser.should_keep_alive()
        self._parser = None
        self._cancel_timer()
        resp._finish()
        if keep and not self.closed:
            if self.paused:
                self.resume()
            self.pool._release(self)
        else:
            self.close()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _head_too_large()

    # -- driven by the pool and the response ------------------------------------------------

    def send(self, data: bytes) -> UpstreamResponse:
        assert self.transport is not None and self.response is None
        head = self.loop.create_future()
        resp = self.response = UpstreamResponse(self, head)
        self._parser = httptools.HttpResponseParser(self)
        self.received = self._head_bytes = 0
        self._head_done = self._informational = self._framed = False
        self._last = self.loop.time()
        self._timer = self.loop.call_at(self._last + self.pool.read_timeout, self._check_timer)
        self.transport.write(data)
        return resp

    def resume(self) -> None:
        self.paused = False
        self._last = self.loop.time()  # the consumer was behind, not the upstream
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._parser = None
        self._cancel_timer()
        self.pool._forget(self)
        resp, self.response = self.response, None
        if resp is not None:
            resp._fail(StreamClosed("the connection was closed"))
        if self.transport is not None:
            self.transport.close()

    def _error(self, error: UpstreamError) -> None:
        resp = self.response
        if resp is not None:
            resp._fail(error)
        self.close()

    def _check_timer(self) -> None:
        self._timer = None
        if self.closed or self.response is None:
            return
        now = self.loop.time()
        if self.paused:
            self._last = now
        due = self._last + self.pool.read_timeout
        if now < due:
            self._timer = self.loop.call_at(due, self._check_timer)
            return
        self._error(ReadTimeout(f"nothing from the upstream for {self.pool.read_timeout:g} s"))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _head_too_large() -> RemoteProtocolError:
    return RemoteProtocolError(f"a response head over {MAX_HEAD_BYTES} bytes")


class UpstreamPool:
    """Keep-alive connections per origin, and `request()` to send one request on them.

    `headers` are sent with every request (e.g. authorization); names are sent as given.
    """

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        headers: Mapping[str, str] | None = None,
        max_idle_per_origin: int = MAX_IDLE_PER_ORIGIN,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle_per_origin
        self._common = _header_lines(headers or {})
        self._ssl = ssl_context
        self._idle: dict[Origin, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._targets: dict[str, tuple[Origin, bytes, bytes]] = {}
        self._closed = False
        self._spare: dict[Origin, int] = {}  # warm origins: connections kept open ahead
        self._opening: dict[Origin, int] = {}  # background connects in flight, per origin
        self._refilled_at: dict[Origin, float] = {}  # the last refill after an idle close
        self._refills: set[asyncio.Task[None]] = set()

    def warm(self, url: str, spare: int = 1) -> None:
        """Keep `spare` connections to `url`'s origin open ahead of the requests (call from
        the event loop); the first are opened now, in the background."""
        origin = self._target(url)[0]
        self._spare[origin] = spare
        self._refill(origin)

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> UpstreamResponse:
        """Send one request; returns once the response's head arrived (the body streams).

        Raises ConnectError/ConnectTimeout (no connection), ReadTimeout, ReadError or
        RemoteProtocolError. The caller must `close()` the response (a `finally`); reading
        it to its end hands the connection back to the pool.
        """
        if self._closed:
            raise ConnectError("the upstream client is closed")
        origin, target, host = self._target(url)
        extra = _header_lines(headers) if headers else b""
        data = b"".join(
            (
                method.encode("ascii"),
                b" ",
                target,
                b" HTTP/1.1\r\nhost: ",
                host,
                b"\r\n",
                self._common,
                extra,
                b"content-length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        for attempt in range(2):
            conn = self._idle_connection(origin)
            reused = conn is not None
            if origin in self._spare:
                self._refill(origin)  # the next request's, opened while this one runs
            if conn is None:
                conn = await self._connect(origin)
            self._busy.add(conn)
            resp = conn.send(data)
            try:
                await resp._head
            except ReadError:
                resp.close()
                if reused and not conn.received and not attempt:
                    continue  # the upstream closed it idle as we sent: once more, fresh
                raise
            except BaseException:
                resp.close()  # cancelled, a timeout, a bad head: the upstream sees us leave
                raise
            return resp
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self._closed = True
        for task in self._refills:
            task.cancel()
        self._refills.clear()
        conns = [c for idle in self._idle.values() for c in idle] + list(self._busy)
        self._idle.clear()
        self._busy.clear()
        for conn in conns:
            conn.close()

    # -- internals -------------------------------------------------------------------------

    def _target(self, url: str) -> tuple[Origin, bytes, bytes]:
        """(origin, request target, Host value) of a URL, parsed once per URL."""
        hit = self._targets.get(url)
        if hit is not None:
            return hit
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ConnectError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if scheme == "https" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.hostname
        host_value = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            host_value += f":{parts.port}"
        hit = ((scheme, host, port), target.encode("ascii"), host_value.encode("idna"))
        if len(self._targets) < 1024:  # the relay asks for a handful of URLs
            self._targets[url] = hit
        return hit

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            conn.idle = False
            if not conn.closed:
                return conn
        return None

    def _refill(self, origin: Origin) -> None:
        """Open connections in the background until the origin has its spare ones."""
        if self._closed:
            return
        have = len(self._idle.get(origin, ())) + self._opening.get(origin, 0)
        for _ in range(self._spare[origin] - have):
            self._opening[origin] = self._opening.get(origin, 0) + 1
            task = asyncio.get_running_loop().create_task(self._open_spare(origin))
            self._refills.add(task)
            task.add_done_callback(self._refills.discard)

    async def _open_spare(self, origin: Origin) -> None:
        try:
            conn = await self._connect(origin)
        except UpstreamError:
            return  # down: the next request connects (and fails) on its own
        finally:
            self._opening[origin] -= 1
        self._release(conn)

    async def _connect(self, origin: Origin) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            if self._ssl is None:
                # httpx's context: the CAs the relay's GET /models trusts (certifi, or
                # SSL_CERT_FILE / SSL_CERT_DIR), so both legs agree on what to trust.
                import httpx

                self._ssl = httpx.create_ssl_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context is not None else None,
                )
        except TimeoutError as exc:
            raise ConnectTimeout(
                f"no connection to {host}:{port} within {self.connect_timeout:g} s"
            ) from exc
        except OSError as exc:  # refused, unreachable, DNS, TLS (ssl.SSLError is an OSError)
            raise ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        if self._closed:
            conn.close()
            raise ConnectError("the upstream client is closed")
        return conn

    def _release(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle.setdefault(conn.origin, [])
        if self._closed or len(idle) >= self.max_idle:
            conn.close()
        else:
            conn.idle = True
            idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if not conn.idle:
            return
        conn.idle = False
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)
        origin = conn.origin
        if origin in self._spare and not self._closed:
            # The upstream closed an idle one (its keep-alive timeout): open its successor,
            # but not in a loop with an upstream that closes each at once.
            now = conn.loop.time()
            if now - self._refilled_at.get(origin, -REFILL_MIN_S) >= REFILL_MIN_S:
                self._refilled_at[origin] = now
                self._refill(origin)


def _header_lines(headers: Mapping[str, str]) -> bytes:
    """`name: value\r\n` lines; a CR, LF or NUL in a name or value is refused (no header
    injection through a client-supplied request id)."""
    lines = []
    for name, value in headers.items():
        if _BAD_HEADER.search(name) or _BAD_HEADER.search(value):
            raise ValueError(f"the header {name!r} holds CR, LF or NUL")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


_BAD_HEADER = re.compile(r"[\r\n\0]")


async def drain(chunks: AsyncIterator[bytes], within_s: float = 1.0) -> None:
    """Read a body to its end so its connection goes back to the pool (a new one costs a
    connect, and a TLS handshake to a remote upstream); a lingerer is not waited for long."""
    try:
        async with asyncio.timeout(within_s):
            async for _ in chunks:
                pass
    except TimeoutError:
        pass


_TAG = re.compile(r"<(script|style)\b.*?</\1\s*>|<[^>]*>", re.IGNORECASE | re.DOTALL)
_SPACE = re.compile(r"\s+")


def plain_text(raw: bytes, limit: int = 500) -> str:
    """A non-JSON error body as one line: a proxy's HTML page (nginx, an ALB, Cloudflare)
    loses its tags, so `502 Bad Gateway` reads as that, not as markup."""
    text = raw.decode("utf-8", "replace")
    if "<" in text and ">" in text:
        text = _TAG.sub(" ", text)
    return _SPACE.sub(" ", text).strip()[:limit]


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header's wait in seconds: delay-seconds or an HTTP date (against `now`,
    wall-clock seconds, default the time now); None when absent or neither."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return max(0.0, seconds) if math.isfinite(seconds) else None
