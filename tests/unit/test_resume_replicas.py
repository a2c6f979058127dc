"""The owned streams (`firsttoken/resume/replicas.py`): what is dirty, what Redis lacks, what
fell off a log's bound before Redis had it, and when an ended stream is forgotten (on a fake
clock)."""

from __future__ import annotations

from functools import partial

from firsttoken.eventlog import EventLog
from firsttoken.resume.redis_keys import events_key, meta_key
from firsttoken.resume.replicas import Replicas
from firsttoken.resume.store import StreamRecord
from tests.unit.clock import FakeClock

TTL_S = 60.0


def owned(count: int = 1, max_events: int = 100) -> tuple[Replicas, FakeClock]:
    clock = FakeClock()
    replicas = Replicas(flush_interval_s=0.05, clock=clock)
    for i in range(count):
        record = StreamRecord(f"s{i + 1}", "native", "d", "t", "m")
        replicas.add(record, TTL_S, EventLog(max_events), hold=False)
    return replicas, clock


def append(replicas: Replicas, first: int, last: int, sid: str = "s1") -> None:
    log = replicas[sid].log
    for seq in range(first, last + 1):
        assert log.append(b"e%d" % seq, 1) == seq


def test_a_stream_is_marked_dirty_once_by_its_first_new_event() -> None:
    replicas, _ = owned()
    rep = replicas["s1"]
    assert (rep.key, rep.meta) == (events_key("s1"), meta_key("s1"))
    assert not replicas.dirty and not replicas.wake.is_set()
    append(replicas, 1, 1)
    assert replicas.dirty == {"s1": rep} and replicas.wake.is_set()
    assert rep.log.on_append is None  # the log tells it once: nothing more per token
    append(replicas, 2, 3)
    assert replicas.dirty == {"s1": rep}


def test_taking_a_batch_leaves_the_rest_dirty_and_what_comes_after_marks_again() -> None:
    replicas, _ = owned(5)
    for i in range(5):
        append(replicas, 1, 1, f"s{i + 1}")
    batch = replicas.take(3)
    assert [rep.record.id for rep in batch] == ["s1", "s2", "s3"]
    assert list(replicas.dirty) == ["s4", "s5"] and not any(rep.queued for rep in batch)
    append(replicas, 2, 2, "s1")
    assert list(replicas.dirty) == ["s4", "s5", "s1"]


def test_release_keeps_only_what_redis_lacks_and_expiry_follows_the_clock() -> None:
    replicas, clock = owned()
    append(replicas, 1, 6)
    rep = replicas["s1"]
    rep.flushed = rep.sent = 4
    rep.meta_done = True
    replicas.finish(rep, "completed", 6, TTL_S)
    replicas.release("s1")
    assert replicas["s1"].log.run_after(0)[:2] == (5, [b"e5", b"e6"])
    assert replicas.backlog() == 2
    clock.advance(TTL_S - 1)
    replicas.expire()
    assert "s1" in replicas
    clock.advance(1)
    replicas.expire()
    assert "s1" not in replicas and not replicas.dirty
    assert rep.log.on_append is None and not isinstance(rep.wanted, partial)  # no cycle left


def test_a_stream_let_go_stays_until_redis_has_its_last_event() -> None:
    replicas, clock = owned()
    append(replicas, 1, 3)
    rep = replicas["s1"]
    replicas.let_go(rep, b"10 3 0")
    assert rep.billed == b"10 3 0" and "s1" in replicas.dirty
    replicas.expire()
    assert "s1" in replicas  # events still to write: looked at again a flush later
    rep.flushed, rep.meta_done, rep.billed = 3, True, b""
    clock.advance(0.05)
    replicas.expire()
    assert "s1" not in replicas


def test_events_that_fell_off_the_bound_unconfirmed_are_counted_once() -> None:
    replicas, _ = owned(max_events=8)
    append(replicas, 1, 20)
    rep = replicas["s1"]
    rep.flushed = 2
    assert (rep.first, rep.unconfirmed()) == (13, 8)
    assert replicas.count_all_lost() == 10  # 3..12
    assert replicas.count_all_lost() == 10
    append(replicas, 21, 22)
    replicas.count_lost(rep)
    assert replicas.events_dropped == 12


def test_a_durable_stream_shows_its_readers_only_what_the_log_held_when_it_was_added() -> None:
    clock = FakeClock()
    replicas = Replicas(flush_interval_s=0.05, clock=clock)
    log = EventLog(100)
    log.append(b"e1", 1)  # what Redis held when it was claimed
    replicas.add(StreamRecord("s1", "native", "d", "t", "m"), TTL_S, log, hold=True)
    log.append(b"e2", 1)
    assert [e.seq for e in log.after(0)] == [1]


def test_ended_streams_to_write_again_go_a_few_at_a_time_the_newest_first() -> None:
    replicas, clock = owned(4)
    for i in range(4):
        append(replicas, 1, 5, f"s{i + 1}")
    replicas.take(4)
    for i in range(4):
        replicas.finish(replicas[f"s{i + 1}"], "done", 5, 1.0 + i)
    replicas.take(4)
    replicas.mark_later([replicas[f"s{i + 1}"] for i in range(4)])
    # Five events and an end each: 12 of them is two streams, the newest first.
    assert replicas.mark_some(12) == 2
    assert list(replicas.dirty) == ["s4", "s3"]
    replicas.take(4)
    clock.advance(1.5)
    replicas.expire()  # s1's TTL ran out meanwhile: skipped, not written again
    assert "s1" not in replicas
    assert replicas.mark_some(12) == 0
    assert list(replicas.dirty) == ["s2"]
    assert replicas.mark_some(12) == 0 and list(replicas.dirty) == ["s2"]
