from __future__ import annotations

import pytest

from firsttoken.resume import Event, EventLog, ResumeExpired


class Reader:
    def __init__(self, cursor: int = 0) -> None:
        self.cursor = cursor
        self.seen: list[int] = []
        self.closed = False
        self.catch_ups = 0
        self.keep_up = True

    def deliver(self, seq: int, wire: bytes, tokens: int) -> None:
        self.seen.append(seq)
        if self.keep_up:
            self.cursor = seq

    def log_closed(self) -> None:
        self.closed = True

    def catch_up(self) -> None:
        self.catch_ups += 1


def test_events_are_numbered_and_replayed_after_a_cursor() -> None:
    log = EventLog(max_events=10)
    for i in range(5):
        assert log.append(b"e%d" % i, 1) == i + 1
    assert log.after(3) == [Event(4, b"e3", 1), Event(5, b"e4", 1)]
    assert log.after(5) == []
    assert [e.seq for e in log.after(0, limit=2)] == [1, 2]


def test_a_cursor_older_than_the_buffer_is_expired() -> None:
    log = EventLog(max_events=3)
    for _ in range(5):
        log.append(b"x", 1)
    assert log.first_seq == 3
    with pytest.raises(ResumeExpired):
        log.after(1)
    assert [e.seq for e in log.after(2)] == [3, 4, 5]


def test_appends_are_handed_to_every_reader_in_the_call() -> None:
    log = EventLog()
    a, b = Reader(), Reader()
    log.attach(a)
    log.attach(b)
    log.append(b"x", 1)
    assert a.seen == b.seen == [1]
    log.close()
    assert a.closed and b.closed


def test_the_window_is_measured_from_the_slowest_reader() -> None:
    log = EventLog(max_events=100, window=3)
    fast, slow = Reader(), Reader()
    slow.keep_up = False
    log.attach(fast)
    log.attach(slow)
    log.append(b"1")
    log.append(b"2")
    assert log.has_room()
    log.append(b"3")
    assert not log.has_room()  # the slow reader is 3 behind
    resumed: list[bool] = []
    log.on_room = lambda: resumed.append(True)
    slow.cursor = 2
    log.advanced()
    assert resumed == [True] and log.on_room is None


def test_without_readers_the_producer_fills_the_buffer_then_pauses() -> None:
    log = EventLog(max_events=4, window=2)
    for _ in range(3):
        log.append(b"x", 1)
    assert log.has_room()
    log.append(b"x", 1)
    assert not log.has_room()
    log.release_floor()  # a reader elsewhere (Redis) has it all
    assert log.has_room()


def test_a_detached_reader_raises_the_floor() -> None:
    log = EventLog(max_events=4, window=2)
    reader = Reader()
    log.attach(reader)
    for _ in range(3):
        log.append(b"x", 1)
    log.detach(reader)
    assert log.readers == [] and log.has_room()


def test_corked_appends_reach_readers_in_one_catch_up() -> None:
    log = EventLog()
    reader = Reader()
    log.attach(reader)
    log.cork()
    log.append(b"last token", 1)
    log.append(b"finish")
    log.close()
    assert reader.seen == [] and not reader.closed
    log.uncork()
    assert reader.catch_ups == 1


def test_the_bound_holds_exactly_while_trimming_in_slices() -> None:
    log = EventLog(max_events=16)
    for i in range(100):
        log.append(b"%d" % (i + 1), 1 if i % 3 else 0)
        first = log.first_seq
        kept = log.after(first - 1)
        assert [e.seq for e in kept] == list(range(first, log.last_seq + 1))
        assert len(kept) == min(i + 1, 16)
        assert all(e.wire == b"%d" % e.seq for e in kept)
        assert all(e.tokens == (1 if (e.seq - 1) % 3 else 0) for e in kept)
        if first > 1:
            with pytest.raises(ResumeExpired):
                log.after(first - 2)


def test_a_log_begun_past_zero_replays_and_trims_from_there() -> None:
    # A mirror's log starts where its reader resumes: it never holds the events before.
    log = EventLog(max_events=4)
    log.begin_at(10)
    assert log.has_room()
    for i in range(3):
        assert log.append(b"%d" % (11 + i), 1 if i else 0) == 11 + i
    assert log.after(10) == [Event(11, b"11", 0), Event(12, b"12", 1), Event(13, b"13", 1)]
    assert [e.seq for e in log.after(12)] == [13]
    with pytest.raises(ResumeExpired):
        log.after(9)
    for i in range(14, 30):
        log.append(b"%d" % i)
    assert [e.wire for e in log.after(log.first_seq - 1)] == [b"26", b"27", b"28", b"29"]
    with pytest.raises(AssertionError):
        log.begin_at(5)


def test_on_append_is_called_by_the_next_append_only() -> None:
    log = EventLog(max_events=10)
    calls: list[int] = []
    log.on_append = lambda: calls.append(log.last_seq)
    log.append(b"a")
    log.append(b"b")
    assert calls == [1] and log.on_append is None  # once, until set again
    log.on_append = lambda: calls.append(log.last_seq)
    log.append(b"c", 0)
    assert calls == [1, 3]


