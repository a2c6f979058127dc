"""This instance's liveness, as other instances read it.

`ft:instance:<n>` lives `INSTANCE_MS` and is rewritten every `LIVENESS_S` by a thread of its
own (`redisclient.Liveness`: a busy event loop does not make an owner look dead); a reader
elsewhere of a stream whose owner's key is gone takes it over. `ft:instances` lists every
instance that heartbeats, for the survivors that sweep a dead one's streams (`sweeper.py`);
`ft:{g}:owned:<n>` are the streams it owns (written with their metas, `metas.py`). An
instance that hands its streams over, or exits, deletes its key and leaves the set, its owned
sets with it: nothing of it is to be swept.

Once a second the event loop's own heartbeat writes the key and the set too (a Redis that
restarted empty has them back at once), and tells the store how Redis is (`on_beat`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from firsttoken.redisclient import REDIS_DOWN, AnyRedis, Liveness
from firsttoken.resume.health import OP_TIMEOUT_S, Health
from firsttoken.resume.redis_keys import TAGS, owned_key

__all__ = ["INSTANCES", "OWNER_GONE_S", "Heartbeat", "instance_key"]

INSTANCES = "ft:instances"
INSTANCE_MS = 1200
LIVENESS_S = 0.2
# A stream that cannot be taken over is lost once its owner's key has been missing this long
# past its lapse (a Redis that restarted empty has it back within LIVENESS_S).
OWNER_GONE_S = 2.0
BEAT_S = 1.0


def instance_key(instance: str) -> str:
    return f"ft:instance:{instance}"


async def _nothing() -> None:
    return None


class Heartbeat:
    """Writes this instance's liveness (a thread) and its place in `ft:instances` (the loop),
    until it hands its streams over (`handed_over`) or leaves."""

    def __init__(
        self, redis: AnyRedis, url: str, instance: str, health: Health, *, cluster: bool
    ) -> None:
        self.redis = redis
        self.instance = instance
        self.health = health
        self.key = instance_key(instance)
        self.handed_over = False  # a drain let its liveness key go (`hand_over`)
        # What a beat Redis answered does next (the store: evictions, a recovery, failovers).
        self.on_beat: Callable[[], Awaitable[None]] = _nothing
        # Before each beat, whatever Redis does (the store: forget expired streams).
        self.before_beat: Callable[[], None] = lambda: None
        self._liveness = Liveness(
            url, self.key, cluster=cluster, ttl_ms=INSTANCE_MS, every_s=LIVENESS_S
        )

    def start(self) -> None:
        self._liveness.start()

    async def once(self) -> None:
        if self.handed_over:
            return
        await self.redis.set(self.key, 1, px=INSTANCE_MS)
        await self.redis.sadd(INSTANCES, self.instance)

    async def beat_forever(self) -> None:
        while True:
            await anyio.sleep(BEAT_S)
            self.before_beat()  # also when no stream is writing
            try:
                with anyio.fail_after(OP_TIMEOUT_S * 2):
                    await self.once()
            except REDIS_DOWN as exc:
                self.health.down(exc)
                continue
            await self.on_beat()

    async def hand_over(self) -> None:
        """Let readers elsewhere take this instance's streams over now: its key goes, and it
        leaves the instances (it bills what it generated itself: not to be swept)."""
        self.handed_over = True
        await self.stop()

    async def stop(self) -> None:
        """Gone on purpose, after the last write: a reader elsewhere takes the streams over
        now, not once the key lapses."""
        await anyio.to_thread.run_sync(self._liveness.stop)
        await self.leave()

    async def leave(self) -> None:
        """Not a dead instance, nothing of it to sweep (what it hands over at a drain its own
        record bills; a claim bills the rest)."""
        with anyio.move_on_after(OP_TIMEOUT_S):
            try:
                await self.redis.srem(INSTANCES, self.instance)
                await self.redis.delete(*(owned_key(tag, self.instance) for tag in TAGS))
            except REDIS_DOWN:
                pass  # a survivor sweeps what it left unended: nothing it had not billed
