"""The Redis store as its parts make it (`firsttoken/resume/redis.py`), without I/O: a stream
opened, taken over, finished or deleted reaches each part it concerns, and /metrics reads
them all. Each part's own rules are in its module's tests (tests/unit/test_resume_*.py)."""

from __future__ import annotations

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from firsttoken.eventlog import EventLog
from firsttoken.formats.errors import APIError
from firsttoken.resume.redis import RedisStore
from firsttoken.resume.store import StreamRecord
from tests.unit import virtual_loop
from tests.unit.replicated import TTL_S, confirm, events_of, flush, replicate, store


def metric(s: object, name: str) -> float:
    (found,) = [m for m in s.collect() if m.name == name]  # type: ignore[attr-defined]
    return found.samples[0].value


def test_the_shared_tail_out_of_connections_leaves_the_store_up() -> None:
    """A burst of readers of other instances' streams (1,000 resumes at once on four
    connections) made the tail's reads wait past the pool's wait: the store was marked down."""
    s = store()
    s.up = True
    try:
        raise RedisConnectionError("No connection available.") from TimeoutError()
    except RedisConnectionError as exc:
        s._tailer.on_error(exc)
    assert s.up and s.outages == 0
    s._tailer.on_error(RedisConnectionError("Error 111 connecting to 127.0.0.1:6379."))
    assert not s.up and s.outages == 1


class _Metas:
    """Redis as `lookup` sees it: the metas it holds (`held`, from the virtual time each
    lands), and how long each answer takes (`slow`: one entry per call, then at once)."""

    def __init__(self, held: dict[str, float], slow: list[float] | None = None) -> None:
        self.held = held
        self.slow = slow or []
        self.calls: list[float] = []

    async def hmget(self, key: str, fields: list[str]) -> list[bytes | None]:
        self.calls.append(anyio.current_time())
        if self.slow:
            await anyio.sleep(self.slow.pop(0))
        stream_id = key.split(":")[2]
        lands = self.held.get(stream_id)
        if lands is None or anyio.current_time() < lands:
            return [None] * len(fields)
        return [b"native", b"digest", b"trace", b"model", b"tenant"]


def looked_up(s: RedisStore, stream_id: str) -> tuple[StreamRecord | None, float]:
    async def body() -> tuple[StreamRecord | None, float]:
        started = anyio.current_time()
        found = await s.lookup(stream_id)
        return found, anyio.current_time() - started

    return virtual_loop.run(body())


OURS = "0123456789abcdef0123456789abcdef"  # as `new_stream_id` makes them


def test_a_stream_not_found_yet_is_found_once_its_owners_meta_lands() -> None:
    """Its owner hands its id out before the meta lands (no create waits for Redis): the
    instance asked for it meanwhile asks Redis again, not answers "no such stream"."""
    s = store()
    metas = _Metas({OURS: virtual_loop.START + 0.25})
    s.redis = metas  # type: ignore[assignment]  # a Redis that only holds metas
    found, waited = looked_up(s, OURS)
    assert found is not None and (found.format, found.tenant) == ("native", "tenant")
    assert round(waited, 6) == 0.3 and len(metas.calls) == 4  # after 50, 100, 150 ms


def test_an_unknown_stream_is_unknown_after_a_second_and_a_foreign_id_at_once() -> None:
    s = store()
    metas = _Metas({})
    s.redis = metas  # type: ignore[assignment]
    assert looked_up(s, OURS) == (None, 1.0)
    assert len(metas.calls) == 7
    assert looked_up(s, "not-one-of-ours") == (None, 0.0)  # never ours: nothing to wait for
    assert len(metas.calls) == 8


def test_a_lookup_that_runs_out_of_time_is_tried_again_and_never_takes_the_store_down() -> None:
    """500 resumes at once through another instance: on the starved loop their lookups ran
    past the deadline though Redis answered, and each marked the store down for everyone."""
    s = store()
    s.up = True
    s.redis = _Metas({OURS: 0.0}, slow=[5.0])  # type: ignore[assignment]
    found, waited = looked_up(s, OURS)
    assert found is not None and waited == 1.0  # the second try answered at once
    s.redis = _Metas({OURS: 0.0}, slow=[5.0, 5.0])  # type: ignore[assignment]
    with pytest.raises(APIError) as raised:
        looked_up(s, OURS)
    assert (raised.value.status, raised.value.code) == (503, "store_unavailable")
    assert s.up and s.outages == 0


def test_a_lookup_refused_by_redis_takes_the_store_down() -> None:
    class Refused(_Metas):
        async def hmget(self, key: str, fields: list[str]) -> list[bytes | None]:
            self.calls.append(anyio.current_time())
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Refused.")

    s = store()
    s.up = True
    s.redis = refused = Refused({})  # type: ignore[assignment]
    with pytest.raises(APIError):
        looked_up(s, OURS)
    assert not s.up and s.outages == 1 and len(refused.calls) == 1  # no second try


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
