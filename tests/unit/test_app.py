"""The outer ASGI layer: a bug in a handler is still an error in the API's shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from firsttoken.app import RawSendApp, create_app
from firsttoken.config import Settings


def test_a_crashing_hot_route_answers_500_in_the_error_shape() -> None:
    app = RawSendApp(create_app(Settings()))

    async def crash(request: Request) -> Any:
        raise RuntimeError("a bug")

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"x-request-id", b"trace-1")],
        "query_string": b"",
    }
    asyncio.run(app._serve(crash, scope, receive, send))
    start, body = sent[0], sent[1]
    assert start["status"] == 500
    error = json.loads(body["body"])["error"]
    assert (error["code"], error["message"]) == ("internal_error", "internal error")
    assert set(error) == {"code", "message", "type", "param"}
