"""The relay engine (`--engine openai`) against real upstreams: firsttoken itself, and a
scripted server that puts each real error shape (vLLM, TGI, llama.cpp, OpenAI) on the wire."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest

from firsttoken.engines import synthetic_tokens
from firsttoken.engines.remote import upstream_base
from firsttoken.engines.text import apply_stop
from firsttoken.formats.sse import EventDecoder
from tests.rawhttp import RawStream
from tests.servers import ROOT, Server, run_server, wait_for
from tests.upstreams import (
    BEFORE,
    LLAMACPP_ERROR,
    OPENAI_429,
    OPENAI_ERROR,
    TGI_ERROR,
    TGI_VALIDATION,
    VLLM_FLAT_ERROR,
    VLLM_STREAM_ERROR,
    ScriptedUpstream,
    free_port,
    scripted_upstream,
)

GENERATED = "firsttoken_tokens_generated_total"
OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0")  # errors and bursts on purpose
# The upstreams trust the relay's trace headers: its stream id is their trace id.
UPSTREAM = ("--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "5", "--trust-trace-headers", *OPEN)
RELAY = ("--engine", "openai", *OPEN)


def outcome(server: Server, name: str) -> float:
    return server.metric(f'firsttoken_streams_total{{outcome="{name}"}}')


def streams(server: Server) -> float:
    m = server.metrics()
    return sum(v for k, v in m.items() if k.startswith("firsttoken_streams_total{"))


@pytest.fixture(scope="module")
def ups() -> Iterator[tuple[Server, Server]]:
    with run_server(*UPSTREAM) as a, run_server(*UPSTREAM) as b:
        yield a, b


@pytest.fixture(scope="module")
def relay(ups: tuple[Server, Server]) -> Iterator[Server]:
    a, b = ups
    # Both URL forms: with the /v1 API root, and a bare base URL.
    with run_server(*RELAY, "--upstream", f"{a.v1},{b.url}") as r:
        yield r


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedUpstream, Server]]:
    with (
        scripted_upstream() as up,
        run_server(*RELAY, "--upstream", up.url, "--upstream-read-timeout-s", "1") as r,
    ):
        yield up, r


def chat_tokens(prompt: str, seed: int | None, max_tokens: int | None) -> list[str]:
    return synthetic_tokens(f"user: {prompt}", seed, max_tokens)[0]


def sse(
    server: Server, model: str, *, chat: bool = True, extra: dict | None = None
) -> tuple[str, dict | None, bool]:
    """Stream one request; (text, the error event's error object or None, saw [DONE])."""
    body: dict = {"model": model, "stream": True, **(extra or {})}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    path = "/chat/completions" if chat else "/completions"
    text, error, done = "", None, False
    decoder = EventDecoder()
    with httpx.stream("POST", server.v1 + path, json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for chunk in resp.iter_raw():
            for event in decoder.feed(chunk):
                if event.event == "error":
                    error = json.loads(event.data or "")["error"]
                elif event.data == "[DONE]":
                    done = True
                else:
                    choice = (json.loads(event.data or "")["choices"] or [{}])[0]
                    part = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    text += part or ""
    return text, error, done


# -- through a real firsttoken upstream ---------------------------------------------------


def test_upstream_url_forms() -> None:
    assert upstream_base("http://h:8000") == "http://h:8000/v1"
    assert upstream_base("http://h:8000/") == "http://h:8000/v1"
    assert upstream_base("http://h:8000/v1/") == "http://h:8000/v1"
    assert upstream_base("https://api.example.com/openai/v1") == "https://api.example.com/openai/v1"


def test_models_come_from_the_upstreams(relay: Server) -> None:
    ids = [m["id"] for m in httpx.get(relay.v1 + "/models", timeout=10).json()["data"]]
    assert ids == ["synthetic"]


def test_chat_streams_token_by_token(relay: Server) -> None:
    client = openai.OpenAI(base_url=relay.v1, api_key="unused")
    deltas, finish = [], None
    for chunk in client.chat.completions.create(
        model="synthetic",
        messages=[{"role": "user", "content": "relay me"}],
        stream=True,
        max_tokens=40,
        seed=7,
    ):
        choice = chunk.choices[0]
        if choice.delta.content:
            deltas.append(choice.delta.content)
        finish = choice.finish_reason or finish
    assert deltas == chat_tokens("relay me", 7, 40)  # one chunk per upstream token
    assert finish == "length"


def test_completion_streams_token_by_token_with_stop(relay: Server) -> None:
    client = openai.OpenAI(base_url=relay.v1, api_key="unused")
    texts = [
        c.choices[0].text
        for c in client.completions.create(
            model="synthetic", prompt="complete me", stream=True, seed=3, stop=["."]
        )
        if c.choices and c.choices[0].text
    ]
    expected, stopped = apply_stop(synthetic_tokens("complete me", 3)[0], (".",))
    assert stopped and texts == expected


def test_non_streaming_request(relay: Server) -> None:
    client = openai.OpenAI(base_url=relay.v1, api_key="unused")
    answer = client.chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "whole"}], max_tokens=12
    )
    assert answer.choices[0].message.content == "".join(chat_tokens("whole", None, 12))


