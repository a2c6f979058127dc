"""The batching simulation: slots freed by abandoned streams, exact text, step time vs batch."""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from firsttoken.engines.synthetic import synthetic_tokens
from tests.rawhttp import RawStream
from tests.servers import Server, run_server, wait_for

GENERATED = "firsttoken_tokens_generated_total"
# Shedding and rate limits off: queued requests have a long TTFT here on purpose.
OPEN = ("--rate-limit-per-s", "0", "--ttft-slo-ms", "0", "--breaker-error-rate", "1")
TOKEN_CHUNK = b'"delta":{"content":'  # token chunks only (the opening one carries a role)


def disconnected(server: Server) -> float:
    return server.metric('firsttoken_streams_total{outcome="disconnected"}')


def chat(prompt: str, max_tokens: int, **extra: object) -> dict[str, object]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": max_tokens,
        **extra,
    }


def open_stream(server: Server, body: dict[str, object]) -> RawStream:
    s = RawStream(server.port, "POST", "/v1/chat/completions", body)
    assert s.status == 200
    return s


def read_tokens(s: RawStream, n: int) -> None:
    while s.body.count(TOKEN_CHUNK) < n:
        assert s.read_chunk(), "stream ended early"


def ttft(server: Server, prompt: str) -> float:
    """Seconds from sending a request to its first token, on a fresh connection."""
    t0 = time.monotonic()
    s = open_stream(server, chat(prompt, 3))
    try:
        read_tokens(s, 1)
        return time.monotonic() - t0
    finally:
        s.close()


@pytest.fixture(scope="module")
def batch4() -> Iterator[Server]:
    with run_server("--batch-max", "4", "--batch-timeout-ms", "20", *OPEN) as s:
        yield s


def test_abandoned_streams_free_their_slots(batch4: Server) -> None:
    """The seeds' incident: abandoned streams held every slot and concurrency dropped to 0."""
    # Baseline: 4 live streams (~60 steps of 16 ms) hold all 4 slots; a 5th one queues.
    live = [open_stream(batch4, chat(f"live {i}", 60)) for i in range(4)]
    for s in live:
        read_tokens(s, 1)
    blocked = ttft(batch4, "queued behind live streams")
    for s in live:
        s.read_all()
        s.close()

    # 4 long streams (5000 steps, over a minute) take the slots, and their readers vanish.
    gone = disconnected(batch4)
    long = {"synthetic": {"answer_tokens": 5000}}
    abandoned = [open_stream(batch4, chat(f"abandon {i}", 5000, **long)) for i in range(4)]
    for s in abandoned:
        read_tokens(s, 3)
    for s in abandoned:
        s.close()
    wait_for(lambda: disconnected(batch4) == gone + 4, timeout=10)
    stopped = batch4.metric(GENERATED)
    time.sleep(0.3)  # ~20 steps: the counter must not move for them
    assert batch4.metric(GENERATED) == stopped

    # All 4 slots are free again: 4 new requests at once each start within a few steps.
    t0 = time.monotonic()
    fresh = [open_stream(batch4, chat(f"fresh {i}", 3)) for i in range(4)]
    waits = []
    for s in fresh:
        read_tokens(s, 1)
        waits.append(time.monotonic() - t0)
        s.close()
    recovered = max(waits)
    assert blocked > 0.4, f"a 5th stream should queue behind 4 live ones ({blocked:.3f}s)"
    assert recovered < blocked / 2, f"TTFT {recovered:.3f}s after abandon vs {blocked:.3f}s"


def test_text_is_token_exact_through_the_scheduler(batch4: Server) -> None:
    """6 concurrent requests on 4 slots (2 queue): each gets the synthetic text, token-exact."""
    prompts = [f"exact {i}" for i in range(6)]
    results: dict[str, list[str]] = {}

    def run(prompt: str) -> None:
        body = chat(prompt, 40, seed=7)
        parts: list[str] = []
        with httpx.stream("POST", batch4.v1 + "/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if delta.get("content"):
                        parts.append(delta["content"])
        results[prompt] = parts

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for prompt in prompts:
        expected, _ = synthetic_tokens(f"user: {prompt}", 7, 40)
        assert results[prompt] == expected


def test_fail_after_and_stop_are_honoured(batch4: Server) -> None:
    body = chat("fail", 50, synthetic={"fail_after": 5, "error_code": "boom"})
    s = open_stream(batch4, body)
    out = s.read_all()
    s.close()
    assert out.count(TOKEN_CHUNK) == 5
    assert b'"code":"boom"' in out and b"[DONE]" not in out

    tokens, _ = synthetic_tokens("user: stop", None, 40)
    stop = tokens[10].strip() or tokens[11].strip()
    r = httpx.post(
        batch4.v1 + "/chat/completions",
        json={**chat("stop", 40, stop=stop), "stream": False},
        timeout=30,
    ).json()
    text = "".join(tokens)
    assert r["choices"][0]["message"]["content"] == text[: text.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def _token_gaps(server: Server, prompt: str, n: int, out: list[float]) -> None:
    body = chat(prompt, n)
    arrivals: list[float] = []
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith('data: {"id"') and '"delta":{"content":' in line:
                arrivals.append(time.monotonic())
    out.extend(b - a for a, b in itertools.pairwise(arrivals))


def test_step_time_grows_with_batch_size() -> None:
    # Steps of 5 ms + 10 ms per sequence: 15 ms alone, 45 ms with 4 in the batch.
    args = ("--batch-max", "4", "--batch-step-base-ms", "5", "--batch-step-per-seq-ms", "10")
    with run_server(*args, *OPEN) as server:
        alone: list[float] = []
        _token_gaps(server, "alone", 40, alone)
        shared: list[list[float]] = [[] for _ in range(4)]
        threads = [
            threading.Thread(target=_token_gaps, args=(server, f"together {i}", 40, shared[i]))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    gap1 = statistics.median(alone)
    gap4 = statistics.median([g for gaps in shared for g in gaps])
    assert gap1 > 0.015 * 0.7, gap1
    assert gap4 > 0.045 * 0.7, gap4
    assert gap4 > 1.5 * gap1, (gap1, gap4)
