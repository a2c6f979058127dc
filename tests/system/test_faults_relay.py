"""Upstream faults through the relay, injected for real: an upstream process killed mid-answer,
one that stalls, garbage on the wire, a proxy's HTML 502. Each is one `event: error` with a
stable code, the text before it is kept, the breaker counts it, and the gateway stays healthy.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.servers import Server, run_server, wait_for
from tests.upstreams import BEFORE, ScriptedUpstream, scripted_upstream

OPEN = ("--rate-limit-per-s", "0")
RELAY = ("--engine", "openai", "--upstream-read-timeout-s", "1", *OPEN)


def stream_chat(
    server: Server, model: str, *, extra: dict | None = None, on_text=None
) -> tuple[int, str, dict | None, bool]:
    """(status, text, the error object or None, saw [DONE]) of one chat stream."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    body.update(extra or {})
    text, error, done = "", None, False
    decoder = EventDecoder()
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=30) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, "", resp.json()["error"], False
        for chunk in resp.iter_raw():
            for event in decoder.feed(chunk):
                if event.event == "error":
                    error = json.loads(event.data or "")["error"]
                elif event.data == "[DONE]":
                    done = True
                else:
                    choices = json.loads(event.data or "")["choices"]
                    text += (choices[0].get("delta", {}).get("content") if choices else "") or ""
                    if on_text is not None:
                        on_text(text)
    return 200, text, error, done


def open_fds(server: Server) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedUpstream, Server]]:
    with (
        scripted_upstream() as up,
        run_server(*RELAY, "--breaker-error-rate", "1", "--upstream", up.url) as relay,
    ):
        yield up, relay


@pytest.mark.parametrize(
    ("model", "code", "message", "text"),
    [
        ("html-502", "upstream_502", "502 Bad Gateway", ""),
        ("html-200", "upstream_bad_response", "no events", ""),
        ("bad-json", "upstream_bad_response", "non-JSON data", BEFORE),
        ("bad-shape", "upstream_bad_response", "wrong shape", BEFORE),
        ("bad-type", "upstream_bad_response", "wrong shape", BEFORE),
        ("json-array", "upstream_bad_response", "JSON list", BEFORE),
        ("no-newline", "upstream_bad_response", "malformed SSE", BEFORE),
        ("malformed-sse", "upstream_truncated", "before it finished", BEFORE),
        ("binary", "upstream_bad_response", "no events", ""),
        ("cut-chunked", "upstream_truncated", "broke mid-stream", BEFORE),
        ("hang", "upstream_timeout", "nothing for too long", BEFORE),
    ],
)
def test_a_broken_upstream_is_one_clear_error(
    scripted: tuple[ScriptedUpstream, Server], model: str, code: str, message: str, text: str
) -> None:
    _, relay = scripted
    status, got, error, done = stream_chat(relay, model)
    assert status == 200 and error is not None, got
    assert (error["code"], got, done) == (code, text, False)
    assert message in error["message"]
    assert "<" not in error["message"]  # a proxy's HTML page reads as its text


def test_the_gateway_stays_healthy_after_every_fault(
    scripted: tuple[ScriptedUpstream, Server],
) -> None:
    _, relay = scripted
    faults = ["html-502", "bad-json", "no-newline", "binary", "cut-chunked", "html-200"]
    stream_chat(relay, "ok")  # warm the pool
    fds = open_fds(relay)
    for _ in range(3):
        for model in faults:
            assert stream_chat(relay, model)[2] is not None
    assert stream_chat(relay, "ok")[1:] == ("Hello, world", None, True)
    assert httpx.get(relay.url + "/healthz", timeout=5).status_code == 200
    assert relay.proc.poll() is None
    assert wait_for(lambda: relay.metric("firsttoken_active_streams") == 0, timeout=5)
    assert open_fds(relay) <= fds + 2  # no leaked upstream connections
    crashed = [r for r in relay.log_records() if r["event"] == "stream.crashed"]
    assert crashed == []  # every fault is an EngineError, none an internal_error


def test_upstream_process_killed_mid_answer() -> None:
    """SIGKILL the upstream after some tokens: the client keeps them and gets one error."""
    with (
        run_server("--synthetic-ttft-ms", "10", "--synthetic-itl-ms", "40", *OPEN) as up,
        run_server(*RELAY, "--breaker-error-rate", "1", "--upstream", up.url) as relay,
    ):
        killed = threading.Event()

        def kill_after_five(text: str) -> None:
            if not killed.is_set() and len(text) > 0 and text.count(" ") >= 4:
                killed.set()
                up.kill()

        extra = {"max_tokens": 200, "seed": 1}
        status, text, error, done = stream_chat(
            relay, "synthetic", extra=extra, on_text=kill_after_five
        )
        assert killed.is_set() and status == 200
        assert error is not None and error["code"] == "upstream_truncated", error
        assert not done
        full = "".join(synthetic_tokens("user: hi", 1, 200)[0])
        assert text and full.startswith(text) and text != full  # a prefix, each token once
        # The next stream finds the upstream gone: a clear error, and the gateway lives on.
        status, text, error, _ = stream_chat(relay, "synthetic")
        assert (status, text) == (200, "") and error is not None
        assert error["code"] == "upstream_unavailable"
        assert httpx.get(relay.url + "/healthz", timeout=5).status_code == 200


def test_the_breaker_sees_upstream_faults(scripted: tuple[ScriptedUpstream, Server]) -> None:
    up, _ = scripted
    breaker = ("--breaker-error-rate", "0.5", "--breaker-min-streams", "4")
    with run_server(*RELAY, *breaker, "--breaker-open-s", "2", "--upstream", up.url) as relay:
        for model in ("html-502", "bad-json", "cut-chunked", "no-newline"):
            assert stream_chat(relay, model)[2] is not None
        status, _, error, _ = stream_chat(relay, "ok")
        assert (status, error and error["code"]) == (503, "engine_unavailable")
        ready = httpx.get(relay.url + "/readyz", timeout=5)
        assert ready.status_code == 503 and "breaker" in ready.json()["reasons"]
        assert httpx.get(relay.url + "/healthz", timeout=5).status_code == 200
        assert relay.metric('firsttoken_breaker_state{state="open"}') == 1
        time.sleep(2.1)  # the breaker lets one probe through; a good upstream closes it
        assert stream_chat(relay, "ok")[1:] == ("Hello, world", None, True)
        assert relay.metric('firsttoken_breaker_state{state="closed"}') == 1
        assert httpx.get(relay.url + "/readyz", timeout=5).status_code == 200
