"""Errors before the first byte: an HTTP status and the OpenAI error shape."""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

__all__ = ["APIError", "error_body", "read_model"]

M = TypeVar("M", bound=BaseModel)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def error_body(
    code: str, message: str, type_: str = "server_error", param: str | None = None
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "code": code, "param": param}}
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
        headers = dict(self.headers)
        if request_id:
            headers["x-request-id"] = request_id
        body = error_body(
            self.code, self.message, _TYPES.get(self.status, "server_error"), self.param
        )
        return Response(
            body, status_code=self.status, media_type="application/json", headers=headers
        )


async def read_model(request: Request, model: type[M], max_bytes: int) -> M:
    """Read, size-check, parse and validate a JSON body; every failure is a clear 4xx."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, "request_too_large", f"request body is over {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, "request_too_large", f"request body is over {max_bytes} bytes")
        chunks.append(chunk)
    try:
        raw = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise APIError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise APIError(400, "invalid_request", "request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        code = "missing_field" if first["type"] == "missing" else "invalid_value"
        raise APIError(400, code, message, param=param) from None