def finished(server: Server, key: str, stream_id: str) -> dict | None:
    for r in server.log_records():
        if r["event"] == "stream.finished" and r[key] == stream_id:
            return r
    return None


def test_disconnect_closes_the_upstream_request(relay: Server, ups: tuple[Server, Server]) -> None:
    s = RawStream(
        relay.port,
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "long answer"}],
            "stream": True,
            "max_tokens": 300,
            "synthetic": {"itl_ms": 50},  # passed through to the upstream
        },
    )
    while s.body.count(b'"content":"') < 10:
        assert s.read_chunk(), "stream ended early"
    stream_id = s.headers["x-stream-id"]
    s.close()
    # The relay's stream id travels as X-Request-Id: the upstream's trace id.
    mine = wait_for(lambda: finished(relay, "stream", stream_id))
    theirs = wait_for(
        lambda: next(filter(None, (finished(u, "trace_id", stream_id) for u in ups)), None)
    )
    # The relay closed its upstream response, so the upstream saw its client leave...
    assert (mine["outcome"], theirs["outcome"]) == ("disconnected", "disconnected")
    # ...within a token or two of the relay's own stop (50 ms each; a bound on the hop, not
    # on how fast this shared machine noticed the test's close).
    extra = theirs["tokens_generated"] - mine["tokens_generated"]
    assert 0 <= extra <= 2, f"the upstream made {extra} tokens after the relay stopped"
    frozen = sum(u.metric(GENERATED) for u in ups)
    time.sleep(0.3)  # 6 token intervals: nothing more is generated upstream
    assert sum(u.metric(GENERATED) for u in ups) == frozen


