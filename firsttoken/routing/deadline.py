"""A leg's phase deadline: one loop timer per leg, not one per chunk.

`asyncio.timeout()` around every read costs a timer handle, a heap push and a cancel per
chunk. Here the deadline is a number the reader moves forward; the one timer, when it fires,
re-arms itself at the deadline it now finds, and cancels the task only if the reader is still
waiting past it. Time the reader spends away (its client reading slowly) never counts: the
deadline is set when it starts to wait.
"""

from __future__ import annotations

import asyncio

__all__ = ["Deadline"]


class Deadline:
    __slots__ = ("_cancelling", "_handle", "_loop", "_task", "due", "expired", "waiting")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[object] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._cancelling = 0
        self.due = 0.0
        self.waiting = False
        self.expired = False

    def wait_until(self, due: float) -> None:
        """The reader starts waiting; it must have its answer by `due` (loop time)."""
        self.due = due
        self.waiting = True
        # The task that waits now: a hedged leg's first read runs in a task of its own,
        # the rest in the stream's.
        task = self._task = asyncio.current_task()
        assert task is not None
        self._cancelling = task.cancelling()
        handle = self._handle
        if handle is None or handle.when() > due:
            if handle is not None:
                handle.cancel()
            self._handle = self._loop.call_at(due, self._fire)

    def done_waiting(self) -> None:
        self.waiting = False

    def owns(self, exc: asyncio.CancelledError) -> bool:
        """Whether this cancellation is the deadline's (then it is taken back from the task,
        as asyncio.timeout does) rather than someone else's."""
        task = self._task
        return self.expired and task is not None and task.uncancel() <= self._cancelling

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        if not self.waiting:
            return  # the reader re-arms when it waits again
        now = self._loop.time()
        if now < self.due:
            self._handle = self._loop.call_at(self.due, self._fire)
            return
        self.expired = True
        if self._task is not None:
            self._task.cancel()
