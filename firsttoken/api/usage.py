"""`GET /v1/usage`: the ledger's totals, as `firsttoken usage --format json` prints.

With the admin key (--admin-key-env): every key's records. With an API key of the keys file:
that key's own records alone (never another key's), and its `budget` when it has one: the
amount, its period, what the period spent so far and what is left. Without a keys file,
only the admin key is answered (404 otherwise, as every admin path).

Query parameters as the command's options: `by` (key, route, target, day; default key; an
API key: key, route or day, as target names are the operator's) and `since` (24h, 7d, a
date, an ISO time, or all; default all).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from firsttoken.admission import ApiKey
from firsttoken.admission.spend import period_of
from firsttoken.api.gateway import Gateway, gateway
from firsttoken.formats.errors import APIError
from firsttoken.ledger import parse_since, usage_report
from firsttoken.ledger.schema import GROUPS
from firsttoken.pricing import money_text
from firsttoken.telemetry.metrics import key_label

__all__ = ["usage"]

_OWN_GROUPS = ("key", "route", "day")


async def usage(request: Request) -> Response:
    gw = gateway(request)
    key: ApiKey | None = None
    if not gw.admin.allows(request):
        if gw.admission.keys is None:
            gw.admin.check(request)  # 404: no key of its own to answer for
        key = gw.admission.authenticate(request)
    groups = GROUPS if key is None else _OWN_GROUPS
    by = request.query_params.get("by", "key")
    if by not in groups:
        raise APIError(
            400, "invalid_request_error", f"by must be one of {', '.join(groups)}", param="by"
        )
    try:
        since = parse_since(request.query_params.get("since"), name="since")
    except ValueError as exc:
        raise APIError(400, "invalid_request_error", str(exc), param="since") from None
    ledger = gw.admission.ledger
    name = None if key is None else key_label(key.name)
    try:
        report = await usage_report(ledger.store, by, since, ledger.currency, key=name)
        if key is not None:
            report["key"] = name
            if key.budget is not None:
                report["budget"] = await _budget(gw, key)
    except APIError:
        raise
    except Exception as exc:  # the database away: say so, the gateway goes on
        raise APIError(
            503,
            "usage_db_unavailable",
            "the usage database cannot be read: " + (" ".join(str(exc).split()) or repr(exc)),
            headers={"retry-after": "5"},
        ) from None
    return Response(orjson.dumps(report), media_type="application/json")


async def _budget(gw: Gateway, key: ApiKey) -> dict[str, Any]:
    """The key's budget as admission counts it now: held reservations included."""
    assert key.budget is not None
    admission = gw.admission
    spent = await admission.budget_spent(key.name, key.budget.per)
    period, _ = period_of(key.budget.per, admission.spend_clock())
    return {
        "amount": money_text(key.budget.amount),
        "per": key.budget.per,
        "period": period,
        "spent": money_text(spent),
        "left": money_text(max(0, key.budget.amount - spent)),
        "currency": admission.ledger.currency,
    }
