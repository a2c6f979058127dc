"""A non-streaming answer: one more reader of the stream's event log, folding it.

The request runs the same lifecycle as a streaming one (admission ticket, engine, outcome,
metrics, TTFT, cancel, shedding); this reader folds each rendered chunk into the answer as it
arrives (the chunk itself is not kept) and stops the stream with `response_too_large` once
the answer passes the registry's `max_response_bytes`: a whole answer is held in memory, a
streamed one is not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import orjson

from firsttoken.core.registry import StreamRegistry
from firsttoken.core.stream import Outcome, Stream
from firsttoken.formats.assemble import ChatAnswer, ChatFold
from firsttoken.formats.sse import event_payload
from firsttoken.generation import EngineError

__all__ = ["Collector"]


class Collector:
    """A log reader that is always caught up: it folds each event's data payload."""

    def __init__(self, stream: Stream, max_bytes: int | None = None) -> None:
        self.stream = stream
        self.cursor = 0
        self.fold = ChatFold()
        self.max_bytes = max_bytes  # None: the registry's max_response_bytes
        self.tokens = 0
        self.failure: EngineError | None = None  # the stream's error event, or our own stop
        self._closed = asyncio.get_running_loop().create_future()

    def deliver(self, seq: int, wire: bytes, tokens: int) -> None:
        self.cursor = seq
        self.tokens += tokens
        name, data = event_payload(wire)
        if name == "error":
            if self.failure is None:
                error = orjson.loads(data)["error"]
                status = self.stream.error_status
                if status == 503 and self.stream.tokens_generated:
                    # A 503 before the first byte says nothing was started, and a front door
                    # sends it to another instance (deploy/nginx-multi.conf); this answer had
                    # begun: the same request there would be generated twice.
                    status = 502
                self.failure = EngineError(
                    error.get("code") or "engine_error",
                    error.get("message") or "",
                    type_=error.get("type") or "server_error",
                    status=status,
                )
            return
        if not data or data == b"[DONE]" or self.failure is not None:
            return
        self.fold.add(orjson.loads(data))
        if self.max_bytes is not None and self.fold.size > self.max_bytes:
            self._too_large()

    def _too_large(self) -> None:
        limit = self.max_bytes
        self.failure = EngineError(
            "response_too_large",
            f"the answer passed the server's limit for a whole answer ({limit} bytes, "
            "--max-response-bytes); ask for it with stream: true, or with a lower max_tokens",
            type_="invalid_request_error",
            status=400,
            client_fault=True,
        )
        # Stopped in the producer's own call: the engine hears it before its next step.
        self.stream.stop(Outcome.ERROR, self.failure)

    def log_closed(self) -> None:
        if not self._closed.done():
            self._closed.set_result(None)

    def move_to(self, stream: Stream) -> None:
        self.stream = stream
        stream.log.attach(self)
        self.catch_up()

    def catch_up(self) -> None:
        for event in self.stream.log.after(self.cursor):  # what a corked append held back
            self.deliver(*event)

    async def run(self, registry: StreamRegistry, gone: Callable[[], Awaitable[None]]) -> bool:
        """Start the stream and collect it; False if the client left first (`gone` returns
        when it has: `wire.exchange.client_gone`), and the stream is then stopped, as a
        streaming reader's departure would."""
        stream = self.stream
        if self.max_bytes is None:
            self.max_bytes = registry.max_response_bytes
        registry.attach(stream)
        stream.log.attach(self)
        delivered = False
        try:
            await registry.start(stream)
            if stream.log.shown_all():
                delivered = True
                return True
            left = asyncio.ensure_future(gone())
            try:
                await asyncio.wait({left, self._closed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                left.cancel()
            delivered = self._closed.done()
            return delivered
        finally:
            stream.log.detach(self)
            if delivered and self.failure is None:
                # Counted before the detach logs the stream's end, so log and metric agree.
                stream.tokens_sent = self.tokens
                registry.metrics.tokens_sent += self.tokens
            registry.detach(stream)

    async def answer(
        self, registry: StreamRegistry, gone: Callable[[], Awaitable[None]]
    ) -> ChatAnswer | None:
        """Run the stream and return what it said as one answer: None if the client left
        first; raises the engine's error (or `response_too_large`) if it failed."""
        if not await self.run(registry, gone):
            return None
        if self.failure is not None:
            raise self.failure
        return self.fold.done()
