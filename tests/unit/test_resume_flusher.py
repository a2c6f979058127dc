"""The flusher (`firsttoken/resume/flusher.py`) without I/O: what one flush writes for each
stream (a run of its new events, its end once every event is in), and what Redis's answers
confirm. The answers are what Redis returns, written out here."""

from __future__ import annotations

import pytest
from redis.exceptions import NoScriptError, RedisError

from firsttoken.eventlog import EventLog
from firsttoken.resume.metas import META_COMMANDS
from firsttoken.resume.redis import RedisStore
from firsttoken.resume.redis_keys import events_key, meta_key
from firsttoken.resume.store import StreamRecord
from tests.unit.clock import FakeClock
from tests.unit.replicated import TTL_S, confirm, events_of, flush, replicate, store

OOM = b"OOM command not allowed when used memory > 'maxmemory'."


def test_one_run_per_flush_carries_every_event_since_the_last() -> None:
    s = store()
    replicate(s, 1, 5)
    args = flush(s)
    assert args["last"] == 5 and events_of(args) == [(q, b"e%d" % q, 1) for q in range(1, 6)]
    assert args["ttl"] == int(TTL_S + 3600)  # the live TTL, once
    assert args["keys"] == [events_key("s1"), meta_key("s1")]  # the meta holds the fence
    confirm(s, 1)
    assert s.backlog() == 0 and not s._replicas.dirty
    replicate(s, 6, 7, tokens=0)
    assert "s1" in s._replicas.dirty  # the first new event marked it
    args = flush(s)
    assert events_of(args) == [(6, b"e6", 0), (7, b"e7", 0)]
    assert args["ttl"] == 0  # the TTL is set already


def test_a_failed_write_goes_again_whole_with_what_came_since() -> None:
    s = store()
    replicate(s, 1, 3)
    flush(s)
    replicate(s, 4, 4)  # arrived while the write was in flight
    with pytest.raises(RedisError, match="OOM"):  # refused: the flusher backs off
        confirm(s, OOM)
    assert s.backlog() == 4
    args = flush(s)
    assert [seq for seq, _, _ in events_of(args)] == [1, 2, 3, 4]


def test_the_end_goes_only_with_or_after_every_event() -> None:
    s = store()
    replicate(s, 1, 3)
    flush(s)
    s.finish("s1", "completed", 3, TTL_S)  # while the run is in flight: not in that write
    confirm(s, 1)
    rep = s._replicas["s1"]
    assert not rep.end_done and "s1" in s._replicas.dirty
    args = flush(s)
    assert args["last"] == 0 and (args["outcome"], args["end"]) == (b"completed", 3)
    assert args["ttl"] == 60
    assert args["keys"] == [events_key("s1"), meta_key("s1")]  # the outcome goes there too
    confirm(s, 1)
    assert rep.end_done and not rep.dirty()


def test_a_backlog_past_the_bound_is_counted_and_trimmed_before_the_gap() -> None:
    s = store(max_events=8)
    replicate(s, 1, 2)
    flush(s)
    confirm(s, 1)
    replicate(s, 3, 20)  # Redis away: 18 more, the bound is 8
    rep = s._replicas["s1"]
    assert (rep.first, rep.last) == (13, 20)
    assert s._replicas.count_all_lost() == 10  # 3..12, counted while Redis is still away
    assert s._replicas.count_all_lost() == 10  # once
    args = flush(s)
    assert [seq for seq, _, _ in events_of(args)] == list(range(13, 21))
    assert args["minid"] == 13  # MINID: the last 8 events stay in Redis


def test_a_script_missing_after_a_restart_leaves_the_run_to_go_again() -> None:
    s = store()
    replicate(s, 1, 2)
    flush(s)
    rep = s._replicas["s1"]
    s._flusher._script_missing = False
    missing = NoScriptError("No matching script. Please use EVAL.")
    with pytest.raises(RedisError, match="NoScriptError"):
        s._flusher.confirm([rep], [rep], [], [[rep]], [*[1] * META_COMMANDS, missing])
    assert s.backlog() == 2 and "s1" in s._replicas.dirty and s._flusher._script_missing


def test_events_lost_in_an_outage_are_counted_when_redis_comes_back_empty() -> None:
    """Nobody scraped /metrics while Redis was away: the resync after its restart (which
    writes off everything before the first kept event) counts them first."""
    s = store(max_events=8)
    replicate(s, 1, 2)
    flush(s)
    confirm(s, 1)
    replicate(s, 3, 20)
    s._flusher.resync("a new run id")
    assert s._replicas.events_dropped == 10 and s._flusher.resyncs == 1
    args = flush(s)
    assert args["first"] == 13 and args["minid"] == 13


