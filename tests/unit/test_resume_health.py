"""Redis up or down, and `--durable`'s gates (`firsttoken/resume/health.py`): readers of an
owned stream see only what Redis confirmed, except while Redis is away or slow."""

from __future__ import annotations

from itertools import pairwise

import anyio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from firsttoken.eventlog import EventLog
from firsttoken.formats.errors import APIError
from firsttoken.resume.health import RETRY_MAX_S, STALL_S, busy, unavailable
from firsttoken.resume.redis import RedisStore
from firsttoken.resume.store import StreamRecord
from tests.unit import virtual_loop
from tests.unit.replicated import TTL_S, confirm, flush, replicate, shown, store


def durable_store() -> tuple[RedisStore, EventLog]:
    s = store(durable=True)
    s.up = True
    return s, s._replicas["s1"].log


def test_an_outage_is_counted_once_and_ends_only_with_a_write_answered_in_full() -> None:
    s, _ = durable_store()
    health = s._health
    health.down(ConnectionError("gone"))
    health.down(ConnectionError("still gone"))
    assert (s.up, s.outages, s.degraded) == (False, 1, "redis")
    health.write_ended(ConnectionError("a flush failed too"))
    assert s.outages == 1
    health.write_ended(None)
    assert (s.up, s.degraded) == (True, None)


def test_durable_readers_go_on_while_redis_is_away_and_wait_for_it_again_once_back() -> None:
    """Nothing can take a stream over while Redis does not answer: holding events back then
    would only stall every reader for the outage."""
    s, log = durable_store()
    health = s._health
    replicate(s, 1, 3)
    flush(s)
    confirm(s, 1)
    replicate(s, 4, 5)
    assert shown(log) == [1, 2, 3]
    health.write_ended(ConnectionError("Redis went away"))
    assert health.released and shown(log) == [1, 2, 3, 4, 5]
    replicate(s, 6, 6)
    assert shown(log)[-1] == 6  # as it comes
    other = EventLog(100)  # a stream opened meanwhile is not held either
    s.open(StreamRecord("s2", "native", "d", "t", "m"), TTL_S, other)
    other.append(b"x", 1)
    assert [e.seq for e in other.after(0)] == [1]
    s.let_go("s2", flush=False)
    # Back: a flush answered in full holds readers to what Redis confirms again.
    flush(s)
    confirm(s, 1)
    health.write_ended(None)
    assert not health.released and s.up
    replicate(s, 7, 7)
    assert shown(log)[-1] == 6  # what was shown stays shown; the next one waits
    flush(s)
    confirm(s, 1)
    assert shown(log)[-1] == 7


def test_a_flush_unanswered_past_the_stall_bound_releases_durable_readers() -> None:
    """Redis stopped, not gone (SIGSTOP, a long block): no error comes, only silence."""

    s, log = durable_store()
    health = s._health
    replicate(s, 1, 2)

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(health.watch_stalls)
            health.write_began()
            await anyio.sleep(STALL_S * 0.9)
            assert not health.released and shown(log) == []
            await anyio.sleep(STALL_S * 0.2)
            assert health.released and s.up and shown(log) == [1, 2]
            health.write_ended(None)  # its reply came: held again
            assert not health.released
            health.write_began()  # a flush answered in time releases nothing
            await anyio.sleep(STALL_S * 0.5)
            health.write_ended(None)
            await anyio.sleep(STALL_S * 2)
            assert not health.released
            tg.cancel_scope.cancel()

    virtual_loop.run(body())


def test_a_store_without_durable_holds_nothing_back() -> None:
    s = store()
    s.up = True
    log = s._replicas["s1"].log
    replicate(s, 1, 2)
    assert shown(log) == [1, 2]
    s._health.down(ConnectionError("gone"))
    assert not s._health.released and not s._health.holding


def test_a_call_is_retried_with_backoff_while_redis_is_down() -> None:
    s, _ = durable_store()
    tries: list[float] = []

    async def call() -> str:
        tries.append(anyio.current_time())
        if len(tries) < 7:
            raise ConnectionError("refused")
        return "answered"

    async def body() -> str:
        return await s._health.retrying(call)

    assert virtual_loop.run(body()) == "answered"
    gaps = [round(b - a, 6) for a, b in pairwise(tries)]
    assert gaps == [0.1, 0.2, 0.4, 0.8, 1.6, RETRY_MAX_S]
    assert not s.up and s.outages == 1


def test_unavailable_is_a_503_that_says_to_retry() -> None:
    error = unavailable("streams of other instances cannot be found now")
    assert isinstance(error, APIError)
    assert (error.status, error.code) == (503, "store_unavailable")
    assert error.headers == {"retry-after": "1"}


def test_a_call_that_only_ran_out_of_time_or_connections_is_busy_not_redis_away() -> None:
    def pool_wait() -> RedisConnectionError:
        try:
            raise TimeoutError
        except TimeoutError as exc:
            try:
                raise RedisConnectionError("No connection available.") from exc
            except RedisConnectionError as error:
                return error

    assert busy(TimeoutError()) and busy(pool_wait())
    refused = RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Refused.")
    assert not busy(refused) and not busy(ConnectionResetError()) and not busy(ResponseError())
    s = store()
    s.up = True
    s._health.failed(TimeoutError())
    s._health.failed(pool_wait())
    assert s.up and s.outages == 0  # one request's timeout is its own
    s._health.failed(refused)
    assert not s.up and s.outages == 1
