"""An error answered before the first byte: an HTTP status and the OpenAI error shape.

Beside the corridor: admission decides refusals, the API layer validates bodies; both raise it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import orjson
from starlette.responses import Response

from firsttoken.telemetry.log import log_event

__all__ = ["APIError", "RefusalLog", "echo", "error_body"]

ECHO_CHARS = 200  # of a client's value, quoted back in a message
MESSAGE_CHARS = 2000  # of any message: a backstop for a value quoted without `echo`

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "server_error",
}


def error_body(
    code: str,
    message: str,
    type_: str = "server_error",
    param: str | None = None,
    request_id: str | None = None,
) -> bytes:
    """The error object, before the first byte (HTTP body) and after it (`event: error`).
    Every format's error body takes these arguments (`formats.anthropic.error_body`); OpenAI's
    shape carries the request's id in its `x-request-id` header only."""
    return orjson.dumps(
        {"error": {"code": code, "message": message, "type": type_, "param": param}}
    )


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """A client's value quoted for a message (repr), cut to `limit` characters with "…": a
    model name of a million characters is not repeated back, nor logged, whole."""
    if isinstance(value, str) and len(value) > limit:
        value = value[:limit]  # repr of the cut, not a cut of a million-character repr
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


class RefusalLog:
    """A token bucket for the log lines of refusals: `rate` a second, bursts of `burst`.

    A refusal costs no admission: it is answered before any slot or rate token is taken, so a
    client can be refused thousands of times a second. Charging those to the server's rate
    bucket would let one bad client refuse everyone else; the cost that grows is the log
    (100 MB from 20 requests before `echo`). Past the bucket a refusal is still answered and
    counted; the next line logged says how many were not (`unlogged`).
    """

    def __init__(
        self, rate: float = 10.0, burst: int = 100, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self.unlogged = 0

    def take(self) -> int | None:
        """None: do not log this one. Otherwise log it, with the count of those unlogged
        since the last line."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens < 1:
            self.unlogged += 1
            return None
        self._tokens -= 1
        unlogged, self.unlogged = self.unlogged, 0
        return unlogged


_refusals = RefusalLog()


class APIError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if len(message) > MESSAGE_CHARS:
            message = message[:MESSAGE_CHARS] + "…"
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}

    def response(self, request_id: str | None = None) -> Response:
        """The HTTP answer, and its one log line (at most `RefusalLog`'s rate)."""
        unlogged = _refusals.take()
        if unlogged is not None:
            log_event(
                "request.refused" if self.status < 500 else "request.failed",
                logging.INFO if self.status < 500 else logging.WARNING,
                status=self.status,
                code=self.code,
                message=self.message,
                trace_id=request_id,
                **({"unlogged": unlogged} if unlogged else {}),
            )
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        body = error_body(
            self.code, self.message, _TYPES.get(self.status, "server_error"), self.param
        )
        return Response(
            body, status_code=self.status, media_type="application/json", headers=headers
        )
