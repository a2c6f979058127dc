"""StreamingProtocol on real loopback sockets: what uvicorn's scope learns of a connection."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn
import uvloop
from uvicorn.server import ServerState

from firsttoken.wire.connection import (
    CONNECTION_KEY,
    ConnectionOptions,
    RequestTransport,
    StreamingProtocol,
)
from firsttoken.wire.cycle import Flow


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


_PLAIN = ConnectionOptions()
Made = tuple[StreamingProtocol, tuple[Any, ...], tuple[Any, ...], tuple[int, int]]


def _made(host: str, given: ConnectionOptions = _PLAIN) -> Made:
    """A connection to a StreamingProtocol: the protocol, the client's view of both ends, and
    the server socket's (TCP_NODELAY, SO_SNDBUF)."""

    async def main() -> Made:
        config = uvicorn.Config(_app, lifespan="off", log_config=None)
        made: list[StreamingProtocol] = []

        def factory() -> StreamingProtocol:
            protocol = StreamingProtocol(config, ServerState(), {}, options=given)
            made.append(protocol)
            return protocol

        loop = asyncio.get_running_loop()
        server = await loop.create_server(factory, host, 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection(host, port)
        client_sock: socket.socket = writer.get_extra_info("socket")
        client_end, server_end = client_sock.getsockname(), client_sock.getpeername()
        await asyncio.sleep(0.01)
        accepted = made[0].transport.get_extra_info("socket")
        options = (
            accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
            accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
        )
        writer.close()
        server.close()
        return made[0], client_end, server_end, options

    return uvloop.run(main())


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_scope_gets_both_ends_of_the_connection(host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    protocol, client_end, server_end, _ = _made(host)
    assert protocol.client == (client_end[0], client_end[1])
    assert protocol.server == (server_end[0], server_end[1])
    assert protocol.scheme == "http"


def test_every_connection_is_tcp_nodelay_with_a_fixed_send_buffer() -> None:
    nodelay, send_buffer = _made("127.0.0.1")[3]
    assert nodelay
    assert send_buffer == 2 * _PLAIN.send_buffer_bytes  # Linux doubles what is set


def test_the_send_buffer_is_each_connections_option() -> None:
    """It was a class attribute the server overwrote (one value per process, set by mutation)."""
    send_buffer = _made("127.0.0.1", ConnectionOptions(send_buffer_bytes=32768))[3][1]
    assert send_buffer == 2 * 32768


def test_a_send_waits_for_a_paused_writer_to_resume() -> None:
    class Reading:
        paused = 0

        def pause_reading(self) -> None:
            self.paused += 1

        def resume_reading(self) -> None:
            self.paused -= 1

    async def main() -> tuple[bool, bool, int]:
        reading = Reading()
        flow = Flow(reading)  # type: ignore[arg-type]
        await asyncio.wait_for(flow.drain(), 1)  # writable: no wait
        flow.pause_writing()
        drained = asyncio.ensure_future(flow.drain())
        await asyncio.sleep(0.01)
        waited = not drained.done()
        flow.resume_writing()
        await asyncio.wait_for(drained, 1)
        flow.pause_reading()
        flow.pause_reading()  # once to the transport, however often asked
        return waited, flow.read_paused, reading.paused

    waited, read_paused, paused = uvloop.run(main())
    assert waited and read_paused and paused == 1


class _Written:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closed = True


def test_held_writes_come_back_unwritten_and_later_ones_go_through() -> None:
    real = _Written()
    transport = RequestTransport(real)  # type: ignore[arg-type]
    transport.hold()
    transport.write(b"head ")
    transport.write(b"more")
    assert transport.release() == b"head more" and real.parts == []
    transport.write(b"after")
    assert real.parts == [b"after"] and transport.release() == b""
    transport.hold()
    transport.close()  # a close while held still closes
    assert real.closed


class _Hot:
    """DirectRoutes for the tests: paths under /hot, answered with what the cycle saw."""

    def __init__(self) -> None:
        self.served: list[str] = []

    def route(self, method: str, path: str) -> Any | None:
        return path if path.startswith("/hot") else None

    async def serve(self, route: Any, scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        self.served.append(route)
        body = b"direct " + message["body"]
        headers = [(b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _exchange(hot: _Hot, raw: bytes, replies: int) -> bytes:
    """Send `raw` to a StreamingProtocol serving `hot` directly; read `replies` answers (or
    until the server closes)."""
    config = uvicorn.Config(_app, lifespan="off", log_config=None)
    state = ServerState()
    options = ConnectionOptions(direct=hot)

    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: StreamingProtocol(config, state, {}, options=options), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    got = b""
    try:
        async with asyncio.timeout(5):
            while got.count(b"HTTP/1.1 ") < replies or not _complete(got):
                chunk = await reader.read(65536)
                if not chunk:
                    break
                got += chunk
    finally:
        writer.close()
        server.close()
    return got


def _complete(got: bytes) -> bool:
    last = got.rpartition(b"HTTP/1.1 ")[2]
    if last.startswith(b"204"):
        return last.endswith(b"\r\n\r\n")
    return last.endswith(b"direct ") or last.endswith(b"}")


def _post(path: str, body: bytes = b"{}", extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return b"POST %s HTTP/%s\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s" % (
        path.encode(),
        version,
        len(body),
        extra,
        body,
    )


def test_a_hot_route_is_served_from_the_connection_and_keeps_it_alive() -> None:
    hot = _Hot()
    got = uvloop.run(_exchange(hot, _post("/hot/a", b"{1}") + _post("/hot/b", b"{2}"), 2))
    # The second request came while the first was answered (pipelined): it waited for it,
    # and was served directly too (uvicorn's ASGI path, this test's app, would answer 204).
    # A client's next request often comes this way: as soon as the last event's chunk.
    assert got.startswith(b"HTTP/1.1 200 OK"), got
    assert got.index(b"direct {1}") < got.index(b"direct {2}")
    assert b" 204 " not in got
    assert hot.served == ["/hot/a", "/hot/b"]

    hot = _Hot()

    async def one_after_another() -> list[bytes]:
        config = uvicorn.Config(_app, lifespan="off", log_config=None)
        options = ConnectionOptions(direct=hot)

        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: StreamingProtocol(config, ServerState(), {}, options=options), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for path in ("/hot/a", "/hot/b"):
            writer.write(_post(path, b"{}"))
            answers.append(await reader.readuntil(b"direct {}"))
        writer.close()
        server.close()
        return answers

    answers = uvloop.run(one_after_another())
    assert all(a.startswith(b"HTTP/1.1 200 OK") for a in answers)
    assert hot.served == ["/hot/a", "/hot/b"]  # the same connection, both served directly


@pytest.mark.parametrize(
    "request_bytes",
    [
        _post("/hot/a", version=b"1.0"),
        _post("/hot/a", extra=b"expect: 100-continue\r\n"),
        _post("/hot%2Fa"),
        _post("/other"),
    ],
    ids=["http-1.0", "expect-100-continue", "escaped-path", "not-a-hot-route"],
)
def test_what_the_direct_path_leaves_to_uvicorns_asgi_layers(request_bytes: bytes) -> None:
    hot = _Hot()
    got = uvloop.run(_exchange(hot, request_bytes, 1))
    assert hot.served == []
    assert b" 204 " in got.split(b"\r\n", 1)[0], got


def test_a_direct_request_asking_to_close_gets_its_answer_then_the_close() -> None:
    hot = _Hot()
    got = uvloop.run(_exchange(hot, _post("/hot/a", extra=b"connection: close\r\n"), 2))
    assert hot.served == ["/hot/a"]
    assert got.startswith(b"HTTP/1.1 200 OK") and b"connection: close" in got
    assert got.endswith(b"direct {}")  # and then the server closed: no second reply came


class _Slow(_Hot):
    """`/hot/slow` answers after the rest of what was sent with it has been read, saying
    whether the connection's cycle was still its own then, and how many requests waited."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, int]] = []

    async def serve(self, route: Any, scope: Any, receive: Any, send: Any) -> None:
        if route != "/hot/slow":
            await super().serve(route, scope, receive, send)
            return
        await receive()
        connection = scope[CONNECTION_KEY]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.2)
        self.seen.append((connection.cycle.scope is scope, len(connection.pipeline)))
        await send({"type": "http.response.body", "body": b"direct slow", "more_body": False})


def test_a_request_pipelined_behind_an_answer_waits_and_leaves_it_the_connection() -> None:
    """The answer under way keeps the connection's cycle (where a stream finds its transport
    and chunk framing); the request behind it is answered after it, in order."""
    hot = _Slow()
    got = uvloop.run(_exchange(hot, _post("/hot/slow") + _post("/hot/b", b"{2}"), 2))
    assert hot.seen == [(True, 1)]
    assert got.startswith(b"HTTP/1.1 200 OK"), got
    assert got.index(b"direct slow") < got.index(b"direct {2}")
    assert hot.served == ["/hot/b"]  # after the slow one, from the queue, directly


def test_past_max_pipelined_the_rest_is_not_read_and_the_connection_closes() -> None:
    hot = _Slow()
    behind = StreamingProtocol.max_pipelined
    raw = _post("/hot/slow") + b"".join(_post(f"/other/{i}") for i in range(behind + 4))
    got = uvloop.run(_exchange(hot, raw, behind + 5))
    assert got.count(b"HTTP/1.1 ") == 1 + behind, got  # then the close: no more answers
    assert got.count(b"connection: close") == 1 and got.endswith(b"\r\n\r\n")


@pytest.mark.parametrize(
    "behind",
    [
        _post("/other") + b"NOT HTTP\r\n\r\n",
        b"GET /x HTTP/1.1\r\n" + b"x: %s\r\n" % (b"a" * 1000) * 300,  # past max_head_bytes
    ],
    ids=["not-http", "head-too-large"],
)
def test_a_bad_request_behind_an_answer_ends_the_connection_after_it_not_inside_it(
    behind: bytes,
) -> None:
    """Its 400 (or 431) used to be written at once: inside the answer under way."""
    hot = _Slow()
    got = uvloop.run(_exchange(hot, _post("/hot/slow") + behind, 3))
    assert got.startswith(b"HTTP/1.1 200 OK") and got.count(b"HTTP/1.1 ") == 1, got
    assert got.endswith(b"0\r\n\r\n")  # the answer ended whole, then the close


@pytest.mark.parametrize(
    "request_bytes",
    [
        _post("/hot/a", b"{}", b"connection: upgrade\r\nupgrade: websocket\r\n"),
        b"GET /other HTTP/1.1\r\nhost: x\r\nconnection: upgrade, http2-settings\r\n"
        b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n\r\n",
    ],
    ids=["post-websocket", "get-h2c"],
)
def test_an_upgrade_gets_a_plain_answer_then_the_close(request_bytes: bytes) -> None:
    """uvicorn hands a WebSocket upgrade to the `websockets` package when it is installed,
    which never answered a POST; nothing after the head is read as HTTP either."""
    hot = _Hot()
    smuggled = _post("/hot/smuggled")
    got = uvloop.run(_exchange(hot, request_bytes + smuggled, 2))
    assert got.startswith(b"HTTP/1.1 204 No Content"), got
    assert b"connection: close" in got and got.count(b"HTTP/1.1 ") == 1
    assert hot.served == []


class _Early(_Hot):
    """Answers 413 at once, reading none of the body."""

    async def serve(self, route: Any, scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": b"large"})


def test_an_answer_before_the_body_is_in_closes_after_a_short_linger() -> None:
    """A client trickling the rest of a body it was refused used to keep the connection as
    long as it trickled; each byte also reset the keep-alive timer."""

    async def main() -> tuple[bytes, float]:
        config = uvicorn.Config(_app, lifespan="off", log_config=None)

        class Protocol(StreamingProtocol):
            linger_s = 0.5

        options = ConnectionOptions(direct=_Early())
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: Protocol(config, ServerState(), {}, options=options), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /hot/a HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n{")
        answer = await asyncio.wait_for(reader.readuntil(b"large"), 2)
        start = loop.time()
        try:
            async with asyncio.timeout(5):
                while True:  # trickle until the server closes
                    writer.write(b"x" * 20)
                    await writer.drain()
                    if reader.at_eof() or writer.is_closing():
                        break
                    await asyncio.sleep(0.05)
                    if await _closed(reader):
                        break
        except (ConnectionError, TimeoutError):
            pass
        held = loop.time() - start
        writer.close()
        server.close()
        return answer, held

    answer, held = uvloop.run(main())
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert held < 1.5, held  # half-closed at once; closed after linger_s


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        data = await asyncio.wait_for(reader.read(65536), 0.01)
    except TimeoutError:
        return False
    return data == b""


def test_a_slow_head_behind_an_answer_waits_for_it_then_has_its_deadline() -> None:
    """The head's deadline used to cut the connection, and the answer under way with it."""

    class Slower(_Slow):
        async def serve(self, route: Any, scope: Any, receive: Any, send: Any) -> None:
            await asyncio.sleep(0.6)  # twice the header deadline
            await super().serve(route, scope, receive, send)

    async def main() -> tuple[bytes, float]:
        config = uvicorn.Config(_app, lifespan="off", log_config=None)

        options = ConnectionOptions(header_timeout_s=0.3, direct=Slower())
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: StreamingProtocol(config, ServerState(), {}, options=options), "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post("/hot/slow") + b"GET /next HTTP/1.1\r\nhost:")  # never ends
        got, answered = b"", loop.time()
        async with asyncio.timeout(5):
            while chunk := await reader.read(65536):
                got += chunk
                if got.endswith(b"0\r\n\r\n"):
                    answered = loop.time()
        closed = loop.time() - answered
        writer.close()
        server.close()
        return got, closed

    got, closed = uvloop.run(main())
    assert got.startswith(b"HTTP/1.1 200 OK") and got.endswith(b"direct slow\r\n0\r\n\r\n"), got
    assert closed < 0.6, closed  # then the head's deadline, from the answer's end at most
