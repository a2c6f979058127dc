"""StreamingProtocol on real loopback sockets: what uvicorn's scope learns of a connection."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn
import uvloop
from uvicorn.server import ServerState

from firsttoken.wire.connection import StreamingProtocol, lean_event


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


Made = tuple[StreamingProtocol, tuple[Any, ...], tuple[Any, ...], tuple[int, int]]


def _made(host: str) -> Made:
    """A connection to a StreamingProtocol: the protocol, the client's view of both ends, and
    the server socket's (TCP_NODELAY, SO_SNDBUF)."""

    async def main() -> Made:
        config = uvicorn.Config(_app, lifespan="off", log_config=None)
        made: list[StreamingProtocol] = []

        def factory() -> StreamingProtocol:
            protocol = StreamingProtocol(config, ServerState(), {})
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
    assert send_buffer == 2 * StreamingProtocol.send_buffer_bytes  # Linux doubles what is set


def test_a_lean_event_still_wakes_its_waiters() -> None:
    async def main() -> tuple[bool, type]:
        event = asyncio.Event()
        lean_event(event)
        waiter = asyncio.ensure_future(event.wait())
        await asyncio.sleep(0)
        event.set()
        woken = await asyncio.wait_for(waiter, 1)
        event.clear()
        late = asyncio.ensure_future(event.wait())
        await asyncio.sleep(0)
        late.cancel()  # a cancelled waiter leaves the list
        await asyncio.gather(late, return_exceptions=True)
        assert not event._waiters
        return woken, type(event._waiters)

    woken, queue = uvloop.run(main())
    assert woken
    assert queue is list  # asyncio's Event still keeps a deque there: the swap applies


def test_a_connection_keeps_both_of_its_events_lean() -> None:
    protocol = _made("127.0.0.1")[0]
    assert type(protocol.flow._is_writable_event._waiters) is list
