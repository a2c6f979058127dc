"""The ASGI application: routes, lifespan, and the pieces wired together."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route, Router
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from firsttoken.admission import Admission
from firsttoken.admission.admin import AdminKey
from firsttoken.api.gateway import Gateway, gateway, trace_id
from firsttoken.api.routes import ROUTES, ApiRoute, Endpoint, not_served
from firsttoken.config import Settings
from firsttoken.core.pacing import Pacer
from firsttoken.core.registry import StreamRegistry
from firsttoken.engines import Engine
from firsttoken.formats.errors import APIError
from firsttoken.ops import OpsView
from firsttoken.reload import ConfigFiles, Reloader
from firsttoken.requestlimits import oversized
from firsttoken.resume import open_store
from firsttoken.resume.budget import ResumeBudget
from firsttoken.routing import RoutedEngine, build_engine, routes_in
from firsttoken.routing.live import LiveRoutes
from firsttoken.telemetry.log import log_event
from firsttoken.telemetry.metrics import Metrics
from firsttoken.telemetry.runtime import RuntimeCollector
from firsttoken.wire.compression import GZipResponses
from firsttoken.wire.connection import CONNECTION_KEY, RAW_SEND_KEY

if TYPE_CHECKING:
    from firsttoken.telemetry.otel import Telemetry

__all__ = [
    "HotPathSkips",
    "HotRouteApp",
    "asgi_app",
    "create_app",
    "direct_routes",
    "hot_path_gzip",
]

WEB_DIR = Path(__file__).parent / "web"


def create_app(settings: Settings | None = None, engine: Engine | None = None) -> Starlette:
    settings = settings or Settings()
    engine = engine or build_engine(settings)
    metrics = Metrics(
        tokens_generated=lambda: engine.tokens_generated,
        engine_counter=lambda name: engine.counters().get(name, 0),
    )
    registry = _registry(settings, engine, metrics)
    admission = Admission(settings, metrics)
    per_key = admission.keys.resume_limits() if admission.keys is not None else {}
    registry.budget = ResumeBudget(settings.resume_max_bytes, per_key)
    if settings.max_stream_bytes_per_s > 0:
        registry.pacer = Pacer(settings.max_stream_bytes_per_s)
    # Scrape-time gauges: Redis (up, replication backlog, fallbacks), tasks and descriptors.
    routed = routes_in(engine)  # the routes' metrics, under a cache too
    telemetry = _telemetry(settings, registry, routed)
    _price(admission, routed)
    store = registry.store
    parts = (store, admission.limits, RuntimeCollector(), registry.pacer, registry.budget, routed)
    budgets = admission if admission.keys is not None else None  # firsttoken_key_budget_*
    for part in (*parts, telemetry, admission.ledger, budgets):
        if part is not None:
            # prometheus_client types a collector as its ABC; ours have its shape only.
            metrics.registry.register(part)  # type: ignore[arg-type]
    gw = _gateway(settings, engine, registry, metrics, admission)
    # SIGHUP (server.py) and --watch-config reload the files; the metrics count the reloads.
    files = ConfigFiles(
        settings.api_keys, settings.routes, settings.canned_answers, settings.admin_key_file
    )
    reloader = Reloader(files, gw, watch=settings.watch_config)
    metrics.registry.register(reloader)
    ops = OpsView(gw, PAGE_HEADERS)  # GET /ops and its feed, /v1/admin/events (docs/ops.md)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        async with anyio.create_task_group() as tg:
            await tg.start(registry.run)
            tg.start_soon(admission.run, registry)
            tg.start_soon(reloader.run)
            tg.start_soon(ops.run)
            yield
            tg.cancel_scope.cancel()
        await engine.close()
        if telemetry is not None:
            await telemetry.close()  # after the drain ended every stream: their spans go too

    app = Starlette(
        routes=_routes(ops),
        lifespan=lifespan,
        # For JSON and /metrics only: GZip leaves text/event-stream alone (a test holds it to
        # it). The hot routes get what this list says too (`HotRouteApp`, which refuses a
        # middleware it would not apply).
        middleware=[Middleware(GZipResponses, minimum_size=settings.compression_min_bytes)],
        # Starlette calls each handler with its own class of exception only, but types every
        # handler as taking any Exception. The hot routes answer from this table too.
        exception_handlers={
            HTTPException: _http_error,  # type: ignore[dict-item]
            APIError: _api_error,  # type: ignore[dict-item]  # e.g. 503 store_unavailable
            Exception: _crashed,  # a bug: a 500 in the error shape, not Starlette's text
        },
    )
    app.state.gateway = gw
    app.state.reloader = reloader
    return app


def _registry(settings: Settings, engine: Engine, metrics: Metrics) -> StreamRegistry:
    """The streams, over the store their events are kept in (memory, or Redis)."""
    store = open_store(
        settings.redis,
        max_events=settings.resume_max_events,
        max_connections=settings.redis_max_connections,
        cluster=settings.redis_cluster,
        flush_interval_s=settings.redis_flush_ms / 1000,
        durable=settings.durable,
    )
    registry = StreamRegistry(
        engine,
        metrics,
        ttl_s=settings.resume_ttl_s,
        store=store,
        max_events=settings.resume_max_events,
    )
    registry.max_response_bytes = settings.max_response_bytes
    return registry


def _gateway(
    settings: Settings,
    engine: Engine,
    registry: StreamRegistry,
    metrics: Metrics,
    admission: Admission,
) -> Gateway:
    gw = Gateway(
        settings=settings,
        engine=engine,
        registry=registry,
        metrics=metrics,
        admission=admission,
        admin=AdminKey.of(settings.admin_key_env, settings.admin_key_file),
    )
    registry.reopen = gw.takeover.reopen
    store = registry.store
    if store.replicates:  # a dead instance's streams nobody took over are billed by a survivor
        store.on_orphaned = gw.takeover.bill_orphaned
        store.orphan_grace_s = max(settings.resume_grace_s, settings.openai_grace_s)
        store.orphan_ttl_s = registry.ttl_s
    if admission.keys is not None:  # nothing to ask per stream without a keys file
        registry.revoked = admission.revoked
    return gw


def _routes(ops: OpsView) -> list[BaseRoute]:
    api = [
        *(Route(r.path, r.endpoint, methods=[r.method]) for r in ROUTES),
        *ops.api_routes(),
    ]
    return [
        # A mount of its own, so /v1 paths answer 404/405 in JSON, never from the web files;
        # no slash redirects: a 307 for `/v1/usage/` would tell a prober the admin path is there.
        Mount("/v1", app=Router(routes=api, redirect_slashes=False)),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/readyz", _readyz, methods=["GET"]),
        Route("/favicon.ico", _favicon, methods=["GET", "HEAD"]),
        *ops.page_routes(),
        Mount("/", WebFiles(directory=WEB_DIR, html=True, check_dir=False), name="web"),
    ]


def _price(admission: Admission, routed: RoutedEngine | LiveRoutes | None) -> None:
    """The routes file's prices for the ledger, and who answers each request."""
    if routed is None:
        return
    admission.ledger.price(routed.table, routed.routes)
    admission.serving = routed.serving
    unpriced = admission.ledger.unpriced(routed.table)
    if unpriced:
        log_event(
            "routes.unpriced",
            logging.WARNING,
            targets=unpriced,
            note="these targets have no price: their tokens cost 0",
        )


