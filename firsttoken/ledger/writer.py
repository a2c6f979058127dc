"""Records leave the hot path through a bounded queue and reach the store in batches.

A request's end costs an append to a deque (`submit`). One task writes what is queued, at
most once every `interval_s` (100 ms): a fleet of instances costs the database ten writes a
second each, whatever the load; with nothing queued the task sleeps until a record comes
(an idle server does not wake ten times a second for an empty queue). When a write fails
(the database is away) the batch stays at the head of the queue and is tried again, every
`interval_s` at first and up to every 2 s; streams never wait for it. Only when the queue
holds `max_records` is a new record dropped (`firsttoken_usage_records_dropped_total`):
memory stays bounded through a long outage. A batch refused for what one of its records holds
(a number too large for the table) is written one record at a time instead: the bad record is
dropped (`ledger.record_refused`, counted in `firsttoken_usage_records_dropped_total`), the
others are written, and nothing waits behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from itertools import islice

import anyio

from firsttoken.ledger.record import UsageRecord
from firsttoken.ledger.stores import LedgerStore, record_fault
from firsttoken.telemetry.log import log_event

__all__ = ["LedgerWriter"]

_BATCH = 5000  # records per write at most: one transaction stays short
_MAX_BACKOFF_S = 2.0
_CLOSE_S = 5.0  # on shutdown, how long the last records may take to reach the store
# A write that hangs (a database gone silent, no reset) counts as failed after this long.
_WRITE_TIMEOUT_S = 10.0


class LedgerWriter:
    def __init__(
        self,
        store: LedgerStore,
        max_records: int = 100_000,
        interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.max_records = max_records
        self.interval_s = interval_s
        self.clock = clock
        self.queue: deque[UsageRecord] = deque()
        self.dropped = 0
        self.written = 0
        self.writes = 0  # batches written
        self.up = True
        self._queued = asyncio.Event()  # set by `submit`, cleared by the task once it is idle

    def submit(self, record: UsageRecord) -> None:
        if len(self.queue) >= self.max_records:
            self.dropped += 1
            return
        self.queue.append(record)
        if not self._queued.is_set():
            self._queued.set()

    async def run(self) -> None:
        """Write what is queued until cancelled; then what is left, for a few seconds."""
        backoff = self.interval_s
        try:
            while True:
                if not self.queue:
                    self._queued.clear()
                    await self._queued.wait()
                await anyio.sleep(backoff)  # what else comes meanwhile goes in the same batch
                backoff = (
                    self.interval_s if await self.flush_once() else min(_MAX_BACKOFF_S, backoff * 2)
                )
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_S):
                while self.queue and await self.flush_once():
                    pass
                await self.store.close()

    async def flush_once(self) -> bool:
        """One batch to the store; False when the store refused it (it stays queued)."""
        if not self.queue:
            return True
        batch = list(islice(self.queue, _BATCH))  # a deque's `[i]` walks from an end
        try:
            with anyio.fail_after(_WRITE_TIMEOUT_S):
                await self.store.write(batch)
        except Exception as exc:  # the database away, or a broken connection: try later
            if record_fault(exc):
                return await self._one_by_one(batch)
            if self.up:
                self.up = False
                log_event(
                    "ledger.write_failed",
                    logging.ERROR,
                    store=self.store.shown,
                    queued=len(self.queue),
                    error=repr(exc),
                )
            return False
        self._written(batch)
        return True

    def _written(self, batch: list[UsageRecord], refused: int = 0) -> None:
        if len(self.queue) == len(batch):
            self.queue.clear()  # nothing came in during the write: the common case
        else:
            for _ in batch:
                self.queue.popleft()
        self.written += len(batch) - refused
        self.writes += 1
        if not self.up:
            self.up = True
            log_event("ledger.write_back", store=self.store.shown, queued=len(self.queue))

    async def _one_by_one(self, batch: list[UsageRecord]) -> bool:
        """The batch, a record at a time: the ones the table refuses are dropped, said once
        each; False when the database itself fails meanwhile (the batch stays queued)."""
        refused = 0
        for record in batch:
            try:
                with anyio.fail_after(_WRITE_TIMEOUT_S):
                    await self.store.write([record])
            except Exception as exc:
                if not record_fault(exc):
                    return False  # written ones are keyed by request id: never counted twice
                refused += 1
                self.dropped += 1
                log_event(
                    "ledger.record_refused",
                    logging.ERROR,
                    request_id=record.request_id,
                    key=record.key,
                    error=repr(exc)[:300],
                )
        self._written(batch, refused)
        return True
