"""Reading the ledger: --since spans and dates, the JSON shape, the table and CSV."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import anyio
import orjson
import pytest

from firsttoken.ledger.report import main, parse_since, render, usage_report
from firsttoken.ledger.stores import MemoryLedgerStore, open_store
from tests.unit.test_stores import DAY, RECORDS, record


def test_since_takes_spans_dates_and_all() -> None:
    assert parse_since("24h", now=DAY) == DAY - 86400
    assert parse_since("30m", now=DAY) == DAY - 1800
    assert parse_since("7d", now=DAY) == DAY - 7 * 86400
    assert parse_since("2026-12-02") == DAY
    assert parse_since("2026-12-02T01:00:00+01:00") == DAY
    assert parse_since("all") is None
    with pytest.raises(ValueError, match="--since 'yesterday'"):
        parse_since("yesterday")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_json_shape_has_costs_as_exact_decimal_strings() -> None:
    store = MemoryLedgerStore()
    await store.write(RECORDS)
    report = await usage_report(store, "key", None, "USD")
    assert report["currency"] == "USD"
    assert report["rows"][0] == {
        "key": "alice",
        "currency": "USD",
        "cost": "1.000000000011",
        "requests": 2,
        "prompt_tokens": 14,
        "completion_tokens": 40,
        "reasoning_tokens": 0,
        "cached_tokens": 0,
        "cache_write_tokens": 0,
    }
    assert report["total"]["cost"] == "1.000000000016"
    assert report["total"]["requests"] == 3
    by_target = await usage_report(store, "target", None)
    assert by_target["total"]["requests"] == 3  # a two-leg request is one request
    assert orjson.loads(render(report, "json")) == report


@pytest.mark.anyio
async def test_table_and_csv_list_every_group() -> None:
    store = MemoryLedgerStore()
    await store.write(RECORDS)
    report = await usage_report(store, "target", None)
    table = render(report, "table")
    assert table.splitlines()[0].split()[:3] == ["target", "requests", "cost"]
    assert [line.split()[0] for line in table.splitlines()[1:]] == ["center", "edge", "total"]
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert [(r["target"], r["cost"], r["currency"]) for r in rows] == [
        ("center", "1.000000000009", "USD"),
        ("edge", "0.000000000007", "USD"),
    ]


@pytest.mark.anyio
async def test_a_currency_change_gives_a_row_and_a_total_per_currency() -> None:
    store = MemoryLedgerStore()
    euros = record("d", "alice", DAY + 30, ("center", 1, 1, 9), currency="EUR")
    await store.write([*RECORDS, euros])
    report = await usage_report(store, "key", None, "EUR")
    assert [(r["key"], r["currency"], r["cost"]) for r in report["rows"]] == [
        ("alice", "EUR", "0.000000000009"),
        ("alice", "USD", "1.000000000011"),
        ("bob", "USD", "0.000000000005"),
    ]
    assert report["total"]["cost"] == "0.000000000009" and report["total"]["requests"] == 1
    assert [(t["currency"], t["cost"], t["requests"]) for t in report["totals"]] == [
        ("EUR", "0.000000000009", 1),
        ("USD", "1.000000000016", 3),
    ]
    by_target = await usage_report(store, "target", None, "EUR")
    assert [(t["currency"], t["requests"]) for t in by_target["totals"]] == [("EUR", 1), ("USD", 3)]
    table = render(report, "table").splitlines()
    assert table[0].split()[:4] == ["key", "requests", "cost", "currency"]
    assert [line.split()[:4] for line in table[-2:]] == [
        ["total", "1", "0.000000000009", "EUR"],
        ["total", "3", "1.000000000016", "USD"],
    ]
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert [r["currency"] for r in rows] == ["EUR", "USD", "USD"]


def test_the_command_refuses_a_bad_url_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--usage-db", "mysql://x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be sqlite:///PATH" in err


def test_the_command_says_a_missing_file_is_missing(
    capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    assert main(["--usage-db", f"sqlite:///{tmp_path}/none.db"]) == 1
    assert "no such file" in capsys.readouterr().err


def test_a_database_that_is_away_is_one_line_without_the_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--usage-db", "postgresql://u:secret@127.0.0.1:1/x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "secret" not in err and "u:***@127.0.0.1:1" in err


def test_the_command_reads_the_ledger_serve_reads_from_its_variable(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FIRSTTOKEN_USAGE_DB", "sqlite:///var/ledger.db")  # relative: ./var
    assert main([]) == 1
    err = capsys.readouterr().err
    assert f"no such file {tmp_path / 'var/ledger.db'}" in err and "sqlite:////" in err
    (tmp_path / "var").mkdir()
    store = open_store("sqlite:///var/ledger.db")
    anyio.run(store.open)
    anyio.run(store.close)
    assert main(["--format", "json"]) == 0
    assert '"total"' in capsys.readouterr().out


def test_a_bad_flag_is_one_line_and_a_hint_not_the_whole_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--usage-db", "sqlite:///x.db", "--by", "week"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 2 and "usage: firsttoken" not in err
    assert "try 'firsttoken usage --help'" in err


def test_an_offset_whose_plus_a_query_turned_into_a_space_still_reads() -> None:
    # `?since=2026-12-01T10:00:00+02:00` unescaped: the `+` arrives as a space.
    spaced = parse_since("2026-12-01T10:00:00 02:00")
    assert spaced == parse_since("2026-12-01T10:00:00+02:00") == parse_since("2026-12-01T08:00Z")
    assert parse_since("2026-12-01 10:00") == parse_since("2026-12-01T10:00:00+00:00")
    with pytest.raises(ValueError, match=r"^since 'soon': give a span"):
        parse_since("soon", name="since")  # the query parameter, not the CLI's flag
