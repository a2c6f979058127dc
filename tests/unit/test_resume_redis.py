"""The Redis store as its parts make it (`firsttoken/resume/redis.py`), without I/O: a stream
opened, taken over, finished or deleted reaches each part it concerns, and /metrics reads
them all. Each part's own rules are in its module's tests (tests/unit/test_resume_*.py)."""

from __future__ import annotations

import anyio

from firsttoken.eventlog import EventLog
from firsttoken.resume.store import StreamRecord
from tests.unit import virtual_loop
from tests.unit.replicated import TTL_S, confirm, events_of, flush, replicate, store


def metric(s: object, name: str) -> float:
    (found,) = [m for m in s.collect() if m.name == name]  # type: ignore[attr-defined]
    return found.samples[0].value


def test_a_stream_opened_while_redis_is_away_waits_for_the_flusher_not_for_its_meta() -> None:
    s = store()
    assert "s1" in s._replicas.dirty and not s._replicas["s1"].meta_done

    async def body() -> float:
        started = anyio.current_time()
        await s.registered("s1")
        return anyio.current_time() - started

    assert virtual_loop.run(body()) == 0  # nothing to wait for: the flusher writes it


def test_a_stream_taken_over_is_written_from_its_next_event_with_its_new_fence() -> None:
    s = store()
    log = EventLog(100)
    for seq in range(1, 6):
        log.append(b"e%d" % seq, 1)  # what Redis held when it was claimed
    s.adopt(StreamRecord("s2", "native", "d", "t", "m", b"{}"), TTL_S, log, fence=3)
    s.let_go("s1", flush=False)
    rep = s._replicas["s2"]
    assert rep.meta_done and rep.flushed == 5 and s.backlog() == 0
    log.append(b"e6", 1)
    log.append(b"e7", 1)
    s._replicas.by_id["s1"] = rep  # `flush` reads stream s1
    args = flush(s)
    assert args["fence"] == 3 and [seq for seq, _, _ in events_of(args)] == [6, 7]


def test_a_finished_stream_is_let_go_and_forgotten_at_its_ttl() -> None:
    s = store()
    replicate(s, 1, 2)
    s.finish("s1", "completed", 2, TTL_S)
    assert s._replicas["s1"].end == ("completed", 2)
    flush(s)
    confirm(s, 1)
    s._replicas.clock = lambda: 1e12
    s._heartbeat.before_beat()  # each heartbeat forgets what expired
    assert "s1" not in s._replicas
    s.finish("s1", "completed", 2, TTL_S)  # not here any more: nothing to do
    assert not s.let_go("s1", flush=True)


def test_metrics_read_every_part() -> None:
    s = store(max_events=8)
    replicate(s, 1, 20)
    s.up = True
    s._health.down(ConnectionError("gone"))
    s._flusher.fenced = 2
    s._sweeper.swept = 3
    s._evictions.evicted = 4
    assert metric(s, "firsttoken_redis_up") == 0
    assert metric(s, "firsttoken_redis_backlog_events") == 8
    assert metric(s, "firsttoken_redis_events_dropped") == 12
    assert metric(s, "firsttoken_redis_kept_streams") == 1
    assert metric(s, "firsttoken_redis_followed_streams") == 0
    assert metric(s, "firsttoken_redis_fenced_writes") == 2
    assert metric(s, "firsttoken_redis_orphans_swept") == 3
    assert metric(s, "firsttoken_redis_outages") == 1
    assert metric(s, "firsttoken_redis_keys_evicted") == 4
    assert s.degraded == "redis"


def test_whom_a_fenced_stream_is_told_to_is_the_flushers() -> None:
    s = store()
    told: list[str] = []
    s.on_fenced = lambda stream_id, kept, lost: told.append(stream_id)
    assert s._flusher.on_fenced is s.on_fenced
    replicate(s, 1, 1)
    flush(s)
    confirm(s, b"fenced")
    assert told == ["s1"]


def test_a_heartbeat_answered_while_down_sends_the_flusher_to_recover() -> None:
    s = store()  # down, as the store counts it
    s._replicas.wake = anyio.Event()
    anyio.run(s._beat_answered)
    assert s._replicas.wake.is_set() and s._flusher._answering.is_set()
