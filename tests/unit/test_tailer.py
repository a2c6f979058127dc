"""The shared tail (`firsttoken/resume/tailer.py`): runs read from Redis into a mirror's log, and
the owners' liveness judged on a fake clock (when a stream is taken over, when lost)."""

from __future__ import annotations

import json

from firsttoken.eventlog import EventLog
from firsttoken.resume import Resumed
from firsttoken.resume.runs import encode_run
from firsttoken.resume.tailer import Follower, Tailer, apply_entries


def run(first: int, last: int) -> tuple[bytes, dict[bytes, bytes]]:
    wires = [f"id: {s}\ndata: {s}\n\n".encode() for s in range(first, last + 1)]
    fields = {k.encode(): v if isinstance(v, bytes) else str(v).encode()
              for k, v in encode_run(first, wires, {}).items()}  # fmt: skip
    return f"{last}-0".encode(), fields


def end(last: int) -> tuple[bytes, dict[bytes, bytes]]:
    return f"{last}-1".encode(), {b"end": b"completed"}


def datas(log: EventLog) -> list[str]:
    return [e.wire.decode().split("data: ", 1)[1].strip() for e in log.after(log.first_seq - 1)]


def test_runs_fill_the_log_in_order_and_the_end_closes_it() -> None:
    log = EventLog()
    assert not apply_entries([run(1, 3), run(4, 4)], log)
    assert apply_entries([run(5, 6), end(6)], log)
    assert log.closed and datas(log) == [str(s) for s in range(1, 7)]


def test_overlapping_runs_and_a_resume_mid_run_repeat_nothing() -> None:
    log = EventLog()
    log.begin_at(2)  # a reader that has events 1 and 2
    # A run resent whole after a lost reply overlaps the one before it.
    assert not apply_entries([run(1, 4), run(3, 6), run(1, 6)], log)
    assert log.last_seq == 6 and datas(log) == ["3", "4", "5", "6"]


def test_a_hole_in_what_the_store_kept_ends_the_log_with_an_error() -> None:
    log = EventLog()
    assert apply_entries([run(1, 3), run(6, 8), run(9, 9)], log)
    assert log.closed and log.last_seq == 4  # three events, then the error
    error = json.loads(log.after(3)[0].wire.decode().split("data: ", 1)[1])
    assert error["error"]["code"] == "stream_lost"
    assert "events 4 to 5" in error["error"]["message"]


def test_a_stream_a_survivor_swept_ends_with_stream_lost() -> None:
    """Its owner died and nobody took it over: its reader is told, not given a clean end."""
    log = EventLog()
    assert apply_entries([run(1, 3), (b"3-1", {b"end": b"orphaned"})], log)
    assert log.closed and log.last_seq == 4
    error = json.loads(log.after(3)[0].wire.decode().split("data: ", 1)[1])
    assert error["error"]["code"] == "stream_lost"


def follower(takeover: bool) -> Follower:
    return Follower(
        key="ft:{g}:s:events",
        presence_key="ft:{g}:s:readers",
        owner_key="ft:instance:a",
        log=EventLog(),
        last=(0, 0),
        takeover=takeover,
    )


def tailer() -> Tailer:
    return Tailer(None, "b", on_error=lambda exc: None, presence_ms=3000, owner_gone_s=2.0)


def test_a_stream_that_can_be_taken_over_is_orphaned_at_the_first_check_its_owner_misses() -> None:
    t = tailer()
    f = follower(takeover=True)
    t._judge([f], {"ft:instance:a": 1}, now=10.0)
    assert not f.done.is_set()
    t._judge([f], {"ft:instance:a": 0}, now=10.25)
    # Ended for the takeover: nothing said to its reader yet (the claim decides).
    assert f.done.is_set() and f.orphaned and not f.log.closed


