"""Reading the ledger: totals grouped by key, route, target or day, as JSON, CSV or a table.

The JSON form (`firsttoken usage --format json`, `GET /v1/usage`):

    {"currency": "USD", "by": "key", "since": 1764633600.0,
     "rows": [{"key": "alice", "currency": "USD", "requests": 3, "cost": "0.000123",
               "prompt_tokens": N, "completion_tokens": N, "reasoning_tokens": N,
               "cached_tokens": N, "cache_write_tokens": N}],
     "total": {"requests": 3, "cost": "0.000123", "prompt_tokens": N, ...},
     "totals": [{"currency": "USD", "requests": 3, "cost": "0.000123", ...}]}

Costs are decimal strings (exact); `--by target` counts each leg at its own target. Rows are
grouped by currency too: after the routes file's `currency` changed, a key has one row per
currency, never one sum of both. `total` is in `currency` (the gateway's now, or the newest
record's); `totals` has one entry per currency the rows hold.
"""

from __future__ import annotations

import csv
import io
import os
import re
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import anyio

from firsttoken.config import Parser, usage_db_problem, usage_error
from firsttoken.ledger.record import TOKEN_COLUMNS
from firsttoken.ledger.schema import GROUPS
from firsttoken.ledger.stores import SQLITE, LedgerStore, open_store, sqlite_path
from firsttoken.pricing import money_text

__all__ = ["main", "parse_since", "usage_report"]

_SPAN = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_COUNTS = ("requests", *TOKEN_COLUMNS)


# An offset's `+` in a URL's query arrives as a space unless written %2B: `…T10:00:00 02:00`.
_SPACED_OFFSET = re.compile(r"(\d\d:\d\d(?::\d\d(?:\.\d+)?)?) (\d\d:?\d\d)$")


def parse_since(value: str | None, now: float | None = None, name: str = "--since") -> float | None:
    """`24h`, `7d`, `30m`, `90s` (that long ago), a date `2026-12-01` or an ISO time (UTC
    unless it says otherwise), or `all`/None (no bound): Unix seconds; ValueError naming
    `name` (the flag, or the query parameter) if none."""
    if value is None or value == "all":
        return None
    value = _SPACED_OFFSET.sub(r"\1+\2", value.strip())
    now = time.time() if now is None else now
    span = _SPAN.match(value.strip())
    if span:
        return now - float(span.group(1)) * _UNIT_S[span.group(2)]
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(
            f"{name} {value!r}: give a span (24h, 7d, 30m), a date or an ISO time, or 'all'"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


async def usage_report(
    store: LedgerStore,
    by: str,
    since: float | None,
    currency: str = "USD",
    key: str | None = None,
) -> dict[str, Any]:
    """The ledger's totals grouped by `by` and currency (`key`: that key's records alone)."""
    rows = await store.summary(by, since, key)
    out_rows: list[dict[str, Any]] = []
    totals: dict[str, dict[str, int]] = {}
    for group, *values in rows:
        counts = dict(zip(_COUNTS, (int(v) for v in values[:-2]), strict=True))
        cost, money = int(values[-2]), str(values[-1])
        out_rows.append({by: group, "currency": money, "cost": money_text(cost), **counts})
        total = totals.setdefault(money, dict.fromkeys((*_COUNTS, "cost"), 0))
        for name, n in (*counts.items(), ("cost", cost)):
            total[name] += n
    if by == "target":  # a request of two legs is one request, not two
        requests: dict[str, int] = {}
        for row in await store.summary("route", since, key):
            requests[str(row[-1])] = requests.get(str(row[-1]), 0) + int(row[1])
        for money, total in totals.items():
            total["requests"] = requests.get(money, 0)
    shown = {
        money: {"cost": money_text(t["cost"]), **{c: t[c] for c in _COUNTS}}
        for money, t in totals.items()
    }
    empty = {"cost": money_text(0), **dict.fromkeys(_COUNTS, 0)}
    return {
        "currency": currency,
        "by": by,
        "since": since,
        "rows": out_rows,
        "total": shown.get(currency, empty),
        "totals": [{"currency": money, **shown[money]} for money in sorted(shown)],
    }


def render(report: dict[str, Any], fmt: str) -> str:
    by = report["by"]
    columns = [by, "requests", "cost", *TOKEN_COLUMNS]
    if fmt == "json":
        import orjson

        return orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n"
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow([*columns, "currency"])
        for row in report["rows"]:
            writer.writerow([*(row[c] for c in columns), row["currency"]])
        return buffer.getvalue()
    totals = report.get("totals") or [{"currency": report["currency"], **report["total"]}]
    mixed = len(totals) > 1 or any(r["currency"] != report["currency"] for r in report["rows"])
    if mixed:  # one cost column per currency would be wider; a column says which
        columns.insert(3, "currency")
        rows = [*report["rows"], *({by: "total", **t} for t in totals)]
        header = list(columns)
    else:
        rows = [*report["rows"], {by: "total", **report["total"]}]
        header = [c if c != "cost" else f"cost ({report['currency']})" for c in columns]
    shown = [[str(r[c]) for c in columns] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in shown)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    for r in shown:
        cells = [r[0].ljust(widths[0])] + [
            v.rjust(w) for v, w in zip(r[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    parser = Parser(
        prog="firsttoken usage", description="What the ledger holds: usage and cost, grouped."
    )
    parser.add_argument(
        "--usage-db",
        default=os.environ.get("FIRSTTOKEN_USAGE_DB"),
        help="sqlite:///PATH (relative to the working directory; sqlite:////PATH: absolute) "
        "or postgresql://... (default: FIRSTTOKEN_USAGE_DB, as serve reads it)",
    )
    parser.add_argument("--by", choices=GROUPS, default="key")
    parser.add_argument("--since", default="all", help="24h, 7d, a date, an ISO time or all")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    parser.add_argument(
        "--currency", default="USD", help="shown for an empty ledger (else the records' own)"
    )
    args = parser.parse_args(list(argv))
    url = args.usage_db
    if not url:
        usage_error(
            "firsttoken usage", "no ledger to read (--usage-db URL, or FIRSTTOKEN_USAGE_DB)"
        )
    problem = usage_db_problem(url)
    if problem is not None:
        print(f"firsttoken usage: --usage-db {open_store(url).shown}: {problem}", file=sys.stderr)
        return 2
    try:
        since = parse_since(args.since)
    except ValueError as exc:
        print(f"firsttoken usage: {exc}", file=sys.stderr)
        return 2
    if url.startswith(SQLITE) and not os.path.isfile(sqlite_path(url)):
        where = os.path.abspath(sqlite_path(url))
        print(
            f"firsttoken usage: --usage-db {url}: no such file {where} (sqlite:///ledger.db is "
            "relative to the working directory, sqlite:////var/lib/firsttoken/ledger.db is "
            "absolute)",
            file=sys.stderr,
        )
        return 1

    async def read() -> dict[str, Any]:
        store = open_store(url)
        try:
            await store.open()
            currency = await store.currency() or args.currency  # the records' own
            return await usage_report(store, args.by, since, currency)
        finally:
            await store.close()

    try:
        report = anyio.run(read)
    except Exception as exc:  # the database away or not a ledger: one line, no traceback
        said = " ".join(str(exc).split()) or type(exc).__name__  # one line
        print(f"firsttoken usage: {open_store(url).shown}: {said}", file=sys.stderr)
        return 1
    sys.stdout.write(render(report, args.format))
    return 0
