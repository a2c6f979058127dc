"""`python -m bench.ledger` must not rot: each phase once, small.

Not a performance test: only what each phase reports holds together (the ledger, the clients'
usage and the spend counter agree; no stream fails and no record is lost while PostgreSQL is
away)."""

from __future__ import annotations

from bench.ledger import mixed, outage, overhead, takeover
from tests.postgres_server import PostgresServer


def test_the_mixed_load_is_priced_exactly_in_sqlite_and_postgresql(
    postgres: PostgresServer,
) -> None:
    for kind in ("sqlite", "postgres"):
        result = mixed(60, 10, kind, postgres)
        assert result["exact"] and result["counter_matches_ledger"], result
        assert result["records_missing"] == 0 and result["requests_priced_differently"] == 0
        assert result["told_usage"] > 40


def test_the_overhead_phase_measures_both_sides() -> None:
    result = overhead(streams=20, rounds=1, tokens=20)
    assert set(result["tokens_per_cpu_s"]) == {"memory", "sqlite"}
    assert all(r[0]["tokens"] >= 20 * 20 for r in result["rounds"].values())


def test_an_outage_loses_nothing(postgres: PostgresServer) -> None:
    result = outage(postgres, outage_s=2, concurrency=5)
    assert result["streams_failed"] == 0 and result["records_lost"] == 0, result
    assert result["records"] == result["requests"] > 0


def test_a_takeover_bills_every_token_its_clients_were_told() -> None:
    result = takeover(streams=12)
    assert result["exact"] and result["unbilled_tokens"] == 0, result
    assert result["overbilled_tokens"] == 0 and result["taken_over"] > 0
