"""Whether Redis answers, and what `--durable` does while it does not.

Every part of the Redis store reports a failed call here (`down`, or `failed` for a call on
the request path, which may only have run out of time: `busy`); the flusher reports each
write's start and end (`write_began`, `write_ended`), and only a write answered in full
brings the store back up. While Redis is away or slow, `durable` readers are let go on
without it (`release`): no other instance can take a stream over meanwhile, since its claim
goes through Redis too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from redis.exceptions import ConnectionError as RedisConnectionError

from firsttoken.formats.errors import APIError
from firsttoken.redisclient import REDIS_DOWN
from firsttoken.resume.replicas import Replicas
from firsttoken.telemetry.log import log_event

__all__ = [
    "OP_TIMEOUT_S",
    "RETRY_MAX_S",
    "RETRY_MIN_S",
    "STALL_S",
    "Health",
    "busy",
    "unavailable",
]

OP_TIMEOUT_S = 1.0  # a request-path Redis call waits no longer than this
# `durable`: a flush unanswered this long counts as Redis away, and the owner's readers go on
# without it (`Health.release`): a few flush intervals, well under what a reader notices as
# a stall.
STALL_S = 0.2
RETRY_MIN_S, RETRY_MAX_S = 0.1, 2.0  # backoff while Redis is down

T = TypeVar("T")


def unavailable(what: str) -> APIError:
    return APIError(
        503,
        "store_unavailable",
        f"the shared stream store (Redis) is unreachable; {what}",
        headers={"retry-after": "1"},
    )


def busy(error: BaseException) -> bool:
    """A call that ran out of time (`OP_TIMEOUT_S`), or waited that long for a free
    connection (the pool's `ConnectionError`, raised from a timeout): on a loop starved by a
    burst (500 resumes at once) that is this process being busy, not Redis being away. A
    refused or reset connection, or an error reply, is Redis's."""
    if isinstance(error, TimeoutError):
        return True
    return isinstance(error, RedisConnectionError) and isinstance(error.__cause__, TimeoutError)


class Health:
    """Redis up or down (`up`, `outages`), and `durable`'s gates on the owned streams' logs
    (`released`: lifted while Redis is away or slow)."""

    def __init__(self, replicas: Replicas, *, durable: bool) -> None:
        self.replicas = replicas
        self.durable = durable  # readers see an event only once Redis confirmed it
        self.up = True
        self.outages = 0
        # `durable` while Redis is away or slow: readers see every event as it comes, since
        # no other instance can take a stream over meanwhile (`release`).
        self.released = False
        self._stalled = False  # a flush has waited past `STALL_S` for its reply
        self._writing_since: float | None = None  # monotonic start of the flush in flight
        self._flush_began = anyio.Event()  # for the stall watch

    @property
    def holding(self) -> bool:
        """Readers of an owned stream see only what Redis confirmed."""
        return self.durable and not self.released

    @property
    def degraded(self) -> str | None:
        return None if self.up else "redis"

    def set_up(self, up: bool, error: BaseException | None = None) -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            log_event("redis.up", backlog=self.replicas.backlog())
        else:
            self.outages += 1
            log_event(
                "redis.down", logging.ERROR, error=repr(error), backlog=self.replicas.backlog()
            )
            self.release()

    def down(self, error: BaseException) -> None:
        self.set_up(False, error)

    def failed(self, error: BaseException) -> None:
        """A request-path call failed: the store is down, unless the call was only `busy`.
        One request's timeout must not take the store down for every stream (a burst that
        starves the loop would); the flusher and the heartbeat, which call Redis all the
        time, say soon enough whether it is away."""
        if not busy(error):
            self.down(error)

    def release(self) -> None:
        """`durable`, Redis away or slow: every stream's readers see its events as they come
        from now on. No other instance can take a stream over while Redis does not answer
        (its claim goes through Redis too), so holding them back would stall every reader
        for the outage and protect nothing. A reader shown more than Redis confirmed is past
        the point from which a takeover is exact: if another instance takes the stream over
        before Redis has it (this one was cut off, not Redis), it gets `stream_lost`
        (`replicas.ahead`)."""
        if not self.durable or self.released:
            return
        self.released = True
        log_event("redis.durable_released", logging.WARNING, streams=len(self.replicas))
        for rep in self.replicas:
            rep.log.unhold()

    def hold_again(self) -> None:
        """Redis answers in time again: readers see only what it confirmed from now on; what
        they were shown meanwhile stays shown (ahead of Redis until it confirms it)."""
        if not self.released or not self.up or self._stalled:
            return
        self.released = False
        log_event("redis.durable_held", streams=len(self.replicas))
        for rep in self.replicas:
            rep.log.hold_from_next()

    def write_began(self) -> None:
        self._writing_since = anyio.current_time()
        self._flush_began.set()

    def write_ended(self, error: BaseException | None) -> None:
        """The flush in flight was answered (`error` None: Redis took it all) or failed."""
        self._writing_since = None
        self._stalled = False
        self.set_up(error is None, error)
        self.hold_again()

    async def watch_stalls(self) -> None:
        """`durable`: a flush whose reply has not come within `STALL_S` (Redis stopped,
        blocked by a big write, a network that drops without a reset) releases the readers
        as an outage does; its reply, or its failure, ends that."""
        while True:
            await self._flush_began.wait()
            self._flush_began = anyio.Event()
            since = self._writing_since
            if since is None:
                continue
            await anyio.sleep(max(0.0, since + STALL_S - anyio.current_time()))
            if self._writing_since == since and not self._stalled:
                self._stalled = True
                log_event("redis.slow", logging.WARNING, waited_s=STALL_S)
                self.release()

    async def retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call`, again with backoff until Redis answers (the store is down meanwhile)."""
        delay = RETRY_MIN_S
        while True:
            try:
                return await call()
            except REDIS_DOWN as exc:
                self.down(exc)
                await anyio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
