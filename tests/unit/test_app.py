"""The outer ASGI layer: a bug in a handler is still an error in the API's shape."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.routing import Mount

from firsttoken.api.routes import ROUTES
from firsttoken.app import HotPathSkips, HotRouteApp, asgi_app, create_app
from firsttoken.config import Settings


def _serve_hot(app: HotRouteApp, endpoint: Any) -> tuple[int, dict[str, Any]]:
    """Serve one hot-route request with `endpoint`: its status and JSON error."""
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
    asyncio.run(app._serve(endpoint, scope, receive, send))
    start, body = sent[0], sent[1]
    return start["status"], json.loads(body["body"])["error"]


def test_a_crashing_hot_route_answers_500_in_the_error_shape() -> None:
    async def crash(request: Request) -> Any:
        raise RuntimeError("a bug")

    status, error = _serve_hot(HotRouteApp(create_app(Settings())), crash)
    assert status == 500
    assert (error["code"], error["message"]) == ("internal_error", "internal error")
    assert set(error) == {"code", "message", "type", "param"}


def test_a_hot_route_answers_an_error_with_the_apps_own_handler() -> None:
    """The hot routes used to copy two of the app's handlers: anything else was a 500."""

    async def refuse(request: Request) -> Any:
        raise HTTPException(405)

    status, error = _serve_hot(HotRouteApp(create_app(Settings())), refuse)
    assert status == 405 and error["code"] == "method_not_allowed"


def test_a_middleware_the_hot_routes_would_skip_is_refused_at_start() -> None:
    """It used to wrap every route but the streaming ones, silently."""
    added = create_app(Settings())
    added.add_middleware(TrustedHostMiddleware, allowed_hosts=["example.com"])
    with pytest.raises(HotPathSkips, match="TrustedHostMiddleware"):
        asgi_app(added)

    late = create_app(Settings())
    outer = asgi_app(late)  # the app's own GZip entry goes through
    late.add_middleware(TrustedHostMiddleware, allowed_hosts=["example.com"])

    async def nothing() -> dict[str, Any]:
        raise AssertionError("not reached")

    async def lifespan() -> None:
        await outer({"type": "lifespan"}, nothing, nothing)

    with pytest.raises(HotPathSkips):
        asyncio.run(lifespan())


def test_the_hot_routes_gzip_as_the_apps_middleware_says() -> None:
    """Its setting is read from the app's middleware entry; without one, no gzip."""
    assert HotRouteApp(create_app(Settings(compression_min_bytes=1234))).gzip_min == 1234
    assert HotRouteApp(Starlette()).gzip_min is None


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
