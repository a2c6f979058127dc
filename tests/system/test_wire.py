"""Exact bytes on the wire, from a raw socket."""

from __future__ import annotations

import gzip
import itertools
import re
import time

from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.rawhttp import RawStream
from tests.servers import Server, run_server

CHAT = {
    "model": "synthetic",
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
    "max_tokens": 6,
    "seed": 3,
}


def test_headers_and_framing_exact(server: Server) -> None:
    s = RawStream(
        server.port,
        "POST",
        "/v1/chat/completions",
        CHAT,
        {"Accept-Encoding": "gzip, br, zstd", "X-Request-Id": "trace-abc.123"},
    )
    body = s.read_all()
    s.close()
    assert s.status == 200
    h = s.headers
    assert h["content-type"] == "text/event-stream"
    assert h["cache-control"] == "no-cache, no-transform"
    assert h["x-accel-buffering"] == "no"
    # The request's own id: a client's is taken only with --trust-trace-headers.
    assert re.fullmatch(r"[0-9a-f]{32}", h["x-request-id"])
    assert re.fullmatch(r"[0-9a-f]{32}", h["x-stream-id"])
    # Never compressed, although the client accepts gzip and the app has GZip middleware.
    assert "content-encoding" not in h
    events = body.split(b"\n\n")
    assert events[-1] == b""  # every event closed by a blank line
    ids = [int(e.split(b"\n")[0][4:]) for e in events[:-1]]
    assert ids == list(range(1, len(ids) + 1))
    assert events[-2].endswith(b"\ndata: [DONE]")
    decoded = EventDecoder().feed(body)
    tokens = [e.data for e in decoded][1:7]
    expected = synthetic_tokens("user: hello", 3, 6)[0]
    assert [t.split('"content":')[1].split("},")[0] for t in tokens] == [
        __import__("json").dumps(x, ensure_ascii=False) for x in expected
    ]


def test_gzip_still_applies_to_other_routes(server: Server) -> None:
    s = RawStream(server.port, "GET", "/metrics", headers={"Accept-Encoding": "gzip"})
    assert s.headers.get("content-encoding") == "gzip"
    raw = s.read_all() if s.chunked else s.read_body_plain()
    s.close()
    assert b"firsttoken_ttft_seconds_bucket" in gzip.decompress(raw)


def test_heartbeat_while_waiting_for_first_token() -> None:
    with run_server("--heartbeat-s", "0.2", "--synthetic-ttft-ms", "900") as srv:
        s = RawStream(srv.port, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2})
        t0 = time.monotonic()
        first = s.read_chunk()
        # The role chunk leaves at once; then only pings until the first token at ~0.9 s.
        assert first.startswith(b"id: 1\n")
        pings = 0
        while True:
            chunk = s.read_chunk()
            if chunk == b": ping\n\n":
                pings += 1
                continue
            break
        assert b'"content":' in chunk
        assert time.monotonic() - t0 >= 0.8
        assert pings >= 2  # heartbeats are comments, never named events
        assert b"event: ping" not in s.read_all()
        s.close()


def test_tokens_leave_one_write_each_when_reader_keeps_up(server: Server) -> None:
    # Per-token writes reach the client as they happen (no buffering in the server).
    s = RawStream(
        server.port,
        "POST",
        "/v1/chat/completions",
        {**CHAT, "max_tokens": 5, "synthetic": {"itl_ms": 60}},
    )
    arrivals = []
    while not s.finished:
        if s.read_chunk():
            arrivals.append(time.monotonic())
    s.close()
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:7])]
    assert len(gaps) >= 3 and all(g > 0.03 for g in gaps)
