"""New streams' metas (`firsttoken/resume/metas.py`) without I/O: what is written for each,
what a written meta lets go of, how a turn's metas are cut into calls, and what `registered`
waits for (on virtual time)."""

from __future__ import annotations

import struct

import anyio

from firsttoken.eventlog import EventLog
from firsttoken.resume.health import OP_TIMEOUT_S
from firsttoken.resume.metas import _META_CALL_BYTES, LIVE_EXTRA_S, by_request_bytes
from firsttoken.resume.redis_keys import meta_key, owned_key, tag_of
from firsttoken.resume.store import StreamRecord
from tests.unit import virtual_loop
from tests.unit.replicated import TTL_S, confirm, flush, replicate, store


def test_the_meta_never_takes_a_stream_back() -> None:
    s = store()
    commands = s._metas.commands(s._replicas["s1"])
    # Written again after a Redis restart, the meta must not undo a takeover since.
    assert ("HSETNX", meta_key("s1"), "owner", s.instance) in commands
    assert ("HSETNX", meta_key("s1"), "fence", 1) in commands
    assert ("EXPIRE", meta_key("s1"), int(TTL_S + LIVE_EXTRA_S)) in commands
    assert ("takeover", 0) == tuple(commands[0][10:12])  # no request stored with it


def test_the_request_stored_with_a_stream_is_not_kept_here_once_redis_has_it() -> None:
    """A waiting stream would hold its request (kilobytes) for its whole life."""
    s = store(handover=b'{"request": "..."}')
    rep = s._replicas["s1"]
    assert ("req", b'{"request": "..."}') == tuple(s._metas.commands(rep)[0][12:14])
    replicate(s, 1, 1)
    flush(s)
    confirm(s, 1)
    assert rep.meta_done and rep.record.handover is None
    # Written again after a Redis restart (it lost the request): not to be taken over.
    assert ("takeover", 0) == tuple(s._metas.commands(rep)[0][10:12])


def test_a_stream_that_ended_before_its_meta_went_out_is_stored_without_its_request() -> None:
    """Its request is useless once it ended (nothing is left to continue): not written at
    all, where a live stream's is deleted by its end (`flusher.WRITE_RUNS`)."""
    s = store(handover=b'{"request": "1 MB of prompt"}')
    rep = s._replicas["s1"]
    replicate(s, 1, 1)
    s.finish("s1", "completed", 1, TTL_S)
    commands = s._metas.commands(rep)
    assert ("takeover", 0) == tuple(commands[0][10:12]) and "req" not in commands[0]


def test_a_stream_is_in_its_owners_set_until_it_ends_even_if_its_meta_goes_late() -> None:
    """The set a survivor sweeps if this instance dies: the meta's write adds the stream,
    unless it ended before the meta went out (nothing left to bill)."""
    s = store()
    owned = owned_key(tag_of(meta_key("s1")), s.instance)
    assert ("SADD", owned, "s1") == s._metas.commands(s._replicas["s1"])[-1]
    s.finish("s1", "completed", 0, TTL_S)
    assert ("SREM", owned, "s1") == s._metas.commands(s._replicas["s1"])[-1]


def test_a_turns_metas_are_cut_into_calls_by_the_bytes_of_their_requests() -> None:
    s = store()
    big = b"r" * (_META_CALL_BYTES // 2)
    for i, handover in enumerate([big, big, None, big, b"r" * (_META_CALL_BYTES + 1)]):
        record = StreamRecord(f"x{i}", "native", "d", "t", "m", handover)
        s.open(record, TTL_S, EventLog(8))
    reps = [s._replicas[f"x{i}"] for i in range(5)]
    runs = [[rep.record.id for rep in run] for run in by_request_bytes(reps)]
    assert runs == [["x0", "x1", "x2"], ["x3"], ["x4"]]  # one at least, however big


def test_the_lua_call_carries_each_streams_fields_after_its_lengths() -> None:
    s = store(handover=b"{}")
    rep = s._replicas["s1"]
    command = s._metas._packed([rep])
    assert command.startswith(b"*6\r\n$7\r\nEVALSHA\r\n") and rep.meta_arg in command
    blob = command.rsplit(b"\r\n", 2)[-2]
    head = struct.unpack("<10I", blob[:40])
    assert head[:3] == (int(TTL_S + LIVE_EXTRA_S), 1, 1)  # TTL, fence, takeover
    assert blob[40:] == b"native" + b"d" + b"t" + b"m" + b"" + b"{}"
    assert head[3:] == (6, 1, 1, 1, 0, 2, 0)


def test_registered_waits_for_the_write_and_leaves_a_failed_meta_to_the_flusher() -> None:
    s = store()
    s.up = True
    s._replicas.dirty.clear()
    s._replicas["s1"].queued = False
    s.open(StreamRecord("s2", "native", "d", "t", "m"), TTL_S, EventLog(8))
    s.open(StreamRecord("s3", "native", "d", "t", "m"), TTL_S, EventLog(8))
    s.let_go("s3", flush=False)  # forgotten: nothing to wait for

    async def body() -> float:
        started = anyio.current_time()
        await s.registered("s3")
        assert anyio.current_time() == started
        await s.registered("s2")  # nobody writes it: Redis is taken for away after the bound
        return anyio.current_time() - started

    assert virtual_loop.run(body()) == OP_TIMEOUT_S
    assert not s.up and s.outages == 1 and list(s._replicas.dirty) == ["s2"]
