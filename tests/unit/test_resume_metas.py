"""New streams' metas (`firsttoken/resume/metas.py`) without I/O: what is written for each,
what a written meta lets go of, how a turn's metas are cut into calls, and what a failed
write leaves to the flusher (on virtual time)."""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from redis.exceptions import ConnectionError as RedisConnectionError

from firsttoken.eventlog import EventLog
from firsttoken.resume.health import OP_TIMEOUT_S
from firsttoken.resume.metas import _META_CALL_BYTES, LIVE_EXTRA_S, by_request_bytes
from firsttoken.resume.redis import RedisStore
from firsttoken.resume.redis_keys import meta_key, owned_key, tag_of
from firsttoken.resume.replicas import Replica
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


def opened(s: RedisStore, answer: Callable[[], Awaitable[list[Any]]]) -> list[str]:
    """Two more streams opened in the turn of s1 (opened while the store counted Redis as
    down: its meta is tried at once too), while Redis answers their metas' call with
    `answer`: what the flusher is left to write, once the call is over (virtual time)."""
    s.up = True
    s._replicas.dirty.clear()
    s._replicas["s1"].queued = False
    s.open(StreamRecord("s2", "native", "d", "t", "m"), TTL_S, EventLog(8))
    s.open(StreamRecord("s3", "native", "d", "t", "m"), TTL_S, EventLog(8))
    s.let_go("s3", flush=False)  # forgotten meanwhile: nothing of it is written any more

    async def call(reps: list[Replica]) -> list[Any]:
        return await answer()

    s._metas.call = call  # type: ignore[method-assign]  # Redis's answer, as the test says

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(s._metas.write_forever)
            await anyio.sleep(OP_TIMEOUT_S * 2)
            tg.cancel_scope.cancel()

    virtual_loop.run(body())
    return list(s._replicas.dirty)


def test_a_meta_write_that_runs_out_of_time_is_the_flushers_and_leaves_the_store_up() -> None:
    """On a loop starved by a burst the write may time out though Redis answers: the
    flusher's own write says whether Redis is away."""
    s = store()

    async def slow() -> list[Any]:
        await anyio.sleep(OP_TIMEOUT_S * 5)
        return []

    assert opened(s, slow) == ["s1", "s2"]
    assert s.up and s.outages == 0 and not s._replicas["s2"].meta_done


def test_a_refused_meta_write_is_the_flushers_and_takes_the_store_down() -> None:
    s = store()

    async def refused() -> list[Any]:
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Refused.")

    assert opened(s, refused) == ["s1", "s2"]
    assert not s.up and s.outages == 1


def test_a_written_meta_is_done_and_nothing_is_left_to_the_flusher() -> None:
    s = store()

    async def taken() -> list[Any]:
        return []

    assert opened(s, taken) == [] and s._replicas["s2"].meta_done


def test_a_meta_taken_while_the_store_counts_redis_as_down_recovers_the_flusher_now() -> None:
    """A stream opened while the store counts Redis as down is tried at once too: Redis may
    be back before the next heartbeat tells the flusher (1 s), a reader elsewhere waiting
    for the meta as long."""
    s = store()
    assert "s1" in s._replicas.dirty  # the flusher's, should the write fail
    told: list[bool] = []
    s._metas.answered = lambda: told.append(True)

    async def taken(reps: list[Replica]) -> list[Any]:
        return []

    s._metas.call = taken  # type: ignore[method-assign]

    async def body() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(s._metas.write_forever)
            await anyio.sleep(0.1)
            tg.cancel_scope.cancel()

    virtual_loop.run(body())
    assert s._replicas["s1"].meta_done and told == [True]