def test_a_run_after_a_seq_is_the_kept_events_and_their_counts() -> None:
    log = EventLog(max_events=4)
    log.append(b"role", 0)
    for i in range(2, 7):
        log.append(b"e%d" % i, 1 if i != 5 else 3)
    assert log.run_after(0) == (3, [b"e3", b"e4", b"e5", b"e6"], {5: 3})  # 1, 2 fell off
    assert log.run_after(5) == (6, [b"e6"], {})
    assert log.run_after(6) == (7, [], {})
    copy = log.detached_after(3)
    assert copy.run_after(0) == (4, [b"e4", b"e5", b"e6"], {5: 3})
    assert copy.last_seq == 6 and copy.after(4) == [Event(5, b"e5", 3), Event(6, b"e6", 1)]


class Catching(Reader):
    """A reader that writes what the log shows it when asked to catch up."""

    def __init__(self, log: EventLog) -> None:
        super().__init__()
        self.log = log

    def catch_up(self) -> None:
        super().catch_up()
        for event in self.log.after(self.cursor):
            self.seen.append(event.seq)
            self.cursor = event.seq


def test_a_held_log_shows_readers_only_what_the_store_confirmed() -> None:
    """--durable: events reach readers once Redis has them, in the order they came."""
    log = EventLog(max_events=10, window=2)
    reader = Catching(log)
    log.attach(reader)
    log.hold(0)
    for _ in range(3):
        log.append(b"x", 1)
    assert reader.seen == [] and log.after(0) == []
    assert log.has_room()  # nothing is shown yet: the reader is not behind what it may read
    log.hold(2)
    assert reader.seen == [1, 2] and [e.seq for e in log.after(0)] == [1, 2]
    log.close()
    assert not reader.closed  # event 3 is not confirmed: the reader must not end before it
    log.hold(3)
    assert reader.seen == [1, 2, 3] and reader.closed


def test_a_held_log_pauses_its_producer_past_the_window_of_what_is_shown() -> None:
    log = EventLog(max_events=4, window=2)
    reader = Reader()
    reader.keep_up = False
    log.attach(reader)
    log.hold(0)
    for _ in range(4):
        log.append(b"x", 1)
    assert not log.has_room()  # a whole buffer unconfirmed: the store is behind
    log.hold(4)
    assert not log.has_room()  # confirmed, and the reader is a window behind it
    reader.cursor = 3
    assert log.has_room()


def test_an_unheld_log_shows_readers_everything_then_each_event_as_it_comes() -> None:
    """--durable while Redis is away: the owner's readers go on without the store."""
    log = EventLog(max_events=10, window=4)
    reader = Catching(log)
    log.attach(reader)
    log.hold(0)
    log.append(b"x", 1)
    log.append(b"x", 1)
    assert reader.seen == []
    log.unhold()
    assert reader.seen == [1, 2] and log.limit is None
    log.append(b"x", 1)
    assert reader.seen == [1, 2, 3]
    log.hold_from_next()  # held again: what was shown stays shown, the next waits
    log.append(b"x", 1)
    assert reader.seen == [1, 2, 3] and log.has_room()
    log.close()
    log.unhold()
    assert reader.seen == [1, 2, 3, 4] and reader.closed


def test_a_closed_log_tells_its_readers_of_the_close_once_whatever_the_holds() -> None:
    """Released, held again, released: a reader is told of the end once (a writer told
    twice would close twice)."""
    log = EventLog(max_events=10, window=4)
    reader = Catching(log)
    closes: list[int] = []
    reader.log_closed = lambda: closes.append(reader.cursor)  # type: ignore[method-assign]
    log.attach(reader)
    log.hold(0)
    log.append(b"x", 1)
    log.hold(1)
    log.close()
    assert closes == [1]  # everything was confirmed: told at the close
    log.unhold()
    log.hold_from_next()
    log.hold(1)
    log.unhold()
    assert closes == [1] and reader.seen == [1]


def test_end_at_lets_the_events_after_it_go_and_a_reader_behind_ends_there() -> None:
    """A fenced owner's log: what it made after the store's last event of it is not the
    answer any more; a reader past that point keeps what it had."""
    log = EventLog(max_events=100)
    for i in range(1, 7):
        log.append(b"e%d" % i, tokens=2 if i == 4 else 1)
    log.hold(3)  # --durable: Redis confirmed up to 3
    log.end_at(3)
    assert log.last_seq == 3 and log.limit == 3 and log.first_seq == 1
    assert [e.wire for e in log.after(0)] == [b"e1", b"e2", b"e3"]
    assert log.after(5) == []  # a reader past it reads nothing more
    log.append(b"x", 1)
    log.hold(4)
    assert log.after(3) == [Event(4, b"x", 1)]  # not the count of the event dropped
    log.close()
    assert log.shown_all()


def test_end_at_before_what_is_kept_leaves_none() -> None:
    log = EventLog(max_events=4)
    for i in range(1, 11):
        log.append(b"e%d" % i)
    log.end_at(2)  # events up to 2 were trimmed already
    assert log.last_seq == 2 and log.wire(2) is None
    log.append(b"next", 1)
    assert log.wire(3) == b"next" and log.after(2) == [Event(3, b"next", 1)]
    log.end_at(9)  # past its last: nothing to drop
    assert log.last_seq == 3


def test_wire_is_any_kept_event_shown_or_not() -> None:
    log = EventLog(max_events=100)
    for i in range(1, 4):
        log.append(b"e%d" % i)
    log.hold(1)
    assert log.wire(3) == b"e3" and log.wire(0) is None and log.wire(4) is None
