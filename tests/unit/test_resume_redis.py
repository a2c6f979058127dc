"""The owner's side of the Redis store (`firsttoken/resume/redis.py`) without I/O: what one
flush writes for each stream (a run of its new events, its end once every event is in), and
what Redis's answers confirm. The answers are what Redis returns, written out here."""

from __future__ import annotations

import struct
from functools import partial

import anyio
import pytest
from redis.exceptions import NoScriptError, RedisError

from firsttoken.eventlog import EventLog
from firsttoken.resume.keys import events_key, meta_key, owned_key, tag_of
from firsttoken.resume.redis import (
    _META_COMMANDS,
    _OWNER_GONE_S,
    _STALL_S,
    RedisStore,
    _Call,
    _values_of,
    dead_instances,
    tokens_held,
)
from firsttoken.resume.runs import decode_run, encode_run
from firsttoken.resume.store import StreamRecord
from tests.unit import virtual_loop
from tests.unit.clock import FakeClock

TTL_S = 60.0


def store(max_events: int = 100) -> RedisStore:
    s = RedisStore("redis://127.0.0.1:1/0", max_events=max_events, max_connections=1)
    s.up = False  # register() queues the meta for the flusher instead of writing it
    record = StreamRecord("s1", "native", "d", "t", "m")
    anyio.run(s.register, record, TTL_S, EventLog(max_events))
    return s


def replicate(s: RedisStore, first: int, last: int, tokens: int = 1) -> None:
    """The stream's producer appends to its log; the store is told, once, that it is dirty."""
    log = s._replicas["s1"].log
    for seq in range(first, last + 1):
        assert log.append(b"e%d" % seq, tokens) == seq


def flush(s: RedisStore) -> dict:
    """s1's part of the Lua call, as one flush builds it, read back."""
    (rep,) = s._dirty.values()
    s._dirty.clear()
    rep.queued = False
    rep.log.on_append = rep.wanted
    call = _Call()
    s._pack(rep, call)
    head, w, n, t, outcome, billed = call.blob
    names = ("last", "minid", "first", "wl", "nl", "tl", "ol", "bl", "end", "ttl", "fence")
    args = dict(zip(names, struct.unpack("<11I", head), strict=True))
    lengths = tuple(map(len, (w, n, t, outcome, billed)))
    assert (args["wl"], args["nl"], args["tl"], args["ol"], args["bl"]) == lengths
    return {
        **args,
        "w": w,
        "n": n,
        "t": t,
        "outcome": outcome,
        "billed": billed,
        "keys": call.keys,
    }


def events_of(args: dict) -> list[tuple[int, bytes, int]]:
    fields = {b"f": str(args["first"]).encode(), b"w": args["w"], b"n": args["n"]}
    if args["t"]:
        fields[b"t"] = args["t"]
    return list(decode_run(fields))


def confirm(s: RedisStore, result: object) -> None:
    """Redis's answers to one flush: the meta's HSET, two HSETNX, EXPIRE and the owned set's
    SADD if it went, then the call's (which carries the end, if any)."""
    rep = s._replicas["s1"]
    metas = [] if rep.meta_done else [rep]
    refused = [] if result == 1 else [1, result]  # the Lua call names the streams it failed
    s._confirm([rep], metas, [], [[rep]], [*[1] * (_META_COMMANDS * len(metas)), refused])


def dropped(s: RedisStore) -> float:
    (metric,) = [m for m in s.collect() if m.name == "firsttoken_redis_events_dropped"]
    return metric.samples[0].value


def test_one_run_per_flush_carries_every_event_since_the_last() -> None:
    s = store()
    replicate(s, 1, 5)
    args = flush(s)
    assert args["last"] == 5 and events_of(args) == [(q, b"e%d" % q, 1) for q in range(1, 6)]
    assert args["ttl"] == int(TTL_S + 3600)  # the live TTL, once
    assert args["keys"] == [events_key("s1"), meta_key("s1")]  # the meta holds the fence
    confirm(s, 1)
    assert s.backlog() == 0 and not s._dirty
    replicate(s, 6, 7, tokens=0)
    assert "s1" in s._dirty  # the first new event marked it
    args = flush(s)
    assert events_of(args) == [(6, b"e6", 0), (7, b"e7", 0)]
    assert args["ttl"] == 0  # the TTL is set already


