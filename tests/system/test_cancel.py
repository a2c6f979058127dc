"""Cancellation: a client that leaves, or the cancel endpoint, stops the engine within a token."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.rawhttp import RawStream
from tests.servers import Server, run_server, wait_for

GENERATED = "firsttoken_tokens_generated_total"
ACTIVE = "firsttoken_active_streams"


def outcome(server: Server, name: str) -> float:
    return server.metric(f'firsttoken_streams_total{{outcome="{name}"}}')


@pytest.fixture(scope="module")
def slow() -> Iterator[Server]:
    """ITL 20 ms: the seeds' pace, so 'within one token' means within 20 ms."""
    with run_server(
        "--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "20", "--resume-grace-s", "0.3"
    ) as s:
        yield s


def read_content_events(s: RawStream, n: int) -> None:
    while s.body.count(b'"content":"') + s.body.count(b'{"token":') < n:
        assert s.read_chunk(), "stream ended early"


def test_disconnect_after_ten_chunks_stops_generation(slow: Server) -> None:
    disconnected = outcome(slow, "disconnected")
    s = RawStream(
        slow.port,
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "long answer"}],
            "stream": True,
            "max_tokens": 300,
        },
    )
    read_content_events(s, 10)
    before = slow.metric(GENERATED)
    s.close()
    wait_for(lambda: outcome(slow, "disconnected") == disconnected + 1)
    after = slow.metric(GENERATED)
    time.sleep(0.3)  # 15 more token intervals: the counter must not move
    final = slow.metric(GENERATED)
    assert final == after
    assert final - before <= 1, f"{final - before} tokens generated after the close"
    assert slow.metric(ACTIVE) == 0


def test_cancel_endpoint_stops_native_stream(slow: Server) -> None:
    cancelled = outcome(slow, "cancelled")
    created = httpx.post(slow.v1 + "/streams", json={"prompt": "cancel me"}, timeout=10).json()
    s = RawStream(slow.port, "GET", created["events_url"])
    assert s.status == 200
    read_content_events(s, 5)
    r = httpx.post(
        f"{slow.v1}/streams/{created['id']}/cancel",
        headers={"Authorization": f"Bearer {created['resume_token']}"},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["outcome"] == "cancelled"
    before = slow.metric(GENERATED)
    body = s.read_all()  # the stream ends by itself, with a reason
    s.close()
    assert b'event: error\ndata: {"error":{"code":"cancelled"' in body
    assert b"[DONE]" not in body
    assert outcome(slow, "cancelled") == cancelled + 1
    time.sleep(0.2)
    assert slow.metric(GENERATED) == before


def test_delete_also_cancels(slow: Server) -> None:
    created = httpx.post(slow.v1 + "/streams", json={"prompt": "x"}, timeout=10).json()
    r = httpx.delete(
        f"{slow.v1}/streams/{created['id']}?token={created['resume_token']}", timeout=10
    )
    assert r.status_code == 200 and r.json()["outcome"] == "cancelled"


def test_abandoned_native_stream_stops_after_grace(slow: Server) -> None:
    disconnected = outcome(slow, "disconnected")
    created = httpx.post(slow.v1 + "/streams", json={"prompt": "abandon"}, timeout=10).json()
    s = RawStream(slow.port, "GET", created["events_url"])
    read_content_events(s, 3)
    s.close()
    # Generation goes on for the 0.3 s grace window (a reader may come back), then stops.
    wait_for(lambda: outcome(slow, "disconnected") == disconnected + 1, timeout=5)
    stopped = slow.metric(GENERATED)
    time.sleep(0.2)
    assert slow.metric(GENERATED) == stopped


def test_non_streaming_request_stops_when_client_gives_up(slow: Server) -> None:
    disconnected = outcome(slow, "disconnected")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            slow.v1 + "/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 300},
            timeout=0.3,
        )
    wait_for(lambda: outcome(slow, "disconnected") == disconnected + 1, timeout=5)
    stopped = slow.metric(GENERATED)
    time.sleep(0.2)
    assert slow.metric(GENERATED) == stopped
