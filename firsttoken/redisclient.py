"""The Redis client every Redis user here shares the settings of: fail fast while it is away,
and open a bounded number of connections however many calls are in flight."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, RedisClusterException, RedisError, ResponseError

__all__ = [
    "POOL_WAIT_S",
    "REDIS_DOWN",
    "AnyRedis",
    "Liveness",
    "Outage",
    "RawEntries",
    "eviction_risk",
    "pack",
    "redis_client",
    "resp_arg",
    "roundtrip",
]

AnyRedis = Redis | RedisCluster
# A stream's entries as our clients read them: bytes, since no client here decodes replies
# (redis-py's types allow either mode, so callers cast to this).
RawEntries = list[tuple[bytes, dict[bytes, bytes]]]

# What a call to an unreachable (or reconfiguring) Redis raises. The cluster client's own
# errors (no node for a slot yet, a command it refuses) are not RedisErrors, and redis-py
# 8.1's cluster client, on a connection the node closed under it during a burst, raises
# asyncio's RuntimeError("unable to perform operation on <TCPTransport closed=True>") or
# AttributeError("'NoneType' object has no attribute 'writelines'") from its own send: a
# Redis call that fails so is Redis being away, not a bug of ours (each was a 500 on create
# in bench.instances and test_instances). The try blocks that catch these hold Redis calls
# only.
REDIS_DOWN = (
    RedisError,
    RedisClusterException,
    OSError,
    TimeoutError,
    RuntimeError,
    AttributeError,
)


def eviction_risk(policy: str) -> str | None:
    """What Redis's `maxmemory-policy` may evict of ours once `maxmemory` is reached; None
    for `noeviction` (a full Redis refuses writes instead: replication backs off and keeps
    its backlog, admission falls back to each instance's own limits). Every key of ours but
    a `total` budget's spend counter has a TTL, so `volatile-*` policies may evict the day's
    and month's spend counters, the limits' counters and streams; `allkeys-*` anything."""
    if policy == "noeviction":
        return None
    what = (
        "spend counters (a key over its money budget is admitted again), rate and token "
        "counters, concurrency slots, and streams' events and metas (resume_expired, "
        "stream_lost)"
    )
    if policy.startswith("volatile-"):
        return f"keys with a TTL: day and month {what}"
    return f"any key: {what}"


# A call finding every connection busy waits this long for one, then fails with redis-py's
# ConnectionError("No connection available.") raised from a TimeoutError: Redis unreachable
# for that call (the stream store does not count it as an outage: `resume.health.busy`).
# The same 1 s a request-path call gives Redis (`_OP_TIMEOUT_S` in the
# store and the limits), so the wait is part of that budget, never a shorter one: a burst of
# 1,000 new streams on one process waits up to 0.5-1 s for a connection at any pool size
# (the loop, not Redis, is busy), and a 0.5 s wait sent 40-573 of them to the fallbacks.
POOL_WAIT_S = 1.0


class RedisAway(ConnectionError):
    """A call not made: an earlier one found Redis away (`Outage.check`)."""


class Outage:
    """Whether Redis answers, as the users of one client see it. A call that finds it away
    marks it down; every call then takes its caller's local answer at once, and one probe
    (the owner's, every 0.25 s) marks it up again once Redis answers.

    Without it every admission step during an outage paid a refused connect and its retry's
    backoff (20 ms: 65 ms a new stream, three steps) or, with Redis hung, the 1 s timeout."""

    PROBE_S = 0.25

    def __init__(self) -> None:
        self.up = True

    def check(self) -> None:
        """Raise `RedisAway` (one of `REDIS_DOWN`) while Redis is away: inside a call's `try`,
        its own fallback serves both a failed call and one not made."""
        if not self.up:
            raise RedisAway("Redis is away; the probe has not found it back")

    def failed(self) -> bool:
        """A call found Redis away; True if it was up (the caller says so once)."""
        was, self.up = self.up, False
        return was

    def answered(self) -> bool:
        """Redis answered; True if it was down."""
        was, self.up = self.up, True
        return not was


def redis_client(url: str, *, max_connections: int, cluster: bool = False) -> AnyRedis:
    """One quick retry, bounded connects and reads: redis-py's default retries ten times
    with backoff, which is seconds per call on the request path while Redis is down.

    At most `max_connections` connections, callers queueing for a free one. redis-py's own
    pool either opens one per concurrent call (older releases cap it at 2**31: 1,767 open
    for a burst of 1,000 streams) or refuses the 101st at once (8.1, pinned here:
    MaxConnectionsError, the burst taken for an outage). A subscription or a blocking XREAD
    holds a connection for as long as it lasts.

    `cluster`: `url` names one node of a Redis Cluster; redis-py's cluster client learns the
    others, sends each command to its slot's node and follows MOVED/ASK and failovers. It
    keeps a pool per node of at most `max_connections`, which refuses a call beyond it at
    once; `_WaitingCluster` makes calls beyond it wait, as the single node's pool does."""
    retry = Retry(ExponentialBackoff(cap=0.05, base=0.01), 1)
    if cluster:
        return _WaitingCluster.from_url(
            url,
            max_connections=max_connections,
            retry=retry,
            socket_connect_timeout=1.0,
            socket_timeout=5.0,
            health_check_interval=5,
        )
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=POOL_WAIT_S,
        retry=retry,
        socket_connect_timeout=1.0,
        socket_timeout=5.0,  # above the 1 s block of the store's XREAD
        health_check_interval=5,
    )
    return Redis.from_pool(pool)  # the client closes the pool with it


class _WaitingCluster(RedisCluster):
    """redis-py's cluster client refuses a call at once when the node's pool is at
    `max_connections` (MaxConnectionsError: a burst of 1,000 admissions taken for an outage,
    each one falling back to this instance's own limits). Here at most `max_connections`
    calls (a pipeline is one: it takes a connection per node) run at once, and the others
    wait up to `POOL_WAIT_S` for a turn, then fail as the single node's pool does."""

    def __init__(self, *args: Any, max_connections: int, **kwargs: Any) -> None:
        kwargs["max_connections"] = max_connections
        super().__init__(*args, **kwargs)
        self.turns = asyncio.Semaphore(max_connections)

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(self.turns.acquire(), POOL_WAIT_S)
        except TimeoutError as exc:
            # Raised from the timeout, as the single node's pool does: a busy process, not
            # Redis away (`resume.health.busy`).
            raise ConnectionError("No connection available.") from exc
        try:
            yield
        finally:
            self.turns.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.turn():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # which refuses it
        # redis-py declares `_event_dispatcher` abstract on a class it instantiates itself.
        return _WaitingPipeline(self, transaction)  # type: ignore[abstract]


class _WaitingPipeline(ClusterPipeline):
    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        async with cast(_WaitingCluster, self.cluster_client).turn():  # its own `pipeline()`
            return await super().execute(*args, **kwargs)


def resp_arg(value: bytes) -> bytes:
    """One argument of a command as Redis reads it (RESP bulk string)."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


def pack(*args: str | bytes | int) -> bytes:
    """A command as Redis reads it: for the store's hot writes, packed once, here, without
    redis-py's per-argument encoder and pipeline (a flush of 500 streams spent more there
    than in building the runs)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        parts.append(resp_arg(arg))
    return b"".join(parts)


