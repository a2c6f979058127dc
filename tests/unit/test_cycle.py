"""The direct cycle's arrival flag: uvicorn's `asyncio.Event`, as its cycle uses it."""

from __future__ import annotations

import asyncio

import uvloop

from firsttoken.wire.cycle import Arrival


def test_a_set_arrival_is_waited_for_without_a_turn_of_the_loop() -> None:
    async def main() -> object:
        arrival = Arrival()
        arrival.set()
        waiting = arrival.wait()
        try:
            waiting.send(None)  # one step: done at once, or suspended on a future
        except StopIteration as done:
            return done.value
        waiting.close()
        return "suspended"

    assert uvloop.run(main()) is True


def test_an_arrival_wakes_its_waiters_and_survives_a_cancelled_one() -> None:
    async def main() -> tuple[bool, bool, bool]:
        arrival = Arrival()
        first = asyncio.ensure_future(arrival.wait())
        second = asyncio.ensure_future(arrival.wait())
        await asyncio.sleep(0)
        first.cancel()  # e.g. a disconnect watcher going away
        await asyncio.sleep(0)
        assert not second.done()
        arrival.set()
        woken = await asyncio.wait_for(second, 1)
        arrival.clear()
        assert not arrival.is_set()
        third = asyncio.ensure_future(arrival.wait())
        await asyncio.sleep(0)
        assert not third.done()
        arrival.set()
        return first.cancelled(), woken, await asyncio.wait_for(third, 1)

    assert uvloop.run(main()) == (True, True, True)
