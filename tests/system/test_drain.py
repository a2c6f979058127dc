"""Graceful drain on SIGTERM, with a real server process and real signals."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from firsttoken.engines.synthetic import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.events import tokens_of
from tests.redis_server import run_redis
from tests.servers import run_server, wait_for

BODY = {"model": "synthetic", "messages": [{"role": "user", "content": "drain"}], "stream": True}


def read_stream(url: str, body: dict, out: dict) -> None:
    decoder = EventDecoder()
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        out["status"] = r.status_code
        for chunk in r.iter_raw():
            events += decoder.feed(chunk)
            out["events"] = len(events)
    out["last"] = events[-1] if events else None
    out["done"] = any(e.data == "[DONE]" for e in events)


def start_reading(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A stream (20 ms a token) read by a thread, once its first events have come."""
    out: dict = {}
    body = {**BODY, "synthetic": {"itl_ms": 20}, "max_tokens": max_tokens}
    reader = threading.Thread(target=read_stream, args=(url, body, out))
    reader.start()
    wait_for(lambda: out.get("events", 0) > 2)
    return reader, out


def test_sigterm_drains_then_ends_what_still_runs_with_server_shutdown() -> None:
    with run_server("--drain-timeout-s", "1.5", "--synthetic-ttft-ms", "10") as s:
        reader, long = start_reading(s.url, 1000)
        s.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(s.url + "/readyz").status_code == 503)
        assert httpx.get(s.url + "/readyz").json()["status"] == "draining"
        refused = httpx.post(s.url + "/v1/chat/completions", json=BODY)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "server_draining"
        started = time.monotonic()
        reader.join(timeout=10)
        assert 1.0 < time.monotonic() - started < 4.0
        assert long["status"] == 200 and not long["done"]
        assert long["last"].event == "error" and "server_shutdown" in long["last"].data
        assert s.proc.wait(timeout=10) == 0
        events = [r.get("event") for r in s.log_records()]
        assert "drain.start" in events and "drain.end" in events


def test_a_drain_ends_as_soon_as_the_running_streams_finish() -> None:
    with run_server("--drain-timeout-s", "30", "--synthetic-ttft-ms", "10") as s:
        reader, short = start_reading(s.url, 40)
        started = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        reader.join(timeout=10)
        assert short["done"]  # it finished whole
        assert s.proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 5  # not the 30 s drain timeout


def test_a_second_signal_cuts_the_drain_short() -> None:
    with run_server("--drain-timeout-s", "60", "--synthetic-ttft-ms", "10") as s:
        reader, long = start_reading(s.url, 1000)
        s.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(s.url + "/readyz").status_code == 503)
        s.proc.send_signal(signal.SIGTERM)
        reader.join(timeout=10)
        assert long["last"].event == "error" and "server_shutdown" in long["last"].data
        assert s.proc.wait(timeout=10) == 0


def test_with_redis_a_drain_hands_the_stream_to_the_instance_its_reader_reaches() -> None:
    """Nobody was reading it at the SIGTERM: the instance its reader reaches later takes it
    over and finishes it (`test_takeover.py` holds the rest of the hand-over)."""
    with run_redis() as url:
        args = ("--redis", url, "--synthetic-ttft-ms", "10", "--synthetic-itl-ms", "20")
        with run_server(*args, "--drain-timeout-s", "30") as a, run_server(*args) as b:
            created = httpx.post(
                a.v1 + "/streams", json={"prompt": "leaving", "max_tokens": 100}, timeout=10
            ).json()
            wait_for(lambda: a.metric("firsttoken_tokens_generated_total") > 5)
            started = time.monotonic()
            a.proc.send_signal(signal.SIGTERM)
            assert a.proc.wait(timeout=10) == 0
            assert time.monotonic() - started < 2.5  # not the 30 s drain
            r = httpx.get(b.url + created["events_url"], timeout=20)
            tokens, _, done, error = tokens_of(r.content)
            assert r.status_code == 200 and done and error is None
            assert tokens == synthetic_tokens("leaving", None, 100)[0]
