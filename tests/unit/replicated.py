"""A Redis store without I/O, for the unit tests of its parts (`tests/unit/test_resume_*.py`):
one stream `s1`, opened while the store counts Redis as down, so its meta waits for the
flusher; a flush is built as the flusher builds it and read back, and Redis's answers to it
are written out by the test."""

from __future__ import annotations

import struct

from firsttoken.eventlog import EventLog
from firsttoken.resume.flusher import Call
from firsttoken.resume.metas import META_COMMANDS
from firsttoken.resume.redis import RedisStore
from firsttoken.resume.runs import decode_run
from firsttoken.resume.store import StreamRecord

__all__ = ["TTL_S", "confirm", "events_of", "flush", "replicate", "shown", "store"]

TTL_S = 60.0
URL = "redis://127.0.0.1:1/0"  # never dialled


def store(
    max_events: int = 100, *, durable: bool = False, handover: bytes | None = None
) -> RedisStore:
    s = RedisStore(URL, max_events=max_events, max_connections=1, durable=durable)
    s.up = False  # open() queues the meta for the flusher instead of writing it
    record = StreamRecord("s1", "native", "d", "t", "m", handover)
    s.open(record, TTL_S, EventLog(max_events))
    return s


def replicate(s: RedisStore, first: int, last: int, tokens: int = 1) -> None:
    """The stream's producer appends to its log; the store is told, once, that it is dirty."""
    log = s._replicas["s1"].log
    for seq in range(first, last + 1):
        assert log.append(b"e%d" % seq, tokens) == seq


def flush(s: RedisStore) -> dict:
    """s1's part of the Lua call, as one flush builds it, read back."""
    (rep,) = s._replicas.take(10)
    call = Call()
    s._flusher.pack(rep, call)
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
    s._flusher.confirm([rep], metas, [], [[rep]], [*[1] * (META_COMMANDS * len(metas)), refused])


def shown(log: EventLog) -> list[int]:
    return [e.seq for e in log.after(0)]
