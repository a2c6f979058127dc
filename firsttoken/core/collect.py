"""A non-streaming answer: one more reader of the stream's event log, collecting it.

The request runs the same lifecycle as a streaming one (admission ticket, engine, outcome,
metrics, TTFT, cancel, shedding); this reader keeps the rendered chunks and, when the log
closes, folds them into the one JSON body the API returns.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request

from firsttoken.core.registry import StreamRegistry
from firsttoken.core.stream import Stream
from firsttoken.engines.base import EngineError
from firsttoken.wire.assemble import ChatAnswer, assemble_chat

__all__ = ["Collector"]


class Collector:
    """A log reader that is always caught up: it keeps each event's data payload."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.cursor = 0
        self.payloads: list[tuple[str | None, bytes]] = []  # (event name, data)
        self.tokens = 0
        self._closed = asyncio.get_running_loop().create_future()

    def deliver(self, seq: int, wire: bytes, tokens: int) -> None:
        self.cursor = seq
        self.tokens += tokens
        name: str | None = None
        data = b""
        for line in wire.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                data = line[6:]
        self.payloads.append((name, data))

    def log_closed(self) -> None:
        if not self._closed.done():
            self._closed.set_result(None)

    def catch_up(self) -> None:
        for event in self.stream.log.after(self.cursor):  # what a corked append held back
            self.deliver(*event)

    async def run(self, registry: StreamRegistry, request: Request) -> bool:
        """Start the stream and collect it; False if the client left first (the stream is
        then stopped, as a streaming reader's departure would)."""
        stream = self.stream
        registry.attach(stream)
        stream.log.attach(self)
        try:
            await registry.start(stream)
            if stream.log.closed:
                return True
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({gone, self._closed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            return self._closed.done()
        finally:
            stream.log.detach(self)
            registry.detach(stream)

    async def answer(self, registry: StreamRegistry, request: Request) -> ChatAnswer | None:
        """Run the stream and fold what it said into one answer: None if the client left
        first; raises the engine's error if it failed."""
        if not await self.run(registry, request):
            return None
        error = self.error()
        if error is not None:
            raise EngineError(
                error.get("code") or "engine_error",
                error.get("message") or "",
                type_=error.get("type") or "server_error",
            )
        registry.metrics.tokens_sent += self.tokens
        return assemble_chat(self.chunks())

    def chunks(self) -> list[dict[str, Any]]:
        """The JSON chunks, in order (the error event's body included)."""
        return [orjson.loads(data) for _, data in self.payloads if data and data != b"[DONE]"]

    def error(self) -> dict[str, Any] | None:
        for name, data in self.payloads:
            if name == "error":
                error: dict[str, Any] = orjson.loads(data)["error"]
                return error
        return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
