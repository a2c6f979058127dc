"""A mirror's tail (`core/mirror.py`): whether its closed log is the stream's end.

Only the store says a stream ended (its end marker, or an error event); a log closed here
because the mirror was handed over or its tail stopped is a cut, and a reader coming back must
not be told "all delivered" (`api/native/streams.py` answers 204 only for an end)."""

from __future__ import annotations

import asyncio

import anyio
import orjson

from firsttoken.core.mirror import Mirror
from firsttoken.core.stream import Outcome
from firsttoken.eventlog import EventLog
from firsttoken.resume import StreamRecord
from tests.unit import virtual_loop


class _Store:
    """A tail that adds one event, then ends the stream (`ends`) or waits on for more."""

    def __init__(self, ends: bool) -> None:
        self.ends = ends

    async def tail(self, stream_id: str, after: int, log: EventLog, resumed: object = None) -> None:
        log.append(b'id: %d\ndata: {"token":"a"}\n\n' % log.next_seq, 1)
        if self.ends:
            log.close()  # the end marker
            return
        await anyio.sleep_forever()


def _mirror() -> Mirror:
    return Mirror(StreamRecord("s1", "native", "d", "t", "synthetic"), max_events=100)


async def _tailing(store: _Store) -> tuple[Mirror, asyncio.Task[None]]:
    mirror = _mirror()
    task = asyncio.ensure_future(mirror.follow(store, 0).run())  # type: ignore[arg-type]
    await asyncio.sleep(1)
    return mirror, task


def test_a_log_the_store_closed_is_the_stream_s_end() -> None:
    async def body() -> None:
        mirror, task = await _tailing(_Store(ends=True))
        await task
        assert mirror.log.closed and mirror.ended_there and mirror.outcome is None

    virtual_loop.run(body())


def test_a_handed_over_mirror_s_closed_log_is_not_its_end() -> None:
    async def body() -> None:
        mirror, task = await _tailing(_Store(ends=False))
        mirror.move()  # its instance drains: readers go on elsewhere
        await task
        assert mirror.log.closed and mirror.log.last_seq == 1
        assert mirror.outcome is Outcome.MOVED and not mirror.ended_there

    virtual_loop.run(body())


def test_a_stopped_tail_s_closed_log_is_not_its_end() -> None:
    async def body() -> None:
        mirror, task = await _tailing(_Store(ends=False))
        mirror.stop(Outcome.DISCONNECTED)
        await task
        assert mirror.log.closed and not mirror.ended_there

    virtual_loop.run(body())


def test_a_mirror_knows_the_key_that_made_its_stream() -> None:
    record = StreamRecord("s1", "responses", "d", "t", "synthetic", tenant="alice")
    assert Mirror(record, max_events=100).request.tenant == "alice"  # who reads it by id
    unnamed = StreamRecord("s2", "native", "d", "t", "synthetic")  # an open server's
    assert Mirror(unnamed, max_events=100).request.tenant == ""


class _Cancels:
    """A store that writes down the cancels it was asked to pass to a stream's owner."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel(self, stream_id: str) -> str | None:
        self.cancelled.append(stream_id)
        return None  # the owner has not answered yet


def test_cancelling_a_mirror_asks_its_owner_through_the_store() -> None:
    store = _Cancels()
    mirror = _mirror()
    assert asyncio.run(mirror.cancel(store)) == "cancelling"  # type: ignore[arg-type]
    assert store.cancelled == ["s1"] and mirror.outcome is None  # its owner ends it


def test_a_mirror_s_last_reader_leaving_stops_its_tail_at_once() -> None:
    async def body() -> None:
        mirror, task = await _tailing(_Store(ends=False))
        mirror.last_reader_left(None)  # type: ignore[arg-type]  # no grace here: the owner's
        await task
        assert mirror.log.closed and not mirror.ended_there

    virtual_loop.run(body())


def test_a_mirror_tells_a_reader_it_lets_go_in_its_format_without_a_renderer() -> None:
    record = StreamRecord("s1", "responses", "d", "t", "synthetic")
    [(name, data)] = Mirror(record, max_events=100).error_events("stream_moved", "elsewhere")
    assert name == "error" and orjson.loads(data)["code"] == "stream_moved"
