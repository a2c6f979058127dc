"""A small HTTP/3 client on aioquic's H3Connection: requests on one QUIC connection, each
response's body read as it arrives, and a stream that can be cancelled (RESET_STREAM and
STOP_SENDING with H3_REQUEST_CANCELLED), as a browser does when a page drops an EventSource.

Used by tests/system/test_front_door.py and bench/front_door.py against Caddy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

__all__ = ["H3Client", "H3Response", "h3_connect"]

_END = object()  # the stream ended (FIN, reset, or the connection went)


class H3Response:
    """One request's answer: `status` and `headers` once they came, then `chunks()`."""

    def __init__(self, client: H3Client, stream_id: int, queue: asyncio.Queue[Any]) -> None:
        self.client = client
        self.stream_id = stream_id
        self.queue = queue
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_t = 0.0  # perf_counter when the headers came
        self.ended = False

    async def _read_headers(self) -> None:
        item = await self.queue.get()
        if item is _END:
            raise ConnectionError("the stream ended before its headers")
        assert isinstance(item, HeadersReceived), item
        self.headers_t = time.perf_counter()
        for name, value in item.headers:
            self.headers[name.decode()] = value.decode()
        self.status = int(self.headers.get(":status", "0"))
        self.ended = item.stream_ended

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, one DATA frame's payload at a time."""
        while not self.ended:
            item = await self.queue.get()
            if item is _END:
                self.ended = True
                return
            if isinstance(item, DataReceived):
                self.ended = item.stream_ended
                if item.data:
                    yield item.data

    def cancel(self) -> None:
        """Drop the request both ways; the connection stays for other requests."""
        quic = self.client._quic
        code = ErrorCode.H3_REQUEST_CANCELLED
        quic.reset_stream(self.stream_id, code)
        quic.stop_stream(self.stream_id, code)
        self.client.transmit()
        self.ended = True


class H3Client(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.streams: dict[int, asyncio.Queue[Any]] = {}

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            for queue in self.streams.values():
                queue.put_nowait(_END)
            return
        if isinstance(event, StreamReset) and event.stream_id in self.streams:
            self.streams[event.stream_id].put_nowait(_END)
        for h3_event in self.http.handle_event(event):
            self._deliver(h3_event)

    def _deliver(self, event: H3Event) -> None:
        queue = self.streams.get(getattr(event, "stream_id", -1))
        if queue is not None:
            queue.put_nowait(event)

    async def request(
        self,
        method: str,
        authority: str,
        path: str,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
    ) -> H3Response:
        stream_id = self._quic.get_next_available_stream_id()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.streams[stream_id] = queue
        fields = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
            (b"user-agent", b"firsttoken-tests-h3"),
        ]
        fields += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        if body:
            # As browsers send it. Without it Caddy 2.6 (its quic-go) forwards an HTTP/3
            # request body as `Content-Length: 0`: the gateway would see an empty body.
            fields.append((b"content-length", str(len(body)).encode()))
        self.http.send_headers(stream_id, fields, end_stream=not body)
        if body:
            self.http.send_data(stream_id, body, end_stream=True)
        self.transmit()
        response = H3Response(self, stream_id, queue)
        await response._read_headers()
        return response


@asynccontextmanager
async def h3_connect(
    port: int,
    cafile: str,
    host: str = "127.0.0.1",
    server_name: str = "localhost",
    on_ticket: Callable[[Any], None] | None = None,
) -> AsyncIterator[H3Client]:
    """One QUIC connection (handshake done on entry) to `host:port`, verified with `cafile`."""
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=server_name)
    config.load_verify_locations(cafile)
    async with connect(
        host, port, configuration=config, create_protocol=H3Client, session_ticket_handler=on_ticket
    ) as client:
        assert isinstance(client, H3Client)
        yield client
