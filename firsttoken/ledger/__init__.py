"""The usage ledger: one record per request (its legs, tokens by kind, cost), written off the
hot path in batches to SQLite, PostgreSQL or memory, and read back by `firsttoken usage` and
`GET /v1/usage`."""

from firsttoken.ledger.book import Ledger
from firsttoken.ledger.record import UsageRecord
from firsttoken.ledger.report import parse_since, usage_report

__all__ = ["Ledger", "UsageRecord", "parse_since", "usage_report"]