def test_a_failed_write_goes_again_whole_with_what_came_since() -> None:
    s = store()
    replicate(s, 1, 3)
    flush(s)
    replicate(s, 4, 4)  # arrived while the write was in flight
    try:
        confirm(s, b"OOM command not allowed when used memory > 'maxmemory'.")
    except Exception as exc:
        assert "OOM" in str(exc)
    else:
        raise AssertionError("a refused write must raise (the flusher backs off)")
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
    assert not rep.end_done and "s1" in s._dirty
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
    assert dropped(s) == 10  # 3..12, counted while Redis is still away
    assert dropped(s) == 10  # once
    args = flush(s)
    assert [seq for seq, _, _ in events_of(args)] == list(range(13, 21))
    assert args["minid"] == 13  # MINID: the last 8 events stay in Redis


def test_release_keeps_only_what_redis_lacks_and_expiry_follows_the_clock() -> None:
    s = store()
    s.clock = clock = FakeClock()
    replicate(s, 1, 4)
    flush(s)
    confirm(s, 1)
    replicate(s, 5, 6)
    s.finish("s1", "completed", 6, TTL_S)
    s.release("s1")
    assert s._replicas["s1"].log.run_after(0)[:2] == (5, [b"e5", b"e6"])
    clock.advance(TTL_S - 1)
    s._expire()
    assert "s1" in s._replicas
    clock.advance(1)
    rep = s._replicas["s1"]
    s._expire()
    assert "s1" not in s._replicas and not s._dirty
    assert rep.log.on_append is None and not isinstance(rep.wanted, partial)  # no cycle left


def test_a_script_missing_after_a_restart_leaves_the_run_to_go_again() -> None:
    s = store()
    replicate(s, 1, 2)
    flush(s)
    rep = s._replicas["s1"]
    s._script_missing = False
    missing = NoScriptError("No matching script. Please use EVAL.")
    with pytest.raises(RedisError, match="NoScriptError"):
        s._confirm([rep], [rep], [], [[rep]], [*[1] * _META_COMMANDS, missing])
    assert s.backlog() == 2 and "s1" in s._dirty and s._script_missing


def test_events_lost_in_an_outage_are_counted_when_redis_comes_back_empty() -> None:
    """Nobody scraped /metrics while Redis was away: the resync after its restart (which
    writes off everything before the first kept event) counts them first."""
    s = store(max_events=8)
    replicate(s, 1, 2)
    flush(s)
    confirm(s, 1)
    replicate(s, 3, 20)
    s._resync("a new run id")
    assert dropped(s) == 10
    args = flush(s)
    assert args["first"] == 13 and args["minid"] == 13


def test_every_write_carries_the_fence_and_the_meta_never_takes_a_stream_back() -> None:
    s = store()
    replicate(s, 1, 2)
    assert flush(s)["fence"] == 1
    commands = s._meta_commands(s._replicas["s1"])
    # Written again after a Redis restart, the meta must not undo a takeover since.
    assert ("HSETNX", meta_key("s1"), "owner", s.instance) in commands
    assert ("HSETNX", meta_key("s1"), "fence", 1) in commands
    assert ("takeover", 0) == tuple(commands[0][10:12])  # no request stored with it


def test_a_fenced_write_lets_the_stream_go_without_an_outage() -> None:
    """Another instance took the stream over: its owner's write is refused, it is told and
    forgets the stream; the other streams of the flush were written as usual."""
    s = store()
    told: list[tuple[str, int, bool]] = []
    s.on_fenced = lambda stream_id, kept, lost: told.append((stream_id, kept, lost))
    replicate(s, 1, 3)
    flush(s)
    confirm(s, b"fenced")  # no RedisError: Redis is fine
    assert told == [("s1", 0, False)] and "s1" not in s._replicas and not s._dirty and s.fenced == 1