def _telemetry(
    settings: Settings, registry: StreamRegistry, routed: RoutedEngine | LiveRoutes | None
) -> Telemetry | None:
    """--otlp-endpoint: spans and GenAI metrics, fed by the registry and the routes."""
    if not settings.otlp_endpoint:
        return None
    from firsttoken.telemetry.otel import Telemetry  # the SDK is imported only when asked for

    telemetry = Telemetry(settings.otlp_endpoint)
    registry.tracer = telemetry
    if routed is not None:
        routed.observer = telemetry
    return telemetry


# The chat page loads its scripts, styles and streams from this server only, and renders
# model output as text (web/markdown.js): a policy of 'self' costs it nothing, and stops what
# an injected answer might load or where it might send data. No framing (clickjacking).
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}


async def _favicon(request: Request) -> Response:
    # Where browsers and tools look without a <link rel="icon">: the page's icon, not a 404.
    return FileResponse(WEB_DIR / "favicon.svg", media_type="image/svg+xml")


class WebFiles(StaticFiles):
    """The page's files, each with `PAGE_HEADERS`."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


# What a page on another origin may read of our answers (the resume handles among them).
EXPOSED_HEADERS = ("X-Stream-Id", "X-Resume-Token", "X-Request-Id", "Retry-After")


def asgi_app(starlette: Starlette) -> ASGIApp:
    """What the server runs: the hot-route layer, and CORS outside it when it is on.

    CORS acts on the preflight and on each response's start message only: the event-stream
    body is written past it, so it costs nothing per token."""
    app: ASGIApp = HotRouteApp(starlette)
    settings: Settings = starlette.state.gateway.settings
    if settings.cors_allow_origins:
        origins = [o.strip() for o in settings.cors_allow_origins.split(",") if o.strip()]
        app = CORSMiddleware(
            app,
            allow_origins=origins,
            allow_methods=("GET", "POST", "DELETE"),
            allow_headers=("*",),  # Authorization, Last-Event-ID, x-api-key...
            allow_credentials=False,
            expose_headers=EXPOSED_HEADERS,
        )
    return app


def direct_routes(app: ASGIApp) -> HotRouteApp | None:
    """What our protocol may serve past the ASGI layers: the hot routes, unless a layer
    must see them (CORS wraps the app when it is on)."""
    return app if isinstance(app, HotRouteApp) else None


class HotRouteApp:
    """The outermost ASGI layer.

    - It leaves the server's own `send` in the scope, so a streaming response can end its body
      past the middleware (see `connection.RAW_SEND_KEY`).
    - The streaming endpoints skip Starlette's router and middleware stack (`HOT_ROUTES`):
      those layers cost ~150 µs per request, as much as the stream's own set-up. They get the
      same handlers, and what the app's middleware and error table say: the gzip of whole
      answers as its `GZipResponses` entry sets it, the answer of its handler for an error.
      A middleware this layer does not apply is refused at start (`HotPathSkips`), so one
      added to the app cannot silently miss the hot routes.
    """

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.gzip_min = hot_path_gzip(app)

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        # A plain `def`: no frame of its own kept per open stream.
        if scope["type"] == "http":
            route = self.route(scope["method"], scope["path"])
            if route is not None:
                return self.serve(route, scope, receive, send)
            refusal = oversized(scope)
            if refusal is not None:
                return refusal.response()(scope, receive, send)
            scope[RAW_SEND_KEY] = send
            return self._other(scope, receive, send)
        if scope["type"] == "lifespan":
            hot_path_gzip(self.app)  # again: a middleware added since this layer was made
        return self.app(scope, receive, send)

    # `wire.cycle.DirectRoutes`: our protocol serves these without uvicorn's ASGI layers.

    def route(self, method: str, path: str) -> HotRoute | None:
        exact = _EXACT_ROUTES.get((method, path))
        if exact is not None:
            return exact
        for pattern in HOT_PATTERNS:
            if method == pattern.method:
                params = pattern.match(path)
                if params is not None:
                    return pattern.endpoint, params
        return None

    def serve(self, route: HotRoute, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        refusal = oversized(scope)
        if refusal is not None:
            return refusal.response()(scope, receive, send)
        endpoint, params = route
        if params is not None:
            scope["path_params"] = params
        scope[RAW_SEND_KEY] = send
        return self._serve(endpoint, scope, receive, send)

    async def _serve(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self.app
        request = Request(scope, receive)
        try:
            try:
                response = await endpoint(request)
            except Exception as exc:  # APIError (e.g. 503 store_unavailable), a bug: the
                # app's handler answers, in the error shape, before the first byte
                response = await _handler(self.app, exc)(request, exc)
            del request  # a waiting stream's frame need not keep it
            if self.gzip_min is not None:
                await GZipResponses(response, self.gzip_min)(scope, receive, send)
            else:
                await response(scope, receive, send)
        finally:
            _let_go(scope)

    async def _other(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            _let_go(scope)


class HotPathSkips(RuntimeError):
    """The app has a middleware the hot routes would not go through (`HotRouteApp`)."""


def hot_path_gzip(app: Starlette) -> int | None:
    """The `minimum_size` of the app's `GZipResponses` (None: no gzip), which the hot routes
    apply themselves. Any other middleware of the app is refused: the hot routes skip the
    app's middleware stack, so it would not see them. Wrap the outer app instead (as CORS
    is, `asgi_app`; the direct path then steps aside), or apply it in `HotRouteApp._serve`
    and let it through here."""
    gzip_min: int | None = None
    for middleware in app.user_middleware:
        if middleware.cls is GZipResponses:  # made as Starlette makes it, for its setting
            gzip = middleware.cls(app, *middleware.args, **middleware.kwargs)
            gzip_min = cast(GZipResponses, gzip).minimum_size
            continue
        name = getattr(middleware.cls, "__name__", repr(middleware.cls))
        raise HotPathSkips(
            f"middleware {name} would not see the hot routes (/v1/chat/completions, ...): "
            "wrap the app in asgi_app or apply it in HotRouteApp (firsttoken/app.py)"
        )
    return gzip_min


ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


def _handler(app: Starlette, exc: Exception) -> ErrorHandler:
    """The app's handler for `exc`, found as Starlette finds it (the nearest class in its
    MRO); the table ends with `Exception`."""
    handlers = app.exception_handlers
    for cls in type(exc).__mro__:
        handler = handlers.get(cls)
        if handler is not None:
            return handler  # type: ignore[return-value]  # ours are all async
    return _crashed


def _let_go(scope: Scope) -> None:
    """The request is answered: drop what its scope holds of the connection. Each is a
    cycle (the scope holds uvicorn's cycle's `send`, which holds the scope; the connection
    holds the scope, which holds the connection), and cycles are freed only by the
    collector's passes: ~18 objects a request, a 25 ms pause every ~1,000 streams."""
    scope.pop(RAW_SEND_KEY, None)
    scope.pop(CONNECTION_KEY, None)


