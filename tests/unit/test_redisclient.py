"""The shared Redis client against a real redis-server: a burst of calls queues on at most
`max_connections` connections, and a pool that stays exhausted past its wait reads as Redis
being unreachable to that call (503 store_unavailable, the limits' local fallback), never as
the stream store's outage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import ConnectionError

from firsttoken.admission import redis_limits as limits_module
from firsttoken.admission.limits import OK
from firsttoken.admission.redis_limits import RedisLimits
from firsttoken.admission.redis_spend import RedisSpend
from firsttoken.admission.spend import Budget
from firsttoken.formats.errors import APIError
from firsttoken.redisclient import POOL_WAIT_S, eviction_risk, redis_client
from firsttoken.resume import redis as store_module
from firsttoken.resume.health import busy
from firsttoken.resume.redis import RedisStore
from tests.redis_server import run_redis


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with run_redis() as u:
        yield u


async def connected_clients(url: str) -> int:
    """Connections Redis holds, less the one asking."""
    async with Redis.from_url(url) as probe:
        return int((await probe.info("clients"))["connected_clients"]) - 1


async def exhaust(pool: BlockingConnectionPool) -> list[object]:
    """Take every connection the pool may open, as long-held calls would."""
    return [await pool.get_connection() for _ in range(pool.max_connections)]


def test_a_burst_waits_for_a_connection_instead_of_opening_more(url: str) -> None:
    async def body() -> None:
        client = redis_client(url, max_connections=4)
        try:
            assert isinstance(client.connection_pool, BlockingConnectionPool)
            # 40 calls holding a connection 50 ms each: ten rounds on four, well inside the wait.
            replies = await asyncio.gather(*(client.blpop(["empty"], 0.05) for _ in range(40)))
            assert replies == [None] * 40
            # A pool keeps what it opened, so what Redis holds now is the burst's peak.
            assert await connected_clients(url) <= 4
        finally:
            await client.aclose()
        assert await connected_clients(url) == 0  # closing the client closes its pool

    asyncio.run(body())


def test_an_exhausted_pool_fails_after_its_wait_as_a_connection_error(url: str) -> None:
    async def body() -> None:
        client = redis_client(url, max_connections=2)
        pool = client.connection_pool
        try:
            held = await exhaust(pool)
            pool.timeout = 0.05  # type: ignore[attr-defined]  # POOL_WAIT_S, shortened
            started = time.monotonic()
            with pytest.raises(ConnectionError, match="No connection available") as raised:
                await client.get("k")
            assert 0.04 < time.monotonic() - started < 0.5
            assert busy(raised.value)  # a request's wait, not Redis away: the store stays up
            await pool.release(held[0])  # type: ignore[arg-type]
            assert await client.get("k") is None  # one free again: served at once
        finally:
            await client.aclose()

    asyncio.run(body())


def test_the_pool_wait_is_the_request_paths_own_budget_for_a_redis_call() -> None:
    # Never shorter: a burst's wait for a connection is not an outage (see redisclient).
    assert POOL_WAIT_S == store_module._OP_TIMEOUT_S == limits_module._OP_TIMEOUT_S


def test_an_exhausted_pool_answers_that_request_503_and_leaves_the_stream_store_up(
    url: str,
) -> None:
    """A burst (500 resumes at once) waits past the pool's wait while Redis answers: that
    request's 503, not an outage for every stream (`resume.health.busy`)."""

    async def body() -> None:
        store = RedisStore(url, max_events=16, max_connections=2)
        pool = store.redis.connection_pool
        try:
            await exhaust(pool)
            pool.timeout = 0.05  # type: ignore[attr-defined]  # the pool's error, not fail_after's
            with pytest.raises(APIError) as lookup:
                await store.lookup("abc")
            assert (lookup.value.status, lookup.value.code) == (503, "store_unavailable")
            assert store.degraded is None and store.outages == 0
            with pytest.raises(APIError) as cancel:
                await store.cancel("abc")
            assert (cancel.value.status, cancel.value.code) == (503, "store_unavailable")
        finally:
            await store.redis.aclose()

    asyncio.run(body())


def test_an_exhausted_pool_sends_admission_to_the_local_limits(url: str) -> None:
    async def body() -> None:
        limits = RedisLimits(url, rate_per_s=100.0, burst=10, max_connections=2)
        pool = limits.redis.connection_pool
        try:
            assert (await limits.admit("key", 5))[0] == OK  # through Redis
            assert limits.fallbacks == 0
            held = await exhaust(pool)
            pool.timeout = 0.05  # type: ignore[attr-defined]
            verdict, _, lease = await limits.admit("key", 5)
            assert verdict == OK and lease is not None
            assert limits.fallbacks == 1 and limits.degraded == "redis_limits"
            for conn in held:
                await pool.release(conn)  # type: ignore[arg-type]
            await limits.release(lease)  # taken locally, given back locally
            assert (await limits.admit("key", 5))[0] == OK and limits.fallbacks == 2
            assert await limits.probe()  # what `run` asks every 0.25 s while Redis is away
            assert (await limits.admit("key", 5))[0] == OK and limits.degraded is None
        finally:
            await limits.redis.aclose()

    asyncio.run(body())


def test_only_noeviction_keeps_every_key_of_ours() -> None:
    """A spend counter evicted under memory pressure lets a key over its budget spend again."""
    assert eviction_risk("noeviction") is None
    volatile = eviction_risk("volatile-lru")
    assert volatile is not None and "day and month" in volatile and "spend" in volatile
    anything = eviction_risk("allkeys-lru")
    assert anything is not None and anything.startswith("any key") and "spend" in anything


def test_while_redis_is_away_admission_asks_only_the_probe() -> None:
    """Every new stream paid a refused connect and its retry's backoff for each admission
    step while Redis restarted (65 ms a stream); now they go local at once, and the probe
    alone asks Redis whether it is back."""

    async def body() -> None:
        limits = RedisLimits(
            "redis://127.0.0.1:1/0",  # nothing listens: refused
            rate_per_s=100.0,
            burst=10,
            max_connections=2,
        )
        spend = RedisSpend(limits.redis, limits.outage)
        asked = 0
        script = limits._admit

        async def counted(**kw: object) -> object:
            nonlocal asked
            asked += 1
            return await script(**kw)

        limits._admit = counted  # type: ignore[method-assign]
        try:
            for _ in range(5):
                verdict, _, lease = await limits.admit("key", 5)
                assert verdict == OK and lease is not None
                await limits.release(lease)
                assert await limits.count_request("key", 100) is None
            assert asked == 1 and limits.fallbacks == 10
            assert limits.degraded == "redis_limits" and not spend.outage.up
            budget = Budget(amount=1_000, per="day")
            assert await spend.reserve("key", budget, 10) is not None  # local, at once
            assert not await limits.probe() and asked == 1
        finally:
            await limits.redis.aclose()

    asyncio.run(body())
