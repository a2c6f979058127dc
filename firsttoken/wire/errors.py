"""An error answered before the first byte: an HTTP status and the OpenAI error shape.

Beside the corridor: admission decides refusals, the API layer validates bodies; both raise it.
"""

from __future__ import annotations

import logging

import orjson
from starlette.responses import Response

from firsttoken.observability import log_event

__all__ = ["APIError", "error_body"]

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
    code: str, message: str, type_: str = "server_error", param: str | None = None
) -> bytes:
    """The error object, before the first byte (HTTP body) and after it (`event: error`)."""
    return orjson.dumps(
        {"error": {"code": code, "message": message, "type": type_, "param": param}}
    )


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
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}

    def response(self, request_id: str | None = None) -> Response:
        """The HTTP answer, and its one log line: every refusal shows up in the logs."""
        log_event(
            "request.refused" if self.status < 500 else "request.failed",
            logging.INFO if self.status < 500 else logging.WARNING,
            status=self.status,
            code=self.code,
            message=self.message,
            trace_id=request_id,
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
