"""What every handler needs: settings, the engine, the stream registry, the metrics."""

from __future__ import annotations

import re
import secrets
import uuid
from dataclasses import dataclass

from starlette.requests import Request

from firsttoken.api.errors import APIError
from firsttoken.config import Settings
from firsttoken.engines import Engine
from firsttoken.observability import Metrics
from firsttoken.stream import StreamRegistry

__all__ = ["Gateway", "gateway", "new_stream_id", "trace_id"]

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


@dataclass(slots=True)
class Gateway:
    settings: Settings
    engine: Engine
    registry: StreamRegistry
    metrics: Metrics

    def model(self, requested: str | None) -> str:
        if requested is None:
            return self.engine.models[0]
        if requested not in self.engine.models:
            raise APIError(
                404, "model_not_found", f"the model {requested!r} does not exist", param="model"
            )
        return requested


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def trace_id(request: Request) -> str:
    """Honour the caller's X-Request-Id or W3C traceparent; otherwise make one."""
    given = request.headers.get("x-request-id")
    if given and _REQUEST_ID.match(given):
        return given
    parent = _TRACEPARENT.match(request.headers.get("traceparent", ""))
    if parent:
        return parent.group(1)
    return uuid.uuid4().hex


def new_stream_id() -> str:
    # 128 random bits: stream ids cannot be guessed or enumerated.
    return secrets.token_hex(16)
