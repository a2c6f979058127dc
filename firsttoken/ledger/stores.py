"""Where the ledger is kept: SQLite (the standard library's, one instance), PostgreSQL
(psycopg 3, shared by many instances), or memory (no --usage-db: gone on restart).

Each store is written by one task (`writer.py`) and read by reports; SQLite's calls run in a
worker thread so a slow disk never holds the event loop.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import anyio

from firsttoken.ledger.record import TOKEN_COLUMNS, UsageRecord
from firsttoken.ledger.schema import (
    CURRENCY_SQL,
    GROUPS,
    MIGRATIONS,
    SPENT_SQL,
    insert_rows,
    summary_sql,
)

__all__ = [
    "LedgerStore",
    "LedgerStoreError",
    "MemoryLedgerStore",
    "PostgresLedgerStore",
    "SQLiteLedgerStore",
    "open_store",
    "record_fault",
    "sqlite_path",
]

SQLITE = "sqlite:///"
# SQLAlchemy's rule, which --usage-db follows: what comes after the third slash is the path.
_SQLITE_RULE = (
    "sqlite:///ledger.db is relative to the working directory, "
    "sqlite:////var/lib/firsttoken/ledger.db (four slashes) is absolute"
)


class LedgerStoreError(Exception):
    """The store cannot be used as given; `str()` is the line a person reads."""


# (group, requests, prompt, completion, reasoning, cached, cache_write, cost, currency)
Row = tuple[Any, ...]


class LedgerStore(Protocol):
    shown: str  # the URL without a password, for log lines

    async def open(self) -> None: ...

    async def write(self, records: Sequence[UsageRecord]) -> None: ...

    async def summary(self, by: str, since: float | None, key: str | None = None) -> list[Row]:
        """Totals grouped by `by` and currency (`key`: that key's alone)."""
        ...

    async def spent(self, key: str, since: float, currency: str) -> int:
        """What `key` spent in `currency` from `since`, in picos."""
        ...

    async def currency(self) -> str | None: ...

    async def close(self) -> None: ...


def record_fault(exc: BaseException) -> bool:
    """Whether a write failed for what a record holds (a number past BIGINT, a value the
    table refuses), not for the database: written again, it would fail again."""
    if isinstance(exc, OverflowError | sqlite3.DataError | sqlite3.IntegrityError):
        return True
    # psycopg's DataError and IntegrityError (not imported: the extra may be absent).
    return type(exc).__module__.startswith("psycopg") and any(
        c.__name__ in ("DataError", "IntegrityError") for c in type(exc).__mro__
    )


def sqlite_path(url: str) -> str:
    """The file a `sqlite:///PATH` URL names (relative to the working directory unless PATH
    starts with a slash: `sqlite:////abs/path.db`)."""
    return url[len(SQLITE) :]


def open_store(url: str | None) -> LedgerStore:
    if not url:
        return MemoryLedgerStore()
    if url.startswith(SQLITE):
        return SQLiteLedgerStore(sqlite_path(url))
    return PostgresLedgerStore(url)


class MemoryLedgerStore:
    """The newest `limit` records of this process's life: a server without `--usage-db` runs
    for months, and a record is ~0.5 KiB (a million would be ~0.5 GiB)."""

    shown = "memory"

    def __init__(self, limit: int = 10_000) -> None:
        self.records: deque[UsageRecord] = deque(maxlen=limit)

    async def open(self) -> None:
        return None

    async def write(self, records: Sequence[UsageRecord]) -> None:
        self.records.extend(records)

    async def summary(self, by: str, since: float | None, key: str | None = None) -> list[Row]:
        if by not in GROUPS:
            raise ValueError(f"--by must be one of {', '.join(GROUPS)}")
        groups: dict[tuple[str, str], list[Any]] = {}
        seen: dict[tuple[str, str], set[str]] = {}
        for r in self.records:
            if (since is not None and r.at < since) or (key is not None and r.key != key):
                continue
            if by == "target":
                for leg in r.legs:
                    t = leg.tokens
                    row = groups.setdefault((leg.target, r.currency), [0] * 7)
                    seen.setdefault((leg.target, r.currency), set()).add(r.request_id)
                    for i, n in enumerate(
                        (t.prompt, t.completion, t.reasoning, t.cached, t.cache_write, leg.cost)
                    ):
                        row[i + 1] += n
                continue
            name = r.day if by == "day" else r.key if by == "key" else r.route
            row = groups.setdefault((name, r.currency), [0] * 7)
            row[0] += 1
            tokens = r.tokens()
            for i, c in enumerate(TOKEN_COLUMNS):
                row[i + 1] += tokens[c]
            row[6] += r.cost
        for group, ids in seen.items():
            groups[group][0] = len(ids)
        return [(name, *groups[name, currency], currency) for name, currency in sorted(groups)]

    async def spent(self, key: str, since: float, currency: str) -> int:
        return sum(
            r.cost
            for r in self.records
            if r.key == key and r.at >= since and r.currency == currency
        )

    async def currency(self) -> str | None:
        return self.records[-1].currency if self.records else None

    async def close(self) -> None:
        return None


class SQLiteLedgerStore:
    def __init__(self, path: str) -> None:
        self.path = path
        self.shown = f"sqlite:///{path}"
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # one call at a time on the connection

    def _call(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            if self._db is None:
                db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute("PRAGMA busy_timeout=5000")
                self._db = db
            return fn(self._db, *args)

    def missing(self) -> str | None:
        """Why the file cannot be there (its directory is missing), naming the path as
        resolved; None when it can."""
        where = os.path.abspath(self.path)
        if os.path.isdir(os.path.dirname(where)):
            return None
        return f"no directory {os.path.dirname(where)} for {where} ({_SQLITE_RULE})"

    async def open(self) -> None:
        missing = self.missing()
        if missing is not None:
            raise LedgerStoreError(missing)
        await anyio.to_thread.run_sync(self._call, _migrate_sqlite)

    async def write(self, records: Sequence[UsageRecord]) -> None:
        await anyio.to_thread.run_sync(self._call, _write_sqlite, records)

    async def summary(self, by: str, since: float | None, key: str | None = None) -> list[Row]:
        sql, args = summary_sql(by, since, "?", key)
        rows = await anyio.to_thread.run_sync(self._call, _read, sql, args)
        return [tuple(r) for r in rows]

    async def spent(self, key: str, since: float, currency: str) -> int:
        rows = await anyio.to_thread.run_sync(
            self._call, _read, SPENT_SQL.format(m="?"), (key, since, currency)
        )
        return int(rows[0][0])

    async def currency(self) -> str | None:
        rows = await anyio.to_thread.run_sync(self._call, _read, CURRENCY_SQL, ())
        return str(rows[0][0]) if rows else None

    async def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _migrate_sqlite(db: sqlite3.Connection) -> None:
    db.execute("BEGIN IMMEDIATE")  # one instance migrates at a time
    try:
        db.execute("CREATE TABLE IF NOT EXISTS usage_schema (version INTEGER NOT NULL)")
        row = db.execute("SELECT MAX(version) FROM usage_schema").fetchone()
        have = row[0] or 0
        for version, steps in enumerate(MIGRATIONS, start=1):
            if version <= have:
                continue
            for step in steps:
                db.execute(step)
            db.execute("INSERT INTO usage_schema (version) VALUES (?)", (version,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _write_sqlite(db: sqlite3.Connection, records: Sequence[UsageRecord]) -> None:
    requests_sql, requests, legs_sql, legs = insert_rows(records, "?")
    db.execute("BEGIN")
    try:
        db.executemany(requests_sql, requests)
        db.executemany(legs_sql, legs)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _read(db: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> list[Any]:
    return db.execute(sql, args).fetchall()


class PostgresLedgerStore:
    """One connection, made again after a failure (the writer retries the batch), and one
    transaction at a time on it: the writer's and a report's share it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.shown = _without_password(url)
        self._conn: Any = None
        self._turn = anyio.Lock()

    async def _connection(self) -> Any:
        if self._conn is None or self._conn.closed:
            import psycopg  # the `postgres` extra: only when a postgresql:// URL is given

            self._conn = await psycopg.AsyncConnection.connect(
                self.url, connect_timeout=3, autocommit=False
            )
        return self._conn

    async def _run(self, work: Any) -> Any:
        async with self._turn:
            for again in (False, True):
                # A kept connection may have died with a database restart unseen: its first
                # use fails, and the work is tried once more on a new one (a batch written
                # twice counts once; a read is a read).
                kept = self._conn is not None and not self._conn.closed
                conn = await self._connection()
                try:
                    async with conn.transaction():
                        async with conn.cursor() as cur:
                            return await work(cur)
                except Exception:
                    await self._drop()
                    if again or not kept:
                        raise
                except BaseException:
                    await self._drop()
                    raise

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with anyio.CancelScope(shield=True):
                try:
                    await conn.close()
                except Exception:  # already broken: nothing to close cleanly
                    pass

    async def open(self) -> None:
        async def migrate(cur: Any) -> None:
            # Instances starting together migrate one at a time (a transaction-scoped lock).
            await cur.execute("SELECT pg_advisory_xact_lock(4040404040)")
            await cur.execute("CREATE TABLE IF NOT EXISTS usage_schema (version INTEGER NOT NULL)")
            await cur.execute("SELECT MAX(version) FROM usage_schema")
            have = (await cur.fetchone())[0] or 0
            for version, steps in enumerate(MIGRATIONS, start=1):
                if version <= have:
                    continue
                for step in steps:
                    await cur.execute(step)
                await cur.execute("INSERT INTO usage_schema (version) VALUES (%s)", (version,))

        await self._run(migrate)

    async def write(self, records: Sequence[UsageRecord]) -> None:
        requests_sql, requests, legs_sql, legs = insert_rows(records, "%s")

        async def insert(cur: Any) -> None:
            await cur.executemany(requests_sql, requests)
            await cur.executemany(legs_sql, legs)

        await self._run(insert)

    async def summary(self, by: str, since: float | None, key: str | None = None) -> list[Row]:
        sql, args = summary_sql(by, since, "%s", key)

        async def read(cur: Any) -> list[Any]:
            await cur.execute(sql, args)
            return list(await cur.fetchall())

        rows = await self._run(read)
        return [(r[0], *(int(v or 0) for v in r[1:-1]), r[-1]) for r in rows]

    async def spent(self, key: str, since: float, currency: str) -> int:
        async def read(cur: Any) -> int:
            await cur.execute(SPENT_SQL.format(m="%s"), (key, since, currency))
            return int((await cur.fetchone())[0])

        return int(await self._run(read))

    async def currency(self) -> str | None:
        async def read(cur: Any) -> str | None:
            await cur.execute(CURRENCY_SQL)
            row = await cur.fetchone()
            return str(row[0]) if row else None

        return await self._run(read)  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self._drop()


_PASSWORD_PARAM = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def _without_password(url: str) -> str:
    """The URL for log lines: a password in its user part or in `?password=` as `***`."""
    url = _PASSWORD_PARAM.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"
