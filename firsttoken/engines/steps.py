"""A step engine seen as an async iterator of deltas, for callers that pull one request
(the prompt cache, tests): a sink that queues what the steps push."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from firsttoken.generation import Delta, EngineError, GenerationRequest

if TYPE_CHECKING:
    from firsttoken.generation import StepEngine

__all__ = ["pull"]

_WINDOW = 16  # deltas queued before the engine is asked to pause


class _QueueSink:
    def __init__(self) -> None:
        self.items: deque[Delta | EngineError] = deque()
        self.ended = False
        self.wakeup: asyncio.Future[None] | None = None

    def push(self, text: str, finish: str | None = None) -> bool:
        self.items.append(Delta(text, finish))
        self.ended = finish is not None
        self._wake()
        return len(self.items) < _WINDOW

    def push_delta(self, delta: Delta) -> bool:
        self.items.append(delta)
        self.ended = delta.finish_reason is not None
        self._wake()
        return len(self.items) < _WINDOW

    def finish(self, reason: str) -> None:
        self.items.append(Delta("", reason))
        self.ended = True
        self._wake()

    def fail(self, error: EngineError) -> None:
        self.items.append(error)
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)


async def pull(engine: StepEngine, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
    sink = _QueueSink()
    generation = engine.open(request, sink)
    try:
        while True:
            while not sink.items:
                sink.wakeup = asyncio.get_running_loop().create_future()
                await sink.wakeup
            item = sink.items.popleft()
            if len(sink.items) == _WINDOW // 2:
                generation.resume()
            if isinstance(item, EngineError):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        generation.cancel()
