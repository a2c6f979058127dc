"""The operator's feed: one snapshot a second for every subscriber, and lines as they come.

Bounded whatever the load: one snapshot is built and encoded a second, whoever listens (no
subscriber: one every `IDLE_INTERVAL_S`, so the charts have their 15 minutes when a page opens,
at a fifth of the cost); each
subscriber holds at most `QUEUE_FRAMES` frames, and a reader that falls behind loses its oldest
frames (a snapshot is whole on its own: the next one repairs what was lost). Lines from the
log are encoded once for all subscribers and capped by `tap.MAX_FORWARD_PER_S`.

Events (docs/ops.md): `history` (the charts' points, once on connect), `snapshot` (each
second), `change` (a state that changed between two snapshots: a target ejected or back, the
breaker, shedding, a dependency, a reload), `log` (a log line worth seeing now).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson

from firsttoken.formats.sse import ServerSentEvent
from firsttoken.ops.snapshot import Family, Snapshots

__all__ = ["QUEUE_FRAMES", "OpsFeed", "Subscriber", "changes"]

QUEUE_FRAMES = 32
RETRY_MS = 1000  # EventSource reconnects after this long (a restarted gateway)
IDLE_INTERVAL_S = 5.0  # between snapshots while nobody listens


def frame(event: str, data: object) -> bytes:
    body = orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS, default=str).decode()
    return ServerSentEvent(data=body, event=event).encode()


class Subscriber:
    """One reader's frames waiting to be written, oldest dropped past `QUEUE_FRAMES`."""

    def __init__(self, first: list[bytes]) -> None:
        self.frames: deque[bytes] = deque(first, maxlen=QUEUE_FRAMES + len(first))
        self.lost = 0
        self.closed = False
        self._wakeup = asyncio.Event()
        self._wakeup.set()

    def close(self) -> None:
        """No more frames: the response ends once the ones waiting are written."""
        self.closed = True
        self._wakeup.set()

    def put(self, data: bytes) -> None:
        if len(self.frames) == self.frames.maxlen:
            self.lost += 1
        self.frames.append(data)
        self._wakeup.set()

    async def frames_due(self) -> AsyncIterator[bytes]:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self.frames:
                yield self.frames.popleft()
            if self.closed:
                return


class OpsFeed:
    """Ticks once a second: collects, builds one snapshot, hands its frame to everyone."""

    def __init__(
        self,
        collect: Callable[[], Awaitable[list[Family]]],
        errors: Callable[[], Awaitable[list[dict[str, Any]]]],
        clock: Callable[[], float],
        interval_s: float = 1.0,
        draining: Callable[[], bool] = lambda: False,
        ledger: bool = False,
    ) -> None:
        self.collect = collect
        self.draining = draining
        self.errors = errors
        self.clock = clock
        self.interval_s = interval_s
        self.snapshots = Snapshots(ledger)
        self.subscribers: set[Subscriber] = set()
        self.last: dict[str, Any] | None = None
        self._last_frame: bytes | None = None
        self._wakeup = asyncio.Event()

    async def run(self) -> None:
        while True:
            started = self.clock()
            await self.tick()
            # Nobody watching: a tick every IDLE_INTERVAL_S keeps the 15 minutes (coarser);
            # a subscriber wakes the loop at once.
            interval = self.interval_s if self.subscribers else IDLE_INTERVAL_S
            with anyio.move_on_after(max(0.05, interval - (self.clock() - started))):
                await self._wakeup.wait()
            self._wakeup.clear()

    async def tick(self) -> dict[str, Any]:
        families = await self.collect()
        snapshot = self.snapshots.build(families, self.clock(), await self.errors())
        for change in changes(self.last, snapshot):
            self.publish("change", change)
        self.last = snapshot
        self._last_frame = frame("snapshot", snapshot)
        for subscriber in self.subscribers:
            subscriber.put(self._last_frame)
        if self.draining():
            # The server is shutting down: let readers go (their EventSource reconnects to
            # whichever process answers next) rather than hold the shutdown for them.
            for subscriber in self.subscribers:
                subscriber.close()
            self.subscribers.clear()
        return snapshot

    def publish(self, event: str, data: object) -> None:
        if not self.subscribers:
            return
        encoded = frame(event, data)
        for subscriber in self.subscribers:
            subscriber.put(encoded)

    def heard(self, line: dict[str, Any]) -> None:
        """A log line forwarded by the tap (`LogTap.listener`)."""
        self.publish("log", line)

    def subscribe(self) -> Subscriber:
        first = [b"retry: %d\n\n" % RETRY_MS, frame("history", self.snapshots.history())]
        if self._last_frame is not None:
            first.append(self._last_frame)
        subscriber = Subscriber(first)
        if not self.subscribers:
            self._wakeup.set()  # from idle ticks to one a second
        self.subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)


def changes(before: dict[str, Any] | None, after: dict[str, Any]) -> list[dict[str, Any]]:
    """What changed between two snapshots that an operator would want told."""
    if before is None:
        return []
    out: list[dict[str, Any]] = []
    ts = after["ts"]
    for name, target in after["targets"].items():
        was = before["targets"].get(name)
        if was is not None and was["up"] != target["up"]:
            kind = "target_up" if target["up"] else "target_ejected"
            out.append({"ts": ts, "kind": kind, "target": name, "probe_in_s": target["probe_in_s"]})
    if before["breaker"] != after["breaker"]:
        out.append({"ts": ts, "kind": "breaker", "state": after["breaker"]})
    for reason, on in after["shedding"].items():
        if before["shedding"].get(reason, False) != on:
            out.append({"ts": ts, "kind": "shedding", "reason": reason, "on": on})
    for name, state in after["deps"].items():
        if before["deps"].get(name) != state and state is not None:
            out.append({"ts": ts, "kind": "dependency", "name": name, "state": state})
    for result, count in after["reloads"].items():
        if count > before["reloads"].get(result, 0):
            out.append({"ts": ts, "kind": "reload", "result": result})
    return out
