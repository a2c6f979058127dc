"""The outer ASGI layer: a bug in a handler is still an error in the API's shape."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import Request
from starlette.routing import Mount

from firsttoken.api.routes import ROUTES
from firsttoken.app import HotRouteApp, create_app
from firsttoken.config import Settings


def test_a_crashing_hot_route_answers_500_in_the_error_shape() -> None:
    app = HotRouteApp(create_app(Settings()))

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


def test_the_hot_routes_are_found_by_method_and_path() -> None:
    app = HotRouteApp(create_app(Settings()))
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        route = app.route("POST", path)
        assert route is not None and route[1] is None
    events = app.route("GET", "/v1/streams/abc/events")
    assert events is not None and events[1] == {"stream_id": "abc"}
    # Everything else goes through Starlette's router (its 404s and 405s included).
    for method, path in [
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/streams/abc/events"),
        ("GET", "/v1/streams//events"),
        ("GET", "/v1/streams/abc/events/more"),
        ("GET", "/v1/models"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/"),
    ]:
        assert app.route(method, path) is None, (method, path)


def _get(app: Any, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "headers": headers,
        "query_string": b"",
        "app": app,
    }
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_metrics_need_the_admin_key_only_when_told(monkeypatch: Any) -> None:
    monkeypatch.setenv("FT_TEST_ADMIN", "adm")
    open_app = create_app(Settings(admin_key_env="FT_TEST_ADMIN"))
    assert _get(open_app, "/metrics", [])[0] == 200
    closed = create_app(Settings(admin_key_env="FT_TEST_ADMIN", metrics_need_admin=True))
    status, body = _get(closed, "/metrics", [])
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    status, body = _get(closed, "/metrics", [(b"authorization", b"Bearer adm")])
    assert status == 200 and b"firsttoken_" in body


def test_the_route_table_builds_both_the_asgi_routes_and_the_direct_dispatch() -> None:
    """One table (`api/routes.py`): every route is a Starlette route under /v1, and the hot
    ones are served straight from the connection, with their path parameters."""
    starlette = create_app(Settings())
    (v1,) = [r for r in starlette.routes if isinstance(r, Mount) and r.path == "/v1"]
    # The API's table, then the admin feed of the operator page (firsttoken/ops/).
    assert [(r.path, sorted(r.methods or ())) for r in v1.routes] == [  # type: ignore[attr-defined]
        (r.path, sorted({r.method} | ({"HEAD"} if r.method == "GET" else set()))) for r in ROUTES
    ] + [("/admin/events", ["GET", "HEAD"])]
    app = HotRouteApp(starlette)
    for route in ROUTES:
        path = "/v1" + re.sub(r"\{[a-z_]+\}", "abc", route.path.replace("{model_id:path}", "m"))
        found = app.route(route.method, path)
        assert (found is not None) == route.hot, route.path
        if found is not None:
            assert found[0] is route.endpoint
            name = re.search(r"\{([a-z_]+)\}", route.path)
            assert found[1] == ({name[1]: "abc"} if name else None)
    assert app.route("GET", "/v1/responses/abc")  # the SDK's retrieve, streamed or not
    assert app.route("GET", "/v1/responses/abc/input_items") is None  # not a hot one
    assert app.route("GET", "/v1/streams//events") is None
    assert app.route("GET", "/v1/streams/a/b/events") is None
    assert app.route("POST", "/v1/streams/abc/events") is None
