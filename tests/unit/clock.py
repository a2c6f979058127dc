"""A fake clock for unit tests (Trio's MockClock idea): time moves only when a test says."""

from __future__ import annotations

from collections.abc import Callable


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def __call__(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., None], *args: object) -> None:
        self.timers.append((when, lambda: callback(*args)))

    def time(self) -> float:  # the loop's clock, for code that asks the loop
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time on, firing each armed timer that comes due, in order."""
        target = self.now + seconds
        while True:
            due = sorted((t for t in self.timers if t[0] <= target), key=lambda t: t[0])
            if not due:
                break
            when, callback = due[0]
            self.timers.remove(due[0])
            self.now = max(self.now, when)
            callback()
        self.now = target
