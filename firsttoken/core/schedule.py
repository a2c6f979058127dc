"""One loop timer for many deadlines: heartbeats, send timeouts and grace periods.

A connection that waits costs an entry in a heap, not a task or a timer handle of its own.
Entries are never moved: a callback that finds its deadline has shifted (a write happened
since) simply schedules itself again, so the per-token path only stores a timestamp.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

__all__ = ["Schedule", "ScheduledCall"]

# uvloop's timers have 1 ms resolution and may fire up to 1 ms early by `loop.time()`: treat
# what is due within it as due, instead of spinning until the clock catches up.
_SLACK = 0.001


class ScheduledCall:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Schedule:
    """Calls callbacks at (or just after) their deadline, on `clock`'s time line.

    `clock` and `call_at` default to the running loop's; tests pass a fake clock and drive
    `run_due()` themselves.
    """

    def __init__(
        self,
        clock: Callable[[], float] | None = None,
        call_at: Callable[[float, Callable[[], None]], object] | None = None,
    ) -> None:
        self._clock = clock
        self._call_at = call_at
        self._heap: list[tuple[float, int, ScheduledCall]] = []
        self._order = itertools.count()
        self._armed_for: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def now(self) -> float:
        if self._clock is None:
            self._clock = asyncio.get_running_loop().time
        return self._clock()

    def call_at(self, when: float, callback: Callable[[], None]) -> ScheduledCall:
        call = ScheduledCall(when, callback)
        heapq.heappush(self._heap, (when, next(self._order), call))
        if self._armed_for is None or when < self._armed_for:
            self._arm(when)
        return call

    def call_later(self, delay: float, callback: Callable[[], None]) -> ScheduledCall:
        return self.call_at(self.now() + delay, callback)

    def sample_lag(
        self,
        interval: float,
        observe: Callable[[float], None],
        busy: Callable[[], bool] | None = None,
        idle_interval: float = 1.0,
    ) -> Callable[[], None]:
        """Every `interval`, `observe` how late an entry of this schedule ran past its
        deadline: the event loop's lag. A loop busy with other work (a burst of new
        streams) runs everything late, and a request waiting in the kernel to be read
        waits about as long; the process being descheduled shows here too.

        While `busy()` says there is nothing to be late for, it samples every
        `idle_interval` instead: an idle server wakes for it once a second, not twenty
        times (each wake is a VM exit and a loop turn, ~0.3 ms of CPU here). Returns
        `wake`, for the first stream of a burst: the next sample is `interval` away again.
        """
        pending: ScheduledCall | None = None
        idle = False

        def arm(delay: float) -> None:
            nonlocal pending
            due = self.now() + delay
            pending = self.call_at(due, lambda: sample(due))

        def sample(when: float) -> None:
            nonlocal idle
            observe(max(0.0, self.now() - when))  # an entry may run up to _SLACK early
            idle = busy is not None and not busy()
            arm(idle_interval if idle else interval)

        def wake() -> None:
            nonlocal idle
            if idle and pending is not None:
                idle = False
                pending.cancel()
                arm(interval)

        arm(interval)
        return wake

    def __len__(self) -> int:
        return len(self._heap)

    def run_due(self) -> None:
        """Run every callback whose deadline has passed, then re-arm for the next one."""
        self._armed_for = None
        self._timer = None
        now = self.now() + _SLACK
        heap = self._heap
        due: list[ScheduledCall] = []
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap)[2])
        # Callbacks run after the pop, so one that schedules itself again runs next time.
        for call in due:
            if not call.cancelled:
                call.callback()
        # Drop cancelled entries at the top so an idle server does not wake for them.
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._heap.clear()
        self._armed_for = None

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_for = when
        if self._call_at is not None:
            self._call_at(when, self.run_due)
            return
        self._timer = asyncio.get_running_loop().call_at(when, self.run_due)
