"""Hedging: a slow continuation is also asked of the next target, and the first to answer
carries on (the seam is what the user waits through).

`race` waits for the first delta of the leg it is given; past `target.hedge_after()` it asks
`spare` for a second leg, and whichever answers first wins while the other is cancelled
(its leg is closed by whoever opened it). A leg that fails while the other runs is handed
to `lost` and passed over; when both fail, the last error is raised with `.target` set.

Cost: only a splice on a route with `hedge` races (a task per leg for its first delta, one
timer); the winner is then read as a leg is, a call per delta (`Reader`). Time is the
loop's clock (virtual in the tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from firsttoken.generation import Delta, EngineError
from firsttoken.routing.target import Target

__all__ = ["Reader", "Spare", "race"]

# The second leg, asked when the first is slow: its target and deltas (None: none left).
Spare = Callable[[], Awaitable[tuple[Target, AsyncIterator[Delta]] | None]]


async def race(
    target: Target,
    deltas: AsyncIterator[Delta],
    spare: Spare,
    lost: Callable[[Target, EngineError], None],
) -> tuple[Target, AsyncIterator[Delta]]:
    """The winner and its deltas, the first one included."""
    loop = asyncio.get_running_loop()
    racers: dict[asyncio.Future[Delta], tuple[Target, AsyncIterator[Delta]]] = {}
    racers[asyncio.ensure_future(anext(deltas))] = (target, deltas)
    spare_at: float | None = loop.time() + target.hedge_after()
    error: BaseException | None = None
    try:
        while racers:
            timeout = None if spare_at is None else max(0.0, spare_at - loop.time())
            done, _ = await asyncio.wait(
                racers, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:  # slow: ask the next target as well
                spare_at = None
                second = await spare()
                if second is not None:
                    racers[asyncio.ensure_future(anext(second[1]))] = second
                continue
            for future in done:
                who, its = racers.pop(future)
                failure = future.exception()
                if failure is None:
                    return who, _chain(future.result(), its)
                if isinstance(failure, StopAsyncIteration):
                    return who, _chain(None, its)  # ended at once: nothing more to read
                error = failure
                if racers:  # the other still runs: this one is reported here
                    if isinstance(failure, EngineError):
                        lost(who, failure)
                    else:
                        raise failure
                elif isinstance(failure, EngineError):
                    failure.target = who.name
        assert error is not None
        raise error
    finally:
        for future in racers:
            future.cancel()  # the loser (its leg is closed by whoever opened it)
        if racers:
            # Let the cancelled reads end before anyone closes their legs.
            await asyncio.wait(racers)


class Reader:
    """A race's winner, read as a leg is: a call per delta, None at the end."""

    __slots__ = ("deltas",)

    def __init__(self, deltas: AsyncIterator[Delta]) -> None:
        self.deltas = deltas

    async def next(self) -> Delta | None:
        try:
            return await anext(self.deltas)
        except StopAsyncIteration:
            return None


async def _chain(first: Delta | None, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    if first is not None:
        yield first
    async for delta in rest:
        yield delta