def test_durable_readers_see_an_event_once_redis_confirmed_it() -> None:
    s = RedisStore("redis://127.0.0.1:1/0", max_events=100, max_connections=1, durable=True)
    s.up = False
    log = EventLog(100)
    anyio.run(s.register, StreamRecord("s1", "native", "d", "t", "m"), TTL_S, log)
    replicate(s, 1, 3)
    assert log.after(0) == []
    flush(s)
    replicate(s, 4, 4)
    confirm(s, 1)
    assert [e.seq for e in log.after(0)] == [1, 2, 3]


def test_a_stream_taken_over_is_written_from_its_next_event_with_its_new_fence() -> None:
    s = RedisStore("redis://127.0.0.1:1/0", max_events=100, max_connections=1)
    log = EventLog(100)
    for seq in range(1, 6):
        log.append(b"e%d" % seq, 1)  # what Redis held when it was claimed
    s.adopt(StreamRecord("s1", "native", "d", "t", "m", b"{}"), TTL_S, log, fence=3)
    rep = s._replicas["s1"]
    assert rep.meta_done and rep.flushed == 5
    replicate(s, 6, 7)
    args = flush(s)
    assert args["fence"] == 3 and [seq for seq, _, _ in events_of(args)] == [6, 7]


def test_a_stream_let_go_is_written_to_its_last_event_then_forgotten() -> None:
    s = store()
    s.clock = clock = FakeClock()
    replicate(s, 1, 3)
    s.let_go("s1", flush=True)  # handed over: what Redis lacks still goes out
    s._expire()
    assert "s1" in s._replicas
    flush(s)
    confirm(s, 1)
    clock.advance(1)
    s._expire()
    assert "s1" not in s._replicas
    s2 = store()
    s2.let_go("s1", flush=False)  # fenced: nothing more of it is written
    assert "s1" not in s2._replicas and not s2._dirty


def test_a_hand_over_leaves_what_was_billed_with_its_last_events_until_redis_has_it() -> None:
    """What the owner billed goes with the run that ends its part, in the same fenced call
    (`Claim.billed` for the instance that takes the stream over), again until confirmed."""
    s = store()
    replicate(s, 1, 3)
    assert s.let_go("s1", flush=True, billed=b"10 3 0")
    args = flush(s)
    assert args["last"] == 3 and args["billed"] == b"10 3 0"
    with pytest.raises(RedisError):  # refused: all of it goes again
        confirm(s, b"OOM command not allowed when used memory > 'maxmemory'.")
    args = flush(s)
    assert args["last"] == 3 and args["billed"] == b"10 3 0"
    confirm(s, 1)
    assert not s._replicas["s1"].dirty()
    s2 = store()
    replicate(s2, 1, 2)
    flush(s2)  # what the owner writes as it goes carries nothing billed
    assert flush_args_billed(s2) == b""
    s2.let_go("s1", flush=False)
    assert not s2.let_go("s1", flush=True, billed=b"1 1 0")  # fenced already: not here


def flush_args_billed(s: RedisStore) -> bytes:
    replicate(s, 3, 3)
    return flush(s)["billed"]


def test_the_request_stored_with_a_stream_is_not_kept_here_once_redis_has_it() -> None:
    """A waiting stream would hold its request (kilobytes) for its whole life."""
    s = RedisStore("redis://127.0.0.1:1/0", max_events=100, max_connections=1)
    s.up = False
    record = StreamRecord("s1", "native", "d", "t", "m", b'{"request": "..."}')
    anyio.run(s.register, record, TTL_S, EventLog(100))
    rep = s._replicas["s1"]
    assert ("req", b'{"request": "..."}') == tuple(s._meta_commands(rep)[0][12:14])
    replicate(s, 1, 1)
    flush(s)
    confirm(s, 1)
    assert rep.meta_done and rep.record.handover is None
    # Written again after a Redis restart (it lost the request): not to be taken over.
    assert ("takeover", 0) == tuple(s._meta_commands(rep)[0][10:12])