async def roundtrip(client: Redis, commands: list[bytes], replies: int) -> list[Any]:
    """Packed commands written at once on one of the client's connections, and their
    `replies` read in order: an error reply is returned in its place (as a pipeline's
    `raise_on_error=False`), a failed connection raises and is closed. Not for a cluster."""
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        await conn.send_packed_command(commands)
        out: list[Any] = []
        for _ in range(replies):
            try:
                out.append(await conn.read_response())
            except ResponseError as exc:  # the reply was read whole: the connection is fine
                out.append(exc)
        return out
    except BaseException:
        await conn.disconnect(nowait=True)  # replies may be left unread on it
        raise
    finally:
        await pool.release(conn)


class Liveness:
    """A key that lives `ttl_ms` and is written again every `every_s` by a thread with its
    own connection, while this process runs: another instance reads its absence as this one
    being gone. A thread, not a task: an event loop busy for a second (a burst, a collector
    pass) must not look like a dead process; a stopped or killed one does."""

    def __init__(
        self, url: str, key: str, *, cluster: bool, ttl_ms: int = 1200, every_s: float = 0.2
    ) -> None:
        self.url = url
        self.key = key
        self.cluster = cluster
        self.ttl_ms = ttl_ms
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="redis-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop writing and delete the key (blocking: run it in a thread from async code)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def _client(self) -> Any:
        import redis
        import redis.cluster

        timeouts = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
        if self.cluster:
            return redis.cluster.RedisCluster.from_url(self.url, **timeouts)
        return redis.Redis.from_url(self.url, **timeouts)

    def _run(self) -> None:
        client = None
        while True:
            try:
                if client is None:
                    client = self._client()
                if self._stop.is_set():
                    client.delete(self.key)
                    break
                client.set(self.key, 1, px=self.ttl_ms)
            except Exception:  # Redis away (or the cluster reconfiguring): try again
                if client is not None:
                    try:
                        client.close()
                    except Exception:
                        pass
                    client = None
                if self._stop.is_set():
                    break
            self._stop.wait(self.every_s)
        if client is not None:
            client.close()
