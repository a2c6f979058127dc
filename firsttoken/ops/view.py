"""`GET /ops` (the operator's page) and `GET /v1/admin/events` (its feed), both behind the
admin key: 404 without it, like every admin endpoint."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from firsttoken.admission.keys import ApiKey
from firsttoken.api.gateway import Gateway, gateway
from firsttoken.formats.errors import APIError
from firsttoken.ops.feed import OpsFeed
from firsttoken.ops.gauges import LimitGauges
from firsttoken.ops.snapshot import Family
from firsttoken.ops.tap import LogTap, read_errors
from firsttoken.routing import routes_in
from firsttoken.telemetry.log import tap_log_events

__all__ = ["STATIC_DIR", "OpsView"]

STATIC_DIR = Path(__file__).parent / "static"
ASSETS = {
    "ops.js": "text/javascript; charset=utf-8",
    "ops.css": "text/css; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
}
EVENT_STREAM_HEADERS = {
    "cache-control": "no-cache, no-transform",
    "x-accel-buffering": "no",
}


class OpsView:
    """The page, its feed and the collectors they read, wired to one gateway."""

    def __init__(self, gw: Gateway, page_headers: Mapping[str, str]) -> None:
        self.gateway = gw
        self.page_headers = dict(page_headers)
        share = gw.metrics.share
        self.share = share
        self.tap = LogTap(time.time, (share.directory, share.name) if share else None)
        gauges = LimitGauges(self._targets, self._keys, gw.settings.max_streams_per_key)
        for collector in (self.tap, gauges):
            gw.metrics.registry.register(collector)
        shedder = gw.admission.shedder
        self.feed = OpsFeed(
            self._collect,
            self._errors,
            time.time,
            draining=lambda: shedder.draining,
            ledger=bool(gw.settings.usage_db),
        )
        self.tap.listener = self.feed.heard
        tap_log_events(self.tap.heard)

    async def run(self) -> None:
        if not self.gateway.admin.configured:
            # Without the admin key the page and its feed answer 404 for the process's life:
            # nobody could read a snapshot, and a tick (the whole registry collected, ~20 ms
            # every 5 s) was ~10 µs of every new stream's CPU at a burst's rate.
            return
        await self.feed.run()

    def page_routes(self) -> list[BaseRoute]:
        return [
            Route("/ops", self.page, methods=["GET"]),
            Route("/ops/{name}", self.asset, methods=["GET"]),
        ]

    def api_routes(self) -> list[BaseRoute]:
        """Under the /v1 mount."""
        return [Route("/admin/events", self.events, methods=["GET"])]

    # -- handlers --------------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        gateway(request).admin.check(request)
        return FileResponse(STATIC_DIR / "ops.html", headers=self.page_headers)

    async def asset(self, request: Request) -> Response:
        gateway(request).admin.check(request)
        name = request.path_params["name"]
        if name not in ASSETS:
            raise APIError(404, "not_found", "Not Found")
        return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers=self.page_headers)

    async def events(self, request: Request) -> Response:
        gateway(request).admin.check(request)
        subscriber = self.feed.subscribe()

        async def body() -> AsyncIterator[bytes]:
            try:
                async for data in subscriber.frames_due():
                    yield data
            finally:
                self.feed.unsubscribe(subscriber)

        return StreamingResponse(
            body(), media_type="text/event-stream", headers=EVENT_STREAM_HEADERS
        )

    # -- what the feed reads ---------------------------------------------------------------

    def _targets(self) -> Iterable[object]:
        routed = routes_in(self.gateway.engine)  # the live routes: a reload swaps their targets
        return list(routed.targets.values()) if routed is not None else []

    def _keys(self) -> list[ApiKey]:
        ring = self.gateway.admission.keys
        return [k for n in ring.names() if (k := ring.named(n))] if ring is not None else []

    async def _collect(self) -> list[Family]:
        if self.share is not None:  # every worker's, asked over their sockets: not on the loop
            return await anyio.to_thread.run_sync(self.share.merged)
        return [
            [f.name, f.type, f.documentation, [[s.name, s.labels, s.value] for s in f.samples]]
            for f in self.gateway.metrics.registry.collect()
        ]

    async def _errors(self) -> list[dict[str, Any]]:
        own = self.tap.recent_errors()
        if self.share is None:
            return own
        others = await anyio.to_thread.run_sync(read_errors, self.share.directory)
        merged = [e for e in others if e.get("pid") != os.getpid()] + own
        merged.sort(key=lambda e: e.get("ts", 0))
        return merged