def durable_store() -> tuple[RedisStore, EventLog]:
    s = RedisStore("redis://127.0.0.1:1/0", max_events=100, max_connections=1, durable=True)
    s.up = False  # register() queues the meta for the flusher instead of writing it
    log = EventLog(100)
    anyio.run(s.register, StreamRecord("s1", "native", "d", "t", "m"), TTL_S, log)
    s.up = True
    return s, log


def shown(log: EventLog) -> list[int]:
    return [e.seq for e in log.after(0)]


def test_durable_readers_go_on_while_redis_is_away_and_wait_for_it_again_once_back() -> None:
    """Nothing can take a stream over while Redis does not answer: holding events back then
    would only stall every reader for the outage."""
    s, log = durable_store()
    replicate(s, 1, 3)
    flush(s)
    confirm(s, 1)
    replicate(s, 4, 5)
    assert shown(log) == [1, 2, 3]
    s._write_ended(ConnectionError("Redis went away"))
    assert s.released and shown(log) == [1, 2, 3, 4, 5]
    replicate(s, 6, 6)
    assert shown(log)[-1] == 6  # as it comes
    other = EventLog(100)  # a stream opened meanwhile is not held either
    s.open(StreamRecord("s2", "native", "d", "t", "m"), TTL_S, other)
    other.append(b"x", 1)
    assert [e.seq for e in other.after(0)] == [1]
    s.let_go("s2", flush=False)
    # Back: a flush answered in full holds readers to what Redis confirms again.
    flush(s)
    confirm(s, 1)
    s._write_ended(None)
    assert not s.released and s.up
    replicate(s, 7, 7)
    assert shown(log)[-1] == 6  # what was shown stays shown; the next one waits
    flush(s)
    confirm(s, 1)
    assert shown(log)[-1] == 7


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
    s._write_ended(ConnectionError("cut off"))
    replicate(s, 3, 5)  # shown, never confirmed
    s._write_ended(None)  # answering again, as a claim elsewhere did meanwhile
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
    s2._write_ended(ConnectionError("cut off"))
    s2.finish("s1", "completed", 2, TTL_S)  # its end's write is refused
    flush(s2)
    confirm(s2, b"fenced")
    assert told[-1] == ("s1", False)


def test_a_flush_unanswered_past_the_stall_bound_releases_durable_readers() -> None:
    """Redis stopped, not gone (SIGSTOP, a long block): no error comes, only silence."""

    s, log = durable_store()
    replicate(s, 1, 2)

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(s._watch_stalls)
            s._write_began()
            await anyio.sleep(_STALL_S * 0.9)
            assert not s.released and shown(log) == []
            await anyio.sleep(_STALL_S * 0.2)
            assert s.released and s.up and shown(log) == [1, 2]
            s._write_ended(None)  # its reply came: held again
            assert not s.released
            s._write_began()  # a flush answered in time releases nothing
            await anyio.sleep(_STALL_S * 0.5)
            s._write_ended(None)
            await anyio.sleep(_STALL_S * 2)
            assert not s.released
            tg.cancel_scope.cancel()

    virtual_loop.run(body())


def test_a_stream_that_ended_before_its_meta_went_out_is_stored_without_its_request() -> None:
    """Its request is useless once it ended (nothing is left to continue): not written at
    all, where a live stream's is deleted by its end (`_WRITE_RUNS`)."""
    s = RedisStore("redis://127.0.0.1:1/0", max_events=100, max_connections=1)
    s.up = False
    record = StreamRecord("s1", "native", "d", "t", "m", b'{"request": "1 MB of prompt"}')
    anyio.run(s.register, record, TTL_S, EventLog(100))
    rep = s._replicas["s1"]
    replicate(s, 1, 1)
    s.finish("s1", "completed", 1, TTL_S)
    commands = s._meta_commands(rep)
    assert ("takeover", 0) == tuple(commands[0][10:12]) and "req" not in commands[0]


