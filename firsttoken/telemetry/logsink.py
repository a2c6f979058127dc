"""Log lines to a file descriptor, one write(2) per turn of the event loop.

Every stream logs a line as it ends (three at debug: accepted, first token, finished). Written
one by one, a burst of new streams paid a system call per line, as much as a token's write.
Lines logged during one turn of the loop go out together, before the loop sleeps again; off
the loop (start-up, shutdown, other threads) a line is written at once. Whoever owns the sink
flushes it before the process exits or forks.
"""

from __future__ import annotations

import asyncio
import os
import threading

__all__ = ["LineSink"]


class LineSink:
    __slots__ = ("_claim", "_fd", "_owner", "_pending")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending: list[bytes] = []  # touched by the owner's thread only
        self._owner: int | None = None  # the thread whose event loop flushes `_pending`
        self._claim = threading.Lock()

    def __call__(self, line: bytes) -> None:
        ident = threading.get_ident()
        if ident != self._owner:
            with self._claim:  # rare: the first line, or a line from another thread
                claimed = not self._pending and asyncio._get_running_loop() is not None
                if claimed:
                    self._owner = ident
            if not claimed:
                self._write(line)
                return
        pending = self._pending
        if not pending:
            loop = asyncio._get_running_loop()
            if loop is None:  # the owner's loop has ended: no turn will flush
                self._write(line)
                return
            loop.call_soon(self.flush)
        pending.append(line)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            self._write(data)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
