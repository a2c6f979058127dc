"""An asyncio loop on virtual time, for unit tests of code that awaits deadlines.

`tests/unit/clock.py` drives plain callbacks; this drives coroutines. The loop's `time()` is
virtual, and whenever nothing is ready to run it jumps straight to its next timer (Trio's
`MockClock(autojump_threshold=0)`): `asyncio.sleep(30)`, `asyncio.timeout_at(...)` and every
`call_at` cost no real time, and happen in the order their deadlines say. Run a test body
with `run(coro)`; inside it, `asyncio.get_running_loop().time()` is the clock.

Only for code without real I/O: when no callback is ready and no timer is armed, nothing can
ever wake the loop, so it raises `Deadlock` instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["Deadlock", "VirtualTimeLoop", "run"]

T = TypeVar("T")
START = 1000.0


class Deadlock(RuntimeError):
    """Every task waits and no timer is armed: the test would hang forever."""


class _JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Polls without blocking; where the loop would block for `timeout`, time jumps by it."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise Deadlock("every task is waiting and no timer is armed")
        assert self.loop is not None
        self.loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = START) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = start

    def time(self) -> float:
        return self.now


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)` on a fresh virtual-time loop (time starts at 1000.0)."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