def test_an_owner_key_missing_just_after_redis_failed_a_read_is_not_taken_for_dead() -> None:
    """A cluster's failover lost the owner's last write of its key, and the owner could not
    write it meanwhile: the live stream was taken over from under its owner's readers (they
    ended short). Judged once the owner has had `owner_gone_s` to write it again."""
    t = tailer()
    f = follower(takeover=True)
    t._failed(ConnectionError("the master went away"), now=10.0)
    t._judge([f], {"ft:instance:a": 0}, now=10.25)
    t._judge([f], {"ft:instance:a": 0}, now=11.9)
    assert not f.done.is_set() and not f.log.closed
    t._judge([f], {"ft:instance:a": 1}, now=12.1)  # back: nothing to do
    assert not f.done.is_set()
    t._judge([f], {"ft:instance:a": 0}, now=12.35)  # gone for real now: the claim decides
    assert f.orphaned


def test_events_heard_since_the_last_check_keep_an_owner_alive() -> None:
    """A busy owner whose key lapsed still writes: not taken over on that check."""
    t = tailer()
    f = follower(takeover=True)
    f.heard = True
    t._judge([f], {"ft:instance:a": 0}, now=10.0)
    assert not f.done.is_set() and not f.heard
    t._judge([f], {"ft:instance:a": 0}, now=10.25)
    assert f.orphaned


def test_a_stream_that_cannot_be_taken_over_is_lost_once_its_owner_stays_missing() -> None:
    t = tailer()
    f = follower(takeover=False)
    t._judge([f], {"ft:instance:a": 0}, now=10.0)
    t._judge([f], {"ft:instance:a": 0}, now=11.9)
    assert not f.done.is_set()
    t._judge([f], {"ft:instance:a": 0}, now=12.0)
    assert f.done.is_set() and not f.orphaned
    error = json.loads(f.log.after(0)[0].wire.decode().split("data: ", 1)[1])
    assert error["error"]["code"] == "stream_lost"


def test_an_owner_back_before_its_grace_keeps_its_stream() -> None:
    t = tailer()
    f = follower(takeover=False)
    t._judge([f], {"ft:instance:a": 0}, now=10.0)
    t._judge([f], {"ft:instance:a": 1}, now=11.0)  # a Redis restart: the key is back
    t._judge([f], {"ft:instance:a": 0}, now=12.5)
    assert not f.done.is_set()


def owned_run(first: int, last: int, base: int) -> tuple[bytes, dict[bytes, bytes]]:
    """A run of the events another owner made, numbered from `base` (`sse.ids_from`)."""
    wires = [f"id: {base + s}\ndata: {s}\n\n".encode() for s in range(first, last + 1)]
    fields = {k.encode(): v if isinstance(v, bytes) else str(v).encode()
              for k, v in encode_run(first, wires, {}).items()}  # fmt: skip
    return f"{last}-0".encode(), fields


def resumed_log(seq: int) -> EventLog:
    log = EventLog()
    log.begin_at(seq)
    return log


def test_a_reader_back_with_the_stores_event_reads_on() -> None:
    log, resumed = resumed_log(5), Resumed(5, 5)
    assert not apply_entries([run(1, 3)], log, resumed)  # before its event: not yet known
    assert not resumed.checked
    assert not apply_entries([run(4, 7)], log, resumed)
    assert resumed.checked and datas(log) == ["6", "7"]


def test_a_reader_back_with_an_event_the_store_never_got_is_told() -> None:
    """It read events 4-6 on A before A died; Redis held 1-3; B took over and made its own
    4, 5, 6...: the store's event 5 is not the reader's."""
    log, resumed = resumed_log(5), Resumed(5, 5)
    assert apply_entries([owned_run(4, 9, 2 * 10**12)], log, resumed)
    assert log.closed and log.last_seq == 6  # nothing but the error
    error = json.loads(log.after(5)[0].wire.decode().split("data: ", 1)[1])
    assert error["error"]["code"] == "stream_lost"


def test_a_stream_that_ended_before_the_readers_event_is_lost_to_it() -> None:
    log, resumed = resumed_log(5), Resumed(5, 5)
    assert apply_entries([end(3)], log, resumed)
    assert b"stream_lost" in log.after(5)[0].wire


def test_a_reader_of_the_new_owner_reads_on_past_the_takeover() -> None:
    base = 2 * 10**12
    log, resumed = resumed_log(5), Resumed(5, base + 5)
    assert not apply_entries([owned_run(4, 6, base)], log, resumed)
    assert resumed.checked and datas(log) == ["6"]
    assert apply_entries([end(6)], log, resumed) and log.closed