def test_a_restart_writes_the_live_streams_again_at_once_and_the_ended_ones_later() -> None:
    """The ended streams an instance keeps for resume (85,000 events after 2.5 minutes at 15
    streams a second) written at once took every instance's CPU and Redis's: new streams'
    first tokens came ~0.3 s late. They go a few a flush, after the live ones."""
    s = store()
    replicate(s, 1, 3)
    flush(s)
    s.open(StreamRecord("s2", "native", "d", "t", "m"), TTL_S, EventLog(100))
    s._replicas.finish(s._replicas["s2"], "done", 0, TTL_S)
    s._replicas.take(10)
    s._flusher.resync("a new run id")
    assert list(s._replicas.dirty) == ["s1"]
    assert s._replicas.mark_some(1) == 0 and list(s._replicas.dirty) == ["s1", "s2"]


def test_every_write_carries_the_fence() -> None:
    s = store()
    replicate(s, 1, 2)
    assert flush(s)["fence"] == 1


def test_a_fenced_write_lets_the_stream_go_without_an_outage() -> None:
    """Another instance took the stream over: its owner's write is refused, it is told and
    forgets the stream; the other streams of the flush were written as usual."""
    s = store()
    told: list[tuple[str, int, bool]] = []
    s.on_fenced = lambda stream_id, kept, lost: told.append((stream_id, kept, lost))
    replicate(s, 1, 3)
    flush(s)
    confirm(s, b"fenced")  # no RedisError: Redis is fine
    assert told == [("s1", 0, False)] and "s1" not in s._replicas and not s._replicas.dirty
    assert s._flusher.fenced == 1


def test_durable_readers_see_an_event_once_redis_confirmed_it() -> None:
    s = store(durable=True)
    log = s._replicas["s1"].log
    replicate(s, 1, 3)
    assert log.after(0) == []
    flush(s)
    replicate(s, 4, 4)
    confirm(s, 1)
    assert [e.seq for e in log.after(0)] == [1, 2, 3]


def test_a_stream_let_go_is_written_to_its_last_event_then_forgotten() -> None:
    s = store()
    clock = s._replicas.clock = FakeClock()
    replicate(s, 1, 3)
    s.let_go("s1", flush=True)  # handed over: what Redis lacks still goes out
    s._replicas.expire()
    assert "s1" in s._replicas
    flush(s)
    confirm(s, 1)
    clock.advance(1)
    s._replicas.expire()
    assert "s1" not in s._replicas


def test_a_hand_over_leaves_what_was_billed_with_its_last_events_until_redis_has_it() -> None:
    """What the owner billed goes with the run that ends its part, in the same fenced call
    (`Claim.billed` for the instance that takes the stream over), again until confirmed."""
    s = store()
    replicate(s, 1, 3)
    assert s.let_go("s1", flush=True, billed=b"10 3 0")
    args = flush(s)
    assert args["last"] == 3 and args["billed"] == b"10 3 0"
    with pytest.raises(RedisError):  # refused: all of it goes again
        confirm(s, OOM)
    args = flush(s)
    assert args["last"] == 3 and args["billed"] == b"10 3 0"
    confirm(s, 1)
    assert not s._replicas["s1"].dirty()
    s2 = store()
    replicate(s2, 1, 2)
    flush(s2)  # what the owner writes as it goes carries nothing billed
    replicate(s2, 3, 3)
    assert flush(s2)["billed"] == b""
    s2.let_go("s1", flush=False)
    assert not s2.let_go("s1", flush=True, billed=b"1 1 0")  # fenced already: not here


class Reading:
    """A reader attached to a log: it writes what the log shows it."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.cursor = 0
        log.attach(self)

    def deliver(self, seq: int, wire: bytes, tokens: int) -> None:
        self.cursor = seq

    def catch_up(self) -> None:
        for event in self.log.after(self.cursor):
            self.cursor = event.seq

    def log_closed(self) -> None:
        pass


def durable_store() -> tuple[RedisStore, EventLog]:
    s = store(durable=True)
    s.up = True
    return s, s._replicas["s1"].log


def test_a_stream_fenced_after_its_reader_was_sent_unconfirmed_events_is_lost() -> None:
    """Cut off from Redis (not Redis away), the owner released events; another instance
    took the stream over from what Redis held: a reader here past that is told
    `stream_lost` (never moved on to another text)."""
    s, log = durable_store()
    reader = Reading(log)
    told: list[tuple[str, bool]] = []
    s.on_fenced = lambda stream_id, kept, lost: told.append((stream_id, lost))
    replicate(s, 1, 2)
    flush(s)
    confirm(s, 1)
    s._health.write_ended(ConnectionError("cut off"))
    replicate(s, 3, 5)  # shown, never confirmed
    s._health.write_ended(None)  # answering again, as a claim elsewhere did meanwhile
    assert reader.cursor == 5
    flush(s)
    confirm(s, b"fenced")
    assert told == [("s1", True)] and log.limit is None
    # Released, but nobody read past what Redis had: the stream moves as before.
    s2, log2 = durable_store()
    Reading(log2)
    s2.on_fenced = lambda stream_id, kept, lost: told.append((stream_id, lost))
    replicate(s2, 1, 2)
    flush(s2)
    confirm(s2, 1)
    s2._health.write_ended(ConnectionError("cut off"))
    s2.finish("s1", "completed", 2, TTL_S)  # its end's write is refused
    flush(s2)
    confirm(s2, b"fenced")
    assert told[-1] == ("s1", False)