HotRoute = tuple[Endpoint, dict[str, str] | None]  # the handler, and its path parameters


class HotPattern(NamedTuple):
    """A hot route with one path parameter: one segment between a fixed prefix and suffix."""

    method: str
    prefix: str
    name: str
    suffix: str
    endpoint: Endpoint

    def match(self, path: str) -> dict[str, str] | None:
        if not (path.startswith(self.prefix) and path.endswith(self.suffix)):
            return None
        value = path[len(self.prefix) : len(path) - len(self.suffix)]
        return {self.name: value} if value and "/" not in value else None


def _hot(routes: tuple[ApiRoute, ...]) -> tuple[dict[tuple[str, str], Endpoint], list[HotPattern]]:
    """The table's hot routes: exact paths in a dict, those with a parameter as patterns."""
    exact: dict[tuple[str, str], Endpoint] = {}
    patterns: list[HotPattern] = []
    for route in routes:
        if not route.hot:
            continue
        path = "/v1" + route.path
        if "{" not in path:
            exact[(route.method, path)] = route.endpoint
            continue
        prefix, _, rest = path.partition("{")
        name, _, suffix = rest.partition("}")
        if ":" in name or "{" in suffix:
            raise ValueError(f"a hot route takes one plain path parameter: {route.path}")
        patterns.append(HotPattern(route.method, prefix, name, suffix, route.endpoint))
    return exact, patterns