def test_concurrent_streams_use_both_upstreams(relay: Server, ups: tuple[Server, Server]) -> None:
    before = [outcome(u, "completed") for u in ups]
    results: list[bool] = []

    def one(i: int) -> None:
        text, error, done = sse(relay, "synthetic", extra={"max_tokens": 30, "seed": i})
        results.append(error is None and done and text == "".join(chat_tokens("hi", i, 30)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [True] * 8
    used = [outcome(u, "completed") - b for u, b in zip(ups, before, strict=True)]
    assert sum(used) == 8 and min(used) >= 2, used


def test_failure_after_tokens_is_not_retried(relay: Server, ups: tuple[Server, Server]) -> None:
    before = sum(streams(u) for u in ups)
    text, error, done = sse(
        relay, "synthetic", extra={"synthetic": {"fail_after": 5, "error_code": "gpu_fell_over"}}
    )
    assert error is not None and error["code"] == "gpu_fell_over"
    assert "after 5 tokens" in error["message"]
    assert text == "".join(chat_tokens("hi", None, None)[:5])  # no text twice
    assert not done
    assert sum(streams(u) for u in ups) == before + 1  # one upstream request, no retry


# -- error shapes on the wire ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "code", "message", "text"),
    [
        ("vllm-error", "upstream_400", VLLM_STREAM_ERROR["error"]["message"], BEFORE),
        ("vllm-flat-error", "upstream_400", VLLM_FLAT_ERROR["message"], BEFORE),
        ("tgi-error", "generation", TGI_ERROR["error"], BEFORE),
        ("llamacpp-error", "upstream_500", LLAMACPP_ERROR["message"], BEFORE),
        ("llamacpp-data-error", "upstream_500", LLAMACPP_ERROR["message"], BEFORE),
        ("openai-event-error", "server_error", OPENAI_ERROR["error"]["message"], BEFORE),
        ("early-error", "upstream_400", VLLM_STREAM_ERROR["error"]["message"], ""),
        ("cut", "upstream_truncated", "before it finished", BEFORE),
        ("cut-chunked", "upstream_truncated", "broke mid-stream", BEFORE),
        ("hang", "upstream_timeout", "nothing for too long", BEFORE),
        ("hang-before", "upstream_timeout", "nothing for too long", ""),
        ("http-500", "upstream_500", LLAMACPP_ERROR["message"], ""),
        ("http-503", "upstream_503", "503 Service Unavailable", ""),
        ("http-400", "upstream_rejected", VLLM_FLAT_ERROR["message"], ""),
        ("http-422", "upstream_rejected", TGI_VALIDATION["error"], ""),
        ("http-429", "rate_limit_exceeded", OPENAI_429["error"]["message"], ""),
    ],
)
def test_upstream_errors_are_normalised(
    scripted: tuple[ScriptedUpstream, Server], model: str, code: str, message: str, text: str
) -> None:
    _, relay = scripted
    got, error, done = sse(relay, model)
    assert error is not None, got
    assert error["code"] == code
    assert message in error["message"]
    assert got == text  # what came before the failure was delivered, once
    assert not done


def whole(server: Server, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=30)


def test_an_upstream_error_page_reaches_the_client_as_its_status_only(
    scripted: tuple[ScriptedUpstream, Server],
) -> None:
    # Issue 37.7: "the upstream answered 400: Traceback ... sk-UPSTREAM-SECRET-123456 ...
    # auth.internal.corp:8443", ANSI and CRLF included, reached the client.
    _, relay = scripted
    r = whole(relay, "http-400-traceback")
    assert r.status_code == 400  # the upstream's status, passed on
    error = r.json()["error"]
    assert error["message"] == "the upstream answered 400 Bad Request"
    _, streamed, _ = sse(relay, "http-400-traceback")
    assert streamed is not None and streamed["message"] == error["message"]
    # An error-shaped message passes (--upstream-errors pass, the default), cleaned.
    _, shaped, _ = sse(relay, "http-500-secret")
    assert shaped is not None and shaped["message"] == "db.internal.corp:5432 password=hunter2"
    # The whole text is the server's: in its log, with the request's trace id.
    said = [r for r in relay.log_records() if r["event"] == "relay.upstream_error"]
    assert any("sk-UPSTREAM-SECRET-123456" in r["said"] for r in said)


def test_redacted_upstream_errors_stay_in_the_log() -> None:
    with (
        scripted_upstream() as up,
        run_server(*RELAY, "--upstream", up.url, "--upstream-errors", "redact") as relay,
    ):
        r = whole(relay, "http-500-secret")
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["message"] == "the upstream answered 500 Internal Server Error"
        assert error["code"] == "upstream_500"
        trace = r.headers["x-request-id"]
        wait_for(lambda: any(x["event"] == "relay.upstream_error" for x in relay.log_records()))
        said = [x for x in relay.log_records() if x["event"] == "relay.upstream_error"]
        assert said[-1]["trace_id"] == trace and "hunter2" in said[-1]["said"]
        _, streamed, _ = sse(relay, "vllm-flat-error")  # even a shaped in-stream message
        assert streamed is not None and VLLM_FLAT_ERROR["message"] not in streamed["message"]


def test_a_bad_upstream_errors_setting_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "firsttoken", "serve", "--upstream-errors", "hide"],
        env={"FIRSTTOKEN_UPSTREAM_ERRORS": "x", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--upstream-errors 'hide': must be one of pass, redact" in proc.stderr


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("model", ["ok", "ok-no-done"])
def test_scripted_success(
    scripted: tuple[ScriptedUpstream, Server], model: str, chat: bool
) -> None:
    text, error, done = sse(scripted[1], model, chat=chat)
    assert (text, error, done) == ("Hello, world", None, True)


def test_sdk_raises_the_normalised_error(scripted: tuple[ScriptedUpstream, Server]) -> None:
    client = openai.OpenAI(base_url=scripted[1].v1, api_key="unused", max_retries=0)
    text = ""
    with pytest.raises(openai.APIError) as info:
        for chunk in client.completions.create(model="tgi-error", prompt="x", stream=True):
            text += chunk.choices[0].text
    assert info.value.code == "generation" and text == BEFORE


def test_hung_upstream_connection_is_closed(scripted: tuple[ScriptedUpstream, Server]) -> None:
    up, relay = scripted
    closed = up.closed_early
    sse(relay, "hang")
    wait_for(lambda: up.closed_early > closed, timeout=5)


# -- several upstreams ----------------------------------------------------------------------


def test_failover_before_the_first_token(ups: tuple[Server, Server]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        refusing = stack.enter_context(scripted_upstream({"synthetic": "http-503"}))
        early = stack.enter_context(scripted_upstream({"synthetic": "early-error"}))
        upstreams = f"{dead},{refusing.url},{early.url},{ups[0].url}"
        relay = stack.enter_context(run_server(*RELAY, "--upstream", upstreams))
        for seed in range(4):
            text, error, done = sse(relay, "synthetic", extra={"seed": seed, "max_tokens": 20})
            assert (error, done) == (None, True)
            assert text == "".join(chat_tokens("hi", seed, 20))
        # Each broken upstream was tried, and each time the next one took over.
        assert refusing.posts and early.posts
        # The shorthand names its targets upstream-1, upstream-2, ... in the given order.
        failed = {r["target"] for r in relay.log_records() if r["event"] == "route.target_failed"}
        assert failed == {"upstream-1", "upstream-2", "upstream-3"}
        failovers = [r for r in relay.log_records() if r["event"] == "route.failover"]
        assert len(failovers) >= 3
        metrics = relay.metrics()
        assert metrics["firsttoken_relay_failovers_total"] == len(failovers)
        by_phase = {
            phase: metrics.get(
                f'firsttoken_failovers_total{{phase="{phase}",route="default"}}', 0.0
            )
            for phase in ("connect", "first_token", "mid_stream")
        }
        # The refused connect and the 503 are `connect`; the error event before any token
        # is `first_token`; nothing was spliced.
        assert by_phase["connect"] >= 2 and by_phase["first_token"] >= 1
        assert by_phase["mid_stream"] == 0


def test_start_fails_loudly_without_an_upstream() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "firsttoken", "serve", "--port", "0", *RELAY, "--upstream", dead],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "no upstream answered GET /models" in proc.stdout + proc.stderr
    assert '"listening"' not in proc.stdout
