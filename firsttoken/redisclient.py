"""The Redis client every Redis user here shares the settings of: fail fast while it is away."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

__all__ = ["redis_client"]


def redis_client(url: str) -> Redis:
    """One quick retry, bounded connects and reads: redis-py's default retries ten times
    with backoff, which is seconds per call on the request path while Redis is down."""
    return Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
        socket_connect_timeout=1.0,
        socket_timeout=5.0,  # above the 1 s block of the store's XREAD
        health_check_interval=5,
    )