HOT_ROUTES, HOT_PATTERNS = _hot(ROUTES)
# `route`'s answers for the exact paths, built once: the connection keeps the one it got for
# the stream's life (a tuple per stream was 56 bytes of every waiting one).
_EXACT_ROUTES: dict[tuple[str, str], HotRoute] = {
    key: (endpoint, None) for key, endpoint in HOT_ROUTES.items()
}


async def _metrics(request: Request) -> Response:
    gw = gateway(request)
    if gw.settings.metrics_need_admin:
        gw.admin.check(request)
    return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _readyz(request: Request) -> Response:
    gw: Gateway = gateway(request)
    shedder = gw.admission.shedder
    if shedder.draining:
        return JSONResponse(
            {"status": "draining", "active_streams": gw.metrics.active_streams},
            status_code=503,
            headers={"retry-after": "5"},
        )
    if shedder.shedding:
        reasons = sorted(shedder.reasons) + ([] if shedder.breaker == "closed" else ["breaker"])
        return JSONResponse(
            {"status": "shedding", "reasons": reasons},
            status_code=503,
            headers={"retry-after": "5"},
        )
    # Degraded is still ready: local streams need nothing from Redis (docs/reliability.md).
    parts = (gw.registry.store, gw.admission.limits, gw.admission.ledger)
    degraded = sorted({d for part in parts if (d := part.degraded)})
    body: dict[str, object] = {"status": "degraded" if degraded else "ready"}
    if degraded:
        body["degraded"] = degraded
    body["active_streams"] = gw.metrics.active_streams
    return JSONResponse(body)


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response(trace_id(request))


async def _crashed(request: Request, exc: Exception) -> Response:
    trace = trace_id(request)
    log_event("request.crashed", logging.ERROR, trace_id=trace, error=repr(exc)[:500])
    return APIError(500, "internal_error", "internal error").response(trace)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = dict(exc.headers) if exc.headers is not None else None
    message = str(exc.detail)
    path = request.url.path
    if exc.status_code == 404 and path.startswith("/v1/"):
        # Why, not "Not Found" as if its object were missing (`api.routes.not_served`).
        message = not_served(request.method, path)
    return APIError(exc.status_code, code, message, headers=headers).response(trace_id(request))
