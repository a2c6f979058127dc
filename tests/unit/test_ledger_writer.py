"""The ledger's writer: batches at most every interval, keeps a failed batch for later, and
drops only past its bound (counted)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from firsttoken.ledger.record import UsageRecord
from firsttoken.ledger.stores import MemoryLedgerStore, SQLiteLedgerStore
from firsttoken.ledger.writer import LedgerWriter
from firsttoken.pricing import LegCost, Usage


def record(i: int) -> UsageRecord:
    return UsageRecord(
        str(i), 0.0, "k", "r", "USD", "completed", None, 1.0, "", (LegCost("t", Usage(), i),)
    )


class FlakyStore(MemoryLedgerStore):
    """A memory store that refuses writes while `away`."""

    def __init__(self) -> None:
        super().__init__()
        self.away = False
        self.calls = 0

    async def write(self, records: Sequence[UsageRecord]) -> None:
        self.calls += 1
        if self.away:
            raise ConnectionError("database away")
        await super().write(records)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_records_wait_in_the_queue_while_the_store_is_away_and_none_are_lost() -> None:
    store = FlakyStore()
    writer = LedgerWriter(store)
    store.away = True
    for i in range(10):
        writer.submit(record(i))
    assert not await writer.flush_once()
    assert len(writer.queue) == 10 and not writer.up
    store.away = False
    assert await writer.flush_once()
    assert [r.request_id for r in store.records] == [str(i) for i in range(10)]
    assert writer.up and writer.written == 10 and writer.dropped == 0


@pytest.mark.anyio
async def test_past_its_bound_the_queue_drops_and_counts() -> None:
    writer = LedgerWriter(MemoryLedgerStore(), max_records=3)
    for i in range(5):
        writer.submit(record(i))
    assert len(writer.queue) == 3
    assert writer.dropped == 2


@pytest.mark.anyio
async def test_one_write_per_interval_however_many_records_arrive() -> None:
    store = FlakyStore()
    writer = LedgerWriter(store, interval_s=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        for i in range(200):
            writer.submit(record(i))
            if i % 20 == 0:
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)
        tg.cancel_scope.cancel()
    assert len(store.records) == 200
    assert store.calls <= 8  # ~0.3 s at one write per 50 ms at most, not one per record


@pytest.mark.anyio
async def test_what_is_queued_at_shutdown_is_written() -> None:
    store = FlakyStore()
    writer = LedgerWriter(store, interval_s=10)
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        await anyio.sleep(0.01)
        writer.submit(record(1))
        tg.cancel_scope.cancel()
    assert [r.request_id for r in store.records] == ["1"]


def test_an_idle_writer_does_not_wake_until_a_record_comes() -> None:
    from tests.unit import virtual_loop

    store = FlakyStore()
    writer = LedgerWriter(store, interval_s=0.1)
    flushes = 0
    flush_once = writer.flush_once

    async def counted() -> bool:
        nonlocal flushes
        flushes += 1
        return await flush_once()

    writer.flush_once = counted  # type: ignore[method-assign]

    async def body() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(writer.run())
        await asyncio.sleep(10.0)
        assert flushes == 0  # ten idle seconds: not one turn (it took 100 before)
        sent = loop.time()
        writer.submit(record(1))
        writer.submit(record(2))
        await asyncio.sleep(0.099)
        assert not store.records  # the batch gathers for one interval...
        await asyncio.sleep(0.002)
        assert loop.time() - sent <= 0.11  # ...then goes
        assert [r.request_id for r in store.records] == ["1", "2"] and store.calls == 1
        await asyncio.sleep(5.0)
        assert flushes == 1  # idle again
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    virtual_loop.run(body())


@pytest.mark.anyio
async def test_a_record_the_table_refuses_is_dropped_and_never_blocks_the_others(
    tmp_path: Path,
) -> None:
    # A cost past BIGINT (the real SQLite raises OverflowError for it): retried as a batch,
    # it would wedge every record behind it for good.
    store = SQLiteLedgerStore(str(tmp_path / "ledger.db"))
    await store.open()
    writer = LedgerWriter(store)
    for i in range(5):
        writer.submit(record(2**70 if i == 2 else i))
    assert await writer.flush_once() is True
    assert not writer.queue and writer.written == 4 and writer.dropped == 1
    rows = await store.summary("key", None)
    assert rows[0][1] == 4  # four requests written
    writer.submit(record(7))  # and what comes after goes as usual
    assert await writer.flush_once() is True and writer.written == 5
    await store.close()
