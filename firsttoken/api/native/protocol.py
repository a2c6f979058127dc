"""The native stream API's request model (`POST /v1/streams`)."""

from __future__ import annotations

from firsttoken.api.protocol import Coalesce, _Generation

__all__ = ["NativeStreamRequest"]


class NativeStreamRequest(_Generation):
    prompt: str
    coalesce: Coalesce = None
    meta: bool = True
    binary: bool = False  # `event: token` with base64 UTF-8 bytes instead of JSON text
