"""`GET /v1/usage` (admin): the ledger's totals, as `firsttoken usage --format json` prints.

Query parameters as the command's options: `by` (key, route, target, day; default key) and
`since` (24h, 7d, a date, an ISO time, or all; default all).
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from firsttoken.api.gateway import gateway
from firsttoken.ledger import parse_since, usage_report
from firsttoken.ledger.schema import GROUPS
from firsttoken.wire.errors import APIError

__all__ = ["usage"]


async def usage(request: Request) -> Response:
    gw = gateway(request)
    gw.admin.check(request)
    by = request.query_params.get("by", "key")
    if by not in GROUPS:
        raise APIError(
            400, "invalid_request_error", f"by must be one of {', '.join(GROUPS)}", param="by"
        )
    try:
        since = parse_since(request.query_params.get("since"), name="since")
    except ValueError as exc:
        raise APIError(400, "invalid_request_error", str(exc), param="since") from None
    ledger = gw.admission.ledger
    try:
        report = await usage_report(ledger.store, by, since, ledger.currency)
    except Exception as exc:  # the database away: say so, the gateway goes on
        raise APIError(
            503,
            "usage_db_unavailable",
            "the usage database cannot be read: " + (" ".join(str(exc).split()) or repr(exc)),
            headers={"retry-after": "5"},
        ) from None
    return Response(orjson.dumps(report), media_type="application/json")
