"""Reading request bodies: size limit, JSON, validation — each failure a clear 4xx."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from firsttoken.formats.errors import APIError, error_body
from firsttoken.wire.connection import body_arrived

__all__ = ["APIError", "error_body", "is_json_type", "read_json", "read_model", "validate"]

M = TypeVar("M", bound=BaseModel)


def is_json_type(content_type: str) -> bool:
    """application/json or any +json type, with any parameters (a charset).

    Only JSON, because the other types a form or fetch() may send across origins without a
    CORS preflight (text/plain, form encodings) would let any web page post to an open or
    loopback server; a missing type is refused for the same reason (fetch() of a Blob)."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def read_model(
    request: Request, model: type[M], max_bytes: int, timeout_s: float = 30.0
) -> M:
    """Read, size-check, type-check, parse and validate a JSON body; every failure is a
    clear 4xx (415 for a body that is not declared JSON)."""
    return validate(model, await read_json(request, max_bytes, timeout_s))


async def read_json(request: Request, max_bytes: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """Read, size-check, type-check and parse a JSON object body (`read_model`'s first half:
    a relay forwards this dict as the client sent it)."""
    headers = request.headers
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, "request_too_large", f"request body is over {max_bytes} bytes")
    has_body = (declared is not None and declared != "0") or "transfer-encoding" in headers
    if has_body and not is_json_type(headers.get("content-type", "")):
        raise APIError(
            415,
            "unsupported_media_type",
            "send the body as JSON, with Content-Type: application/json",
        )
    if body_arrived(request.scope):
        # The whole body is in (the usual case): one receive, and no deadline to arm.
        message = await request.receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        data: bytes = message.get("body", b"")
        if len(data) > max_bytes:
            raise APIError(413, "request_too_large", f"request body is over {max_bytes} bytes")
    else:
        data = await _read_slow_body(request, max_bytes, timeout_s)
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise APIError(400, "invalid_request", "request body must be a JSON object")
    return raw


def validate(model: type[M], raw: dict[str, Any]) -> M:
    """`raw` as a `model`, or the 400 that says what is wrong, and where."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        # Our own validators' words, without pydantic's "Value error, " in front.
        error = first.get("ctx", {}).get("error") if first["type"] == "value_error" else None
        said = str(error) if error is not None else first["msg"]
        message = f"{param}: {said}" if param else said
        code = "missing_field" if first["type"] == "missing" else "invalid_value"
        raise APIError(400, code, message, param=param) from None


async def _read_slow_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """A body still arriving: read it by its chunks, within `timeout_s`."""
    chunks: list[bytes] = []
    size = 0
    try:
        # A slow-loris body must not hold the handler. asyncio's timeout, not anyio's: this
        # runs once per request, and anyio's looks up task state in a weak dict on the way.
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise APIError(
                        413, "request_too_large", f"request body is over {max_bytes} bytes"
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, "request_timeout", f"request body took over {timeout_s:g} s") from None
    return b"".join(chunks)
