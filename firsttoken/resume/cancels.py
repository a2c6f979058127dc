"""Cancels across instances: a stream's id on the `ft:cancel` channel, heard by its owner.

The instance that is asked publishes the id and waits (at most 5 s) for the stream's outcome
to show in its meta; every instance listens, and its registry stops the streams it owns
(`on_cancel`). The listener subscribes again after any failure: it must never end the server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import anyio
from anyio.abc import TaskStatus

from firsttoken.redisclient import REDIS_DOWN, AnyRedis
from firsttoken.resume.health import OP_TIMEOUT_S, RETRY_MIN_S, Health, unavailable
from firsttoken.resume.redis_keys import meta_key

__all__ = ["CANCEL", "Cancels"]

CANCEL = "ft:cancel"
_OUTCOME_WAIT_S = 5.0
_OUTCOME_POLL_S = 0.02


class Cancels:
    def __init__(self, redis: AnyRedis, health: Health) -> None:
        self.redis = redis
        self.health = health

    async def cancel(self, stream_id: str) -> str | None:
        """Ask the stream's owner to stop it; its outcome once that shows (None: not yet)."""
        try:
            with anyio.fail_after(OP_TIMEOUT_S):
                await self.redis.publish(CANCEL, stream_id)
        except REDIS_DOWN as exc:
            self.health.failed(exc)  # a request's call: its timeout is its own
            raise unavailable("the cancel could not reach the stream's instance") from None
        with anyio.move_on_after(_OUTCOME_WAIT_S):
            while True:
                try:
                    outcome = await self.redis.hget(meta_key(stream_id), "outcome")
                except REDIS_DOWN:
                    outcome = None
                if outcome:
                    return cast(bytes, outcome).decode()  # a raw reply
                await anyio.sleep(_OUTCOME_POLL_S)
        return None

    async def listen(self, on_cancel: Callable[[str], None], task_status: TaskStatus[None]) -> None:
        started = False
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(CANCEL)
                if not started:
                    started = True
                    task_status.started()
                async for message in pubsub.listen():
                    if message and message.get("type") == "message":
                        on_cancel(message["data"].decode())
            except Exception as exc:
                # Not only REDIS_DOWN: redis-py 8.1's cluster pub/sub raised AttributeError
                # when its node died under it, and the listener must not end the server.
                if not started:
                    raise
                self.health.down(exc)
                await anyio.sleep(RETRY_MIN_S * 5)  # then subscribe again
            finally:
                with anyio.CancelScope(shield=True):
                    try:
                        # redis-py leaves PubSub.aclose unannotated.
                        await pubsub.aclose()  # type: ignore[no-untyped-call]
                    except Exception:
                        pass  # its connection is gone already
