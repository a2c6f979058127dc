"""Limits on a request's head that the HTTP parser does not set: a clear 4xx, not a hang.

httptools takes any number of header bytes (uvicorn stops URLs only near 64 KiB, with a bare
400), so an oversized head is answered here, first thing, in the API's error shape.
"""

from __future__ import annotations

from starlette.types import Scope

from firsttoken.formats.errors import APIError

__all__ = ["MAX_HEADERS", "MAX_HEADER_BYTES", "MAX_URL_BYTES", "oversized"]

MAX_URL_BYTES = 16 * 1024  # path and query; a stream URL with its token is ~120 bytes
MAX_HEADER_BYTES = 64 * 1024  # names and values together (nginx: 4 x 8 KiB by default)
MAX_HEADERS = 200


def oversized(scope: Scope) -> APIError | None:
    """The refusal for a request head over its limits, or None."""
    url = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    if url > MAX_URL_BYTES:
        return APIError(414, "uri_too_long", f"the request URL is over {MAX_URL_BYTES} bytes")
    headers = scope.get("headers") or []
    size = sum(len(k) + len(v) for k, v in headers)
    if size > MAX_HEADER_BYTES or len(headers) > MAX_HEADERS:
        return APIError(
            431,
            "headers_too_large",
            f"request headers are over {MAX_HEADER_BYTES} bytes or {MAX_HEADERS} fields",
        )
    return None
