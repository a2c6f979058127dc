"""The server's main loop: how often it wakes, and that a signal is seen at once."""

from __future__ import annotations

import asyncio
import signal

import uvicorn

from firsttoken.server import IDLE_TICK_S, _Server
from tests.unit import virtual_loop


async def _app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("no request in these tests")


def _server() -> tuple[_Server, list[float]]:
    server = _Server(uvicorn.Config(_app, lifespan="off"), "http://127.0.0.1:1", None, 0.0)
    ticks: list[float] = []
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(asyncio.get_running_loop().time())
        assert counter % 10 == 0  # uvicorn's Date header is refreshed on every tick
        return await on_tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]
    return server, ticks


def test_an_idle_server_ticks_once_a_second_and_a_signal_ends_it_at_once() -> None:
    server, ticks = _server()

    async def body() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(server.main_loop())
        await asyncio.sleep(10.05)
        assert len(ticks) == 11  # uvicorn's own loop would have ticked 101 times
        assert ticks[1] - ticks[0] == IDLE_TICK_S
        signalled = loop.time()
        server.handle_exit(signal.SIGTERM, None)
        await task
        assert ticks[-1] - signalled < 0.01  # not at the next second's tick

    virtual_loop.run(body())
