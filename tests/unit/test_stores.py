"""The ledger's stores, each the real thing: memory, SQLite (standard library) and PostgreSQL
(a real server, `tests/postgres_server.py`): the same records give the same totals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from firsttoken.ledger.record import UsageRecord
from firsttoken.ledger.stores import (
    LedgerStore,
    LedgerStoreError,
    MemoryLedgerStore,
    PostgresLedgerStore,
    SQLiteLedgerStore,
    open_store,
)
from firsttoken.pricing import LegCost, Usage
from tests.postgres_server import PostgresServer

DAY = 1796169600.0  # 2026-12-02 00:00 UTC


def record(
    rid: str, key: str, at: float, *legs: tuple[str, int, int, int], currency: str = "USD"
) -> UsageRecord:
    return UsageRecord(
        request_id=rid,
        at=at,
        key=key,
        route="chat",
        currency=currency,
        outcome="completed",
        ttft_ms=12.5,
        duration_ms=80.0,
        trace_id="t" + rid,
        legs=tuple(
            LegCost(target, Usage(prompt, completion, 0, 0, 0), cost)
            for target, prompt, completion, cost in legs
        ),
    )


RECORDS = [
    record("a", "alice", DAY + 10, ("edge", 10, 5, 7), ("center", 0, 15, 1_000_000_000_001)),
    record("b", "alice", DAY + 20, ("center", 4, 20, 3)),
    record("c", "bob", DAY - 100, ("center", 2, 2, 5)),  # the day before
]


@asynccontextmanager
async def _opened(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[LedgerStore]:
    if kind == "memory":
        s: LedgerStore = MemoryLedgerStore()
    elif kind == "sqlite":
        s = SQLiteLedgerStore(str(tmp_path / "usage.db"))
    else:
        pg: PostgresServer = request.getfixturevalue("postgres")
        s = PostgresLedgerStore(pg.new_database())
    await s.open()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LedgerStore]:
    async with _opened(request.param, request, tmp_path) as s:
        yield s


@pytest.fixture(params=["sqlite", "postgres"])
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[LedgerStore]:
    """A store that writes to a database (memory keeps what it is given: nothing retries)."""
    async with _opened(request.param, request, tmp_path) as s:
        yield s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_totals_by_key_add_every_leg_exactly(store: LedgerStore) -> None:
    await store.write(RECORDS)
    rows = await store.summary("key", None)
    assert rows == [
        ("alice", 2, 14, 40, 0, 0, 0, 1_000_000_000_011, "USD"),
        ("bob", 1, 2, 2, 0, 0, 0, 5, "USD"),
    ]


@pytest.mark.anyio
async def test_by_target_counts_each_leg_at_its_target(store: LedgerStore) -> None:
    await store.write(RECORDS)
    rows = await store.summary("target", DAY)
    assert rows == [
        ("center", 2, 4, 35, 0, 0, 0, 1_000_000_000_004, "USD"),
        ("edge", 1, 10, 5, 0, 0, 0, 7, "USD"),
    ]


@pytest.mark.anyio
async def test_by_day_and_since(store: LedgerStore) -> None:
    await store.write(RECORDS)
    days = await store.summary("day", None)
    assert [(r[0], r[1]) for r in days] == [("2026-12-01", 1), ("2026-12-02", 2)]
    assert [r[0] for r in await store.summary("route", DAY)] == ["chat"]
    assert await store.spent("alice", DAY, "USD") == 1_000_000_000_011
    assert await store.spent("bob", DAY, "USD") == 0


@pytest.mark.anyio
async def test_two_currencies_are_never_added_up(store: LedgerStore) -> None:
    # The routes file's currency went from USD to EUR: alice's spend is two rows, and her
    # EUR budget counts her EUR spend alone.
    euros = record("d", "alice", DAY + 30, ("center", 1, 1, 9), currency="EUR")
    await store.write([*RECORDS, euros])
    rows = await store.summary("key", None)
    assert [(r[0], r[-1], r[-2]) for r in rows] == [
        ("alice", "EUR", 9),
        ("alice", "USD", 1_000_000_000_011),
        ("bob", "USD", 5),
    ]
    assert [(r[0], r[-1]) for r in await store.summary("target", DAY)] == [
        ("center", "EUR"),
        ("center", "USD"),
        ("edge", "USD"),
    ]
    assert await store.spent("alice", DAY, "EUR") == 9
    assert await store.spent("alice", DAY, "USD") == 1_000_000_000_011
    mine = await store.summary("route", None, key="bob")  # one key's records alone
    assert [(r[0], r[1], r[-1]) for r in mine] == [("chat", 1, "USD")]


@pytest.mark.anyio
async def test_a_batch_written_twice_is_counted_once(database: LedgerStore) -> None:
    await database.write(RECORDS)
    await database.write(RECORDS)  # a retry after a commit whose answer was lost
    rows = await database.summary("key", None)
    assert sum(r[1] for r in rows) == 3


@pytest.mark.anyio
async def test_migrating_again_keeps_the_records(tmp_path: Path) -> None:
    path = str(tmp_path / "usage.db")
    first = SQLiteLedgerStore(path)
    await first.open()
    await first.write(RECORDS)
    await first.close()
    again = SQLiteLedgerStore(path)
    await again.open()
    assert len(await again.summary("key", None)) == 2
    await again.close()


@pytest.mark.anyio
async def test_postgres_away_fails_the_write_and_the_next_one_reconnects(
    postgres: PostgresServer,
) -> None:
    store = PostgresLedgerStore(postgres.new_database())
    await store.open()
    postgres.stop()
    try:
        with pytest.raises(Exception):  # noqa: B017 (psycopg's OperationalError, any kind)
            await store.write(RECORDS[:1])
    finally:
        postgres.start()
    with anyio.fail_after(10):
        await store.write(RECORDS)
    assert len(await store.summary("key", None)) == 2
    await store.close()


@pytest.mark.anyio
async def test_a_read_after_postgres_restarted_makes_a_new_connection_at_once(
    postgres: PostgresServer,
) -> None:
    """The kept connection died with the restart, unseen: the next read is answered on a new
    one, not failed (a usage report right after an outage got 503)."""
    store = PostgresLedgerStore(postgres.new_database())
    await store.open()
    await store.write(RECORDS)
    postgres.stop()
    postgres.start()
    with anyio.fail_after(10):
        assert len(await store.summary("key", None)) == 2
    await store.close()


@pytest.mark.anyio
async def test_a_report_read_while_a_batch_is_written_waits_its_turn(database: LedgerStore) -> None:
    """The writer and a report share the database's one connection (PostgreSQL): their
    transactions go one after the other, never one inside the other."""
    for _ in range(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(database.write, RECORDS)
            tg.start_soon(database.summary, "key", None)
    assert sum(r[1] for r in await database.summary("key", None)) == 3


@pytest.mark.anyio
async def test_the_records_say_their_currency(store: LedgerStore) -> None:
    assert await store.currency() is None
    await store.write(RECORDS)
    assert await store.currency() == "USD"


@pytest.mark.anyio
async def test_memory_keeps_only_the_newest_records() -> None:
    store = MemoryLedgerStore(limit=2)
    await store.write(RECORDS)
    assert [r.request_id for r in store.records] == ["b", "c"]
    assert (
        MemoryLedgerStore().records.maxlen == 10_000
    )  # a server without --usage-db runs for months


def test_a_password_is_never_shown_in_the_user_part_or_the_query() -> None:
    assert open_store("postgresql://u:pw@h/db").shown == "postgresql://u:***@h/db"
    shown = open_store("postgresql://u@h/db?sslmode=require&password=pw&x=1").shown
    assert shown == "postgresql://u@h/db?sslmode=require&password=***&x=1"


def test_a_sqlite_ledger_in_a_missing_directory_says_where_its_path_led(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store("sqlite:///var/lib/ledger.db")
    with pytest.raises(LedgerStoreError) as refused:
        anyio.run(store.open)
    assert str(refused.value).startswith(f"no directory {tmp_path / 'var/lib'} for ")
    assert "sqlite:////var/lib/firsttoken/ledger.db (four slashes) is absolute" in str(
        refused.value
    )
