"""The ledger's tables, the same in SQLite and PostgreSQL, and the queries on them.

    usage_requests   one row per request: request_id (primary key), at (Unix seconds), day
                     (UTC date), key, route, currency, outcome, the tokens by kind
                     (prompt_tokens, completion_tokens, reasoning_tokens, cached_tokens,
                     cache_write_tokens), cost_picos, ttft_ms, duration_ms, trace_id
    usage_legs       one row per leg of a request: request_id, leg (0, 1, ...), target, at,
                     key, the leg's tokens by kind, cost_picos
    usage_schema     the schema's version (migrations run on start, in order, once)

Costs are integers of picos (10⁻¹² of the currency): sums are exact in both databases.
A record is written once: its request_id is the primary key and a retried batch skips what
is there already (a write the database committed just before the connection broke).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from firsttoken.ledger.record import TOKEN_COLUMNS, UsageRecord

__all__ = ["GROUPS", "MIGRATIONS", "insert_rows", "summary_sql"]

GROUPS = ("key", "route", "target", "day")

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE IF NOT EXISTS usage_requests (
            request_id TEXT PRIMARY KEY,
            at DOUBLE PRECISION NOT NULL,
            day TEXT NOT NULL,
            key TEXT NOT NULL,
            route TEXT NOT NULL,
            currency TEXT NOT NULL,
            outcome TEXT NOT NULL,
            prompt_tokens BIGINT NOT NULL,
            completion_tokens BIGINT NOT NULL,
            reasoning_tokens BIGINT NOT NULL,
            cached_tokens BIGINT NOT NULL,
            cache_write_tokens BIGINT NOT NULL,
            cost_picos BIGINT NOT NULL,
            ttft_ms DOUBLE PRECISION,
            duration_ms DOUBLE PRECISION NOT NULL,
            trace_id TEXT NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS usage_requests_at ON usage_requests (at)",
        "CREATE INDEX IF NOT EXISTS usage_requests_key_at ON usage_requests (key, at)",
        """CREATE TABLE IF NOT EXISTS usage_legs (
            request_id TEXT NOT NULL,
            leg INTEGER NOT NULL,
            target TEXT NOT NULL,
            at DOUBLE PRECISION NOT NULL,
            key TEXT NOT NULL,
            prompt_tokens BIGINT NOT NULL,
            completion_tokens BIGINT NOT NULL,
            reasoning_tokens BIGINT NOT NULL,
            cached_tokens BIGINT NOT NULL,
            cache_write_tokens BIGINT NOT NULL,
            cost_picos BIGINT NOT NULL,
            PRIMARY KEY (request_id, leg)
        )""",
        "CREATE INDEX IF NOT EXISTS usage_legs_at ON usage_legs (at)",
    ),
)

_REQUEST_COLUMNS = (
    "request_id",
    "at",
    "day",
    "key",
    "route",
    "currency",
    "outcome",
    *TOKEN_COLUMNS,
    "cost_picos",
    "ttft_ms",
    "duration_ms",
    "trace_id",
)
_LEG_COLUMNS = ("request_id", "leg", "target", "at", "key", *TOKEN_COLUMNS, "cost_picos")


def _insert(table: str, columns: Sequence[str], mark: str) -> str:
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) "
        f"VALUES ({', '.join(mark for _ in columns)}) ON CONFLICT DO NOTHING"
    )


def insert_rows(
    records: Sequence[UsageRecord], mark: str
) -> tuple[str, list[tuple[Any, ...]], str, list[tuple[Any, ...]]]:
    """The two INSERTs (with `mark` as the placeholder: "?" or "%s") and their rows."""
    requests: list[tuple[Any, ...]] = []
    legs: list[tuple[Any, ...]] = []
    for r in records:
        tokens = r.tokens()
        requests.append(
            (
                r.request_id,
                r.at,
                r.day,
                r.key,
                r.route,
                r.currency,
                r.outcome,
                *(tokens[c] for c in TOKEN_COLUMNS),
                r.cost,
                r.ttft_ms,
                r.duration_ms,
                r.trace_id,
            )
        )
        for i, leg in enumerate(r.legs):
            t = leg.tokens
            legs.append(
                (
                    r.request_id,
                    i,
                    leg.target,
                    r.at,
                    r.key,
                    t.prompt,
                    t.completion,
                    t.reasoning,
                    t.cached,
                    t.cache_write,
                    leg.cost,
                )
            )
    return (
        _insert("usage_requests", _REQUEST_COLUMNS, mark),
        requests,
        _insert("usage_legs", _LEG_COLUMNS, mark),
        legs,
    )


def summary_sql(
    by: str, since: float | None, mark: str, key: str | None = None
) -> tuple[str, tuple[Any, ...]]:
    """Rows grouped by `by` (one of GROUPS) and currency: the group, requests, tokens by kind,
    cost_picos, currency. Costs in two currencies (the routes file's `currency` changed) are
    never added up. `key`: that key's rows only."""
    if by not in GROUPS:
        raise ValueError(f"--by must be one of {', '.join(GROUPS)}")
    if by == "target":  # a leg's currency is its request's
        source = "usage_legs l JOIN usage_requests r ON r.request_id = l.request_id"
        count, group, currency = "COUNT(DISTINCT l.request_id)", "l.target", "r.currency"
        column = "l."
    else:
        source, count, group, currency, column = "usage_requests", "COUNT(*)", by, "currency", ""
    sums = ", ".join(f"SUM({column}{c})" for c in (*TOKEN_COLUMNS, "cost_picos"))
    where: list[str] = []
    args: list[Any] = []
    if since is not None:
        where.append(f"{column}at >= {mark}")
        args.append(since)
    if key is not None:
        where.append(f"{column}key = {mark}")
        args.append(key)
    filtered = f" WHERE {' AND '.join(where)}" if where else ""
    sql = (
        f"SELECT {group}, {count}, {sums}, {currency} FROM {source}{filtered} "
        f"GROUP BY {group}, {currency} ORDER BY {group}, {currency}"
    )
    return sql, tuple(args)


CURRENCY_SQL = "SELECT currency FROM usage_requests ORDER BY at DESC LIMIT 1"
# A budget counts what was spent in its amount's currency (the routes file's, now).
SPENT_SQL = (
    "SELECT COALESCE(SUM(cost_picos), 0) FROM usage_requests "
    "WHERE key = {m} AND at >= {m} AND currency = {m}"
)
