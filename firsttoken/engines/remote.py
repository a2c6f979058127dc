"""What every engine that streams from one remote upstream shares: its base URL, its lean
connection pool, its model list, and stopping a request by closing its response."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from typing import ClassVar
from urllib.parse import urlsplit

import httpx

from firsttoken.engines.text import count_words
from firsttoken.engines.upstream import (
    ConnectError,
    ConnectTimeout,
    ReadTimeout,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from firsttoken.engines.upstream_errors import generic
from firsttoken.generation import BaseEngine, Delta, EngineError, GenerationRequest
from firsttoken.telemetry.log import log_event

__all__ = ["WARM_CONNECTIONS", "RemoteEngine", "upstream_base"]

WARM_CONNECTIONS = 1  # kept open to each upstream ahead of its next request


def upstream_base(url: str) -> str:
    """A bare `http://host:port` gets `/v1`; a URL with a path is the API root as given."""
    url = url.strip().rstrip("/")
    if urlsplit(url).path in ("", "/"):
        url += "/v1"
    return url


class RemoteEngine(BaseEngine):
    """One upstream at `url` (the API root). `model`, when given, is the name the upstream
    knows; else `start()` lists what it serves (`GET /models`), when it answers: an upstream
    down at start is the routes' health to see, never fatal here."""

    log_name = "upstream"  # the prefix of its log events: `<name>.upstream(_down)`
    models_params: ClassVar[Mapping[str, str | int]] = {}

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str],
        model: str | None,
        connect_timeout_s: float,
        read_timeout_s: float,
        errors: str = "pass",
    ) -> None:
        self.base = upstream_base(url)
        # --upstream-errors: "redact" keeps even an error-shaped message from the client.
        self.redact = errors == "redact"
        self.model = model
        self.models: tuple[str, ...] = (model,) if model else ()
        self.listed: tuple[str, ...] | None = None  # what GET /models last said; None: no answer
        self.tokens_generated = 0
        self._headers = {"accept-encoding": "identity", **headers}
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._pool: UpstreamPool | None = None
        self._inflight: dict[str, UpstreamResponse] = {}
        self._aborted: set[str] = set()

    async def start(self) -> None:
        # Each stream holds a connection for its whole length; admission bounds them.
        self._pool = UpstreamPool(
            connect_timeout=self._connect_timeout,
            read_timeout=self._read_timeout,
            headers={
                **self._headers,
                "content-type": "application/json",
                "accept": "text/event-stream",
            },
        )
        # A connection open ahead of each request: the first one's too.
        self._pool.warm(self.base, WARM_CONNECTIONS)
        await self.fetch_models()

    async def fetch_models(self) -> tuple[str, ...] | None:
        """GET /models: the ids the upstream serves, or None when it did not answer (also
        the routes' active health check)."""
        timeout = httpx.Timeout(max(10.0, self._connect_timeout), connect=self._connect_timeout)
        try:
            async with httpx.AsyncClient(timeout=timeout, headers=self._headers) as client:
                resp = await client.get(self.base + "/models", params=dict(self.models_params))
                resp.raise_for_status()
                ids = tuple(str(m["id"]) for m in resp.json()["data"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log_event(
                f"{self.log_name}.upstream_down",
                logging.WARNING,
                upstream=self.base,
                error=str(exc),
            )
            return None
        self.listed = ids
        if not self.model:
            self.models = ids
        log_event(f"{self.log_name}.upstream", upstream=self.base, models=list(ids))
        return ids

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None

    def counters(self) -> dict[str, int]:
        return {}

    def prompt_tokens(self, prompt: str) -> int:
        return count_words(prompt)

    async def post(
        self,
        request: GenerationRequest,
        path: str,
        body: bytes,
        refused: Callable[[UpstreamResponse, bytes], EngineError],
        read: Callable[[UpstreamResponse], AsyncGenerator[Delta, None]],
    ) -> AsyncGenerator[Delta, None]:
        """Stream one request: POST `body` to `path` (`send`), `read(resp)` for the deltas.
        The response is closed at the end, early or not, so the upstream sees us leave at
        once; a failure is mapped once (`settle`)."""
        rid = request.request_id
        resp: UpstreamResponse | None = None
        try:
            resp = await self.send(request, path, body, refused)
            async with aclosing(read(resp)) as deltas:
                async for delta in deltas:
                    if rid in self._aborted:
                        return  # not even what had already arrived
                    yield delta
        except (EngineError, UpstreamError) as exc:
            self.settle(exc, request)
        finally:
            self.done(rid, resp)

    async def send(
        self,
        request: GenerationRequest,
        path: str,
        body: bytes,
        refused: Callable[[UpstreamResponse, bytes], EngineError],
    ) -> UpstreamResponse:
        """POST `body` to `path` (the request id and the client's trace go along): the
        response once its head arrived, `refused(resp, body)` raised for an HTTP error
        answer. The caller ends it with `done` (a `finally`), whatever happened."""
        if self._pool is None:
            raise EngineError("engine_unavailable", f"the {self.log_name} engine is not started")
        rid = request.request_id
        headers = {"x-request-id": rid}
        if request.traceparent is not None:  # the trace goes on upstream
            headers["traceparent"] = request.traceparent
        resp = await self._pool.request("POST", self.base + path, body, headers)
        self._inflight[rid] = resp
        if resp.status_code >= 400:
            raise refused(resp, await resp.read_bounded())
        return resp

    def settle(self, exc: EngineError | UpstreamError, request: GenerationRequest) -> None:
        """Raise what a failed request means for its stream: an engine error as it is (the
        upstream's own text logged), an upstream client's mapped (`_failed`); return for
        our own abort (the stream ends quietly)."""
        if isinstance(exc, EngineError):
            if exc.upstream_said is not None:
                self._said(exc, request)
            raise exc
        error = self._failed(exc, request.request_id)
        if error is not None:
            raise error from exc

    def done(self, request_id: str, resp: UpstreamResponse | None) -> None:
        """The request is over: its response closed (before its end, the connection too)."""
        inflight = self._inflight.pop(request_id, None)
        if resp is None:
            resp = inflight  # `send` failed after the head came: an error answer's
        if resp is not None:
            resp.close()
        self._aborted.discard(request_id)

    def _said(self, error: EngineError, request: GenerationRequest) -> None:
        """An upstream's own error text goes to the log, with the stream's trace id; with
        --upstream-errors redact the client reads only the status (`generic`)."""
        log_event(
            f"{self.log_name}.upstream_error",
            logging.WARNING,
            stream=request.request_id,
            trace_id=request.trace_id,
            upstream=self.base,
            status=error.status,
            code=error.code,
            said=error.upstream_said,
        )
        if self.redact:
            error.message = generic(error.status)
            error.args = (error.message,)
            if not error.code.startswith("upstream_"):  # the upstream's own code string
                error.code = "upstream_error"

    def _failed(self, exc: UpstreamError, request_id: str) -> EngineError | None:
        """What a failed upstream request means for its stream: None for our own abort (the
        stream ends quietly); a refused or slow connect is `connect` to the routes (503)."""
        if request_id in self._aborted:
            return None
        kind = type(exc).__name__
        if isinstance(exc, ConnectError | ConnectTimeout):
            return EngineError(
                "upstream_timeout" if isinstance(exc, ConnectTimeout) else "upstream_unavailable",
                f"could not connect to the upstream ({kind})",
                retryable=True,
                status=503,
            )
        if isinstance(exc, ReadTimeout):
            return EngineError(
                "upstream_timeout", "the upstream sent nothing for too long", retryable=True
            )
        return EngineError(
            "upstream_truncated",
            f"the upstream connection broke mid-stream ({kind})",
            retryable=True,
        )

    async def abort(self, request_id: str) -> None:
        # The consumer's cancellation already closed the upstream response when it was
        # reading; this covers a generator left suspended at a yield.
        resp = self._inflight.pop(request_id, None)
        if resp is not None:
            self._aborted.add(request_id)
            resp.close()