def test_the_eviction_policy_is_read_from_one_node_or_every_master() -> None:
    assert _values_of({b"maxmemory-policy": b"allkeys-lru"}, "maxmemory-policy") == {"allkeys-lru"}
    cluster = {
        "127.0.0.1:7000": {"maxmemory-policy": "noeviction"},
        "127.0.0.1:7001": {"maxmemory-policy": "volatile-lfu"},
    }
    assert _values_of(cluster, "maxmemory-policy") == {"noeviction", "volatile-lfu"}


def test_evictions_are_counted_as_they_grow_and_across_a_redis_restart() -> None:
    s = RedisStore("redis://127.0.0.1:1/0", max_events=100, max_connections=1)
    counts = iter([15, 15, 3])  # Redis's evicted_keys at each look; 3: it restarted

    async def evicted_keys() -> int:
        return next(counts)

    s._evicted_keys = evicted_keys  # type: ignore[method-assign]
    s._evicted_seen = 10  # at start

    async def body() -> None:
        for _ in range(3):
            await s._count_evictions()

    anyio.run(body)
    assert s.evicted == 5 + 3
    (metric,) = [m for m in s.collect() if m.name == "firsttoken_redis_keys_evicted"]
    assert metric.samples[0].value == 8


def test_a_stream_is_in_its_owners_set_until_it_ends_even_if_its_meta_goes_late() -> None:
    """The set a survivor sweeps if this instance dies: the meta's write adds the stream,
    unless it ended before the meta went out (nothing left to bill)."""
    s = store()
    owned = owned_key(tag_of(meta_key("s1")), s.instance)
    assert ("SADD", owned, "s1") == s._meta_commands(s._replicas["s1"])[-1]
    s.finish("s1", "completed", 0, TTL_S)
    assert ("SREM", owned, "s1") == s._meta_commands(s._replicas["s1"])[-1]


def test_an_instance_is_dead_once_its_key_was_missing_for_the_owner_gone_bound() -> None:
    clock = FakeClock()
    missing: dict[str, float] = {}
    look = partial(dead_instances, missing=missing, gone_s=_OWNER_GONE_S)
    assert look(["a", "b"], [False, True], now=clock()) == []
    clock.advance(_OWNER_GONE_S / 2)
    assert look(["a", "b"], [True, False], now=clock()) == []  # a back: a Redis restart
    clock.advance(_OWNER_GONE_S / 2)
    assert look(["a", "b"], [False, False], now=clock()) == []
    clock.advance(_OWNER_GONE_S / 2)
    assert look(["a", "b"], [False, False], now=clock()) == ["b"]  # once, then forgotten
    assert missing == {"a": clock() - _OWNER_GONE_S / 2}
    assert look([], [], now=clock()) == [] and missing == {}  # another survivor took a


def test_the_tokens_held_are_counted_from_every_run_up_to_the_end() -> None:
    def entry(first: int, count: int, counts: dict[int, int] | None = None) -> tuple:
        wires = [b"e%d" % seq for seq in range(first, first + count)]
        fields = encode_run(first, wires, counts or {})
        raw = {
            k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()
        }
        return (b"%d-0" % (first + count - 1), raw)

    # A meta event (0 tokens), runs that overlap (one resent whole after a lost reply), an end.
    entries = [
        entry(1, 3, {1: 0}),
        entry(1, 5, {1: 0}),
        entry(6, 2, {7: 4}),
        (b"7-1", {b"end": b"x"}),
    ]
    assert tokens_held(entries) == (4 + 1 + 4, True)
    assert tokens_held(entries[2:]) == (5, False)  # its first runs trimmed: a part of it
    assert tokens_held([]) == (0, True)
