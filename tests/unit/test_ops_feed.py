"""The feed: one snapshot built per tick for every subscriber, bounded queues, changes."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from firsttoken.formats.sse import EventDecoder
from firsttoken.ops.feed import QUEUE_FRAMES, OpsFeed, changes
from firsttoken.telemetry.metrics import Metrics
from tests.unit.clock import FakeClock


def feed_of(metrics: Metrics, clock: FakeClock) -> tuple[OpsFeed, list[int]]:
    builds: list[int] = []

    async def collect() -> list[Any]:
        builds.append(1)
        return [
            [f.name, f.type, f.documentation, [[s.name, s.labels, s.value] for s in f.samples]]
            for f in metrics.registry.collect()
        ]

    async def errors() -> list[dict[str, Any]]:
        return []

    return OpsFeed(collect, errors, clock), builds


def events(frames: list[bytes]) -> list[tuple[str | None, Any]]:
    decoder = EventDecoder()
    out = []
    for data in frames:
        for event in decoder.feed(data):
            out.append((event.event, orjson.loads(event.data or "null")))
    return out


def test_one_snapshot_per_tick_whoever_listens() -> None:
    clock, metrics = FakeClock(), Metrics()
    feed, builds = feed_of(metrics, clock)
    subscribers = [feed.subscribe() for _ in range(3)]
    asyncio.run(feed.tick())
    assert len(builds) == 1
    frames = [list(s.frames) for s in subscribers]
    assert frames[0] == frames[1] == frames[2]  # the same bytes, encoded once
    assert frames[0][0] == b"retry: 1000\n\n"
    assert [e for e, _ in events(frames[0])] == ["history", "snapshot"]


def test_a_new_subscriber_gets_the_history_and_the_last_snapshot_at_once() -> None:
    clock, metrics = FakeClock(), Metrics()
    feed, _ = feed_of(metrics, clock)
    for _ in range(3):
        asyncio.run(feed.tick())
        clock.advance(1)
    late = feed.subscribe()
    got = events(list(late.frames))
    assert got[0][0] == "history" and len(got[0][1]) == 3
    assert got[1][0] == "snapshot" and got[1][1]["ts"] == 1002.0


def test_a_slow_reader_loses_its_oldest_frames_only() -> None:
    clock, metrics = FakeClock(), Metrics()
    feed, _ = feed_of(metrics, clock)
    slow = feed.subscribe()
    for _ in range(QUEUE_FRAMES * 3):
        asyncio.run(feed.tick())
        clock.advance(1)
    assert len(slow.frames) <= QUEUE_FRAMES + 2 and slow.lost > 0
    last = events(list(slow.frames))[-1]
    assert last[0] == "snapshot" and last[1]["ts"] == 1000.0 + QUEUE_FRAMES * 3 - 1


def test_unsubscribed_readers_get_nothing_and_log_lines_need_a_reader() -> None:
    clock, metrics = FakeClock(), Metrics()
    feed, _ = feed_of(metrics, clock)
    feed.heard({"event": "shed.start"})  # nobody: not even encoded
    reader = feed.subscribe()
    feed.unsubscribe(reader)
    asyncio.run(feed.tick())
    assert [e for e, _ in events(list(reader.frames))] == ["history"]


def test_frames_due_waits_for_frames() -> None:
    async def main() -> list[bytes]:
        clock, metrics = FakeClock(), Metrics()
        feed, _ = feed_of(metrics, clock)
        reader = feed.subscribe()
        got: list[bytes] = []

        async def read() -> None:
            async for data in reader.frames_due():
                got.append(data)
                if len(got) == 3:
                    return

        task = asyncio.ensure_future(read())
        await asyncio.sleep(0)
        assert len(got) == 2  # retry and history at once
        feed.heard({"event": "route.failover"})
        await asyncio.wait_for(task, 1)
        return got

    got = asyncio.run(main())
    assert b"event: log" in got[2]


def snapshot(**parts: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "ts": 1.0,
        "targets": {"a": {"up": True, "probe_in_s": None}},
        "breaker": "closed",
        "shedding": {"ttft": False},
        "deps": {"redis": "up", "otel": None},
        "reloads": {"ok": 1.0},
    }
    return {**base, **parts}


def test_changes_between_snapshots() -> None:
    before = snapshot()
    after = snapshot(
        targets={"a": {"up": False, "probe_in_s": 10.0}},
        breaker="open",
        shedding={"ttft": True},
        deps={"redis": "away", "otel": None},
        reloads={"ok": 2.0},
    )
    kinds = [c["kind"] for c in changes(before, after)]
    assert kinds == ["target_ejected", "breaker", "shedding", "dependency", "reload"]
    assert changes(after, before)[0]["kind"] == "target_up"
    assert changes(None, after) == [] and changes(before, before) == []


def test_idle_ticks_are_sparse_and_a_subscriber_wakes_the_feed() -> None:
    async def main() -> list[float]:
        metrics = Metrics()
        loop = asyncio.get_running_loop()
        feed, _ = feed_of(metrics, FakeClock())
        feed.clock = loop.time
        feed.interval_s = 0.05
        ticks: list[float] = []
        tick = feed.tick

        async def counted() -> dict[str, Any]:
            ticks.append(loop.time())
            return await tick()

        feed.tick = counted  # type: ignore[method-assign]
        runner = asyncio.ensure_future(feed.run())
        await asyncio.sleep(0.3)
        idle = len(ticks)
        feed.subscribe()
        await asyncio.sleep(0.3)
        runner.cancel()
        return [idle, len(ticks) - idle]

    idle, watched = asyncio.run(main())
    assert idle == 1  # the first, then nothing for IDLE_INTERVAL_S
    assert watched >= 3  # one per interval_s (0.05 s) once someone listens


def test_a_draining_server_lets_its_readers_go() -> None:
    async def main() -> list[bytes]:
        clock, metrics = FakeClock(), Metrics()
        feed, _ = feed_of(metrics, clock)
        draining = {"on": False}
        feed.draining = lambda: draining["on"]
        reader = feed.subscribe()
        await feed.tick()
        draining["on"] = True
        await feed.tick()
        got = [data async for data in reader.frames_due()]  # ends: the response closes
        assert not feed.subscribers
        return got

    got = asyncio.run(main())
    assert [e for e, _ in events(got)] == ["history", "snapshot", "snapshot"]
