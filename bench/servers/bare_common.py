"""What every bare server of `bench.http_servers` shares: the mode, the frames, the ticker.

Standard library only: it is imported by apps that run in granian's own venv (`.venv/granian`),
which has none of the project's dependencies.

The mode comes from the environment (`BARE_MODE`), one per server process, so every server
sees the same request (the load client's `POST /v1/chat/completions`) and the bench starts a
fresh process per workload:

- `idle`: headers, one SSE comment, then nothing until the client closes;
- `burst`: headers, one SSE event, end of the response;
- `stream`: headers, then `BARE_TOKENS` prebuilt frames, one per tick of ONE shared loop timer
  (every `BARE_ITL_MS`) that writes to every live stream, then `[DONE]` and the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from enum import Enum

__all__ = [
    "COMMENT",
    "DONE",
    "FRAME",
    "HEADERS",
    "Mode",
    "TickWaiter",
    "Ticker",
    "itl_s",
    "mode",
    "tokens",
]


class Mode(Enum):
    IDLE = "idle"
    BURST = "burst"
    STREAM = "stream"


def mode() -> Mode:
    return Mode(os.environ.get("BARE_MODE", "burst"))


def tokens() -> int:
    return int(os.environ.get("BARE_TOKENS", "100"))


def itl_s() -> float:
    return float(os.environ.get("BARE_ITL_MS", "20")) / 1000


# Response headers, as (name, value) strings; each server encodes them its own way.
HEADERS = (
    ("content-type", "text/event-stream"),
    ("cache-control", "no-cache, no-transform"),
    ("x-accel-buffering", "no"),
)
COMMENT = b": open\n\n"
DONE = b"data: [DONE]\n\n"
# One OpenAI chat-completion chunk, built once: the data plane writes prebuilt bytes.
FRAME = (
    b"data: %b\n\n"
    % json.dumps(
        {
            "id": "chatcmpl-bare",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": "synthetic",
            "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}],
        },
        separators=(",", ":"),
    ).encode()
)


class Ticker:
    """ONE loop timer for all streams: each tick writes one frame to every live stream.

    A stream is `(write, end)`: `write(frame)` puts bytes on its connection; after `limit`
    frames the ticker calls `end()` (which writes `[DONE]` and closes) and drops it. The
    timer runs only while a stream is live, on a fixed clock from its first tick.
    """

    __slots__ = ("_due", "_handle", "_itl", "_limit", "_loop", "_streams")

    def __init__(self, limit: int, itl: float) -> None:
        self._limit = limit
        self._itl = itl
        self._streams: dict[int, list] = {}  # id -> [write, end, sent]
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0

    def add(self, key: int, write: Callable[[bytes], object], end: Callable[[], object]) -> None:
        self._streams[key] = [write, end, 0]
        if self._handle is None:
            self._loop = asyncio.get_running_loop()
            self._due = self._loop.time() + self._itl
            self._handle = self._loop.call_at(self._due, self._tick)

    def discard(self, key: int) -> None:
        self._streams.pop(key, None)

    def _tick(self) -> None:
        done = []
        limit = self._limit
        for key, entry in self._streams.items():
            entry[0](FRAME)
            entry[2] += 1
            if entry[2] >= limit:
                done.append(key)
        for key in done:
            self._streams.pop(key)[1]()
        if not self._streams:
            self._handle = None
            return
        assert self._loop is not None
        self._due += self._itl
        now = self._loop.time()
        if self._due < now - self._itl:
            self._due = now  # fell behind: don't burst to catch up (the engine's rule)
        self._handle = self._loop.call_at(self._due, self._tick)


class TickWaiter:
    """The ASGI shape of the same ticker: a future per tick that every stream's task awaits.

    An ASGI app can only write from its own task (`await send(...)`), so one shared tick
    wakes every stream's task, which then sends its frame: one wakeup and one `send` per token.
    """

    __slots__ = ("_due", "_future", "_handle", "_itl", "_loop", "_users")

    def __init__(self, itl: float) -> None:
        self._itl = itl
        self._future: asyncio.Future[None] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._users = 0
        self._due = 0.0

    def join(self) -> None:
        self._users += 1
        if self._handle is None:
            self._loop = asyncio.get_running_loop()
            self._future = self._loop.create_future()
            self._due = self._loop.time() + self._itl
            self._handle = self._loop.call_at(self._due, self._tick)

    def leave(self) -> None:
        self._users -= 1

    def next(self) -> asyncio.Future[None]:
        assert self._future is not None
        return self._future

    def _tick(self) -> None:
        assert self._loop is not None and self._future is not None
        fired, self._future = self._future, self._loop.create_future()
        fired.set_result(None)
        if self._users <= 0:
            self._handle = None
            return
        self._due += self._itl
        now = self._loop.time()
        if self._due < now - self._itl:
            self._due = now
        self._handle = self._loop.call_at(self._due, self._tick)
