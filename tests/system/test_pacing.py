"""--max-stream-bytes-per-s: a low server-wide cap paces many streams fairly and loses
nothing (real server, real sockets); the budget's arithmetic on a fake clock."""

from __future__ import annotations

import json
import threading
import time

import httpx

from firsttoken.core.pacing import Pacer
from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.servers import run_server
from tests.unit.clock import FakeClock


def test_the_budget_refills_at_the_rate_and_may_be_overdrawn_once() -> None:
    clock = FakeClock()
    pacer = Pacer(100_000, clock=clock)  # burst: 16 KiB
    assert pacer.take(16 * 1024 - 100)  # most of the burst
    assert pacer.take(1000)  # a write may overdraw what is left (to -900)...
    assert not pacer.take(10)  # ...and then nothing until it refills
    clock.advance(0.2)  # +20,000 bytes: 19,100
    assert pacer.take(15_000)
    assert pacer.take(5_000)  # overdrawn again
    assert not pacer.take(1)


def read(url: str, prompt: str, out: dict[str, object]) -> None:
    decoder, tokens, done = EventDecoder(), [], False
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": 100,
        "synthetic": {"ttft_ms": 0, "itl_ms": 1},
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for chunk in r.iter_raw():
            for event in decoder.feed(chunk):
                if event.data == "[DONE]":
                    done = True
                else:
                    delta = json.loads(event.data)["choices"][0]["delta"]
                    if delta.get("content"):
                        tokens.append(delta["content"])
    out.update(tokens=tokens, done=done, ended=time.monotonic())


def test_a_low_cap_paces_every_stream_fairly_and_loses_nothing() -> None:
    with run_server("--max-stream-bytes-per-s", "20000", "--rate-limit-per-s", "0") as s:
        results: list[dict[str, object]] = [{} for _ in range(3)]
        started = time.monotonic()
        readers = [
            threading.Thread(target=read, args=(s.url, f"paced {i}", results[i])) for i in range(3)
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join(timeout=60)
        took = [float(r["ended"]) - started for r in results]  # type: ignore[arg-type]
        for i, r in enumerate(results):  # nothing dropped, nothing reordered
            assert r["done"] and r["tokens"] == synthetic_tokens(f"user: paced {i}", None, 100)[0]
        # ~75 KB at 20 KB/s (unpaced, the engine would finish in 0.1 s), shared evenly.
        assert min(took) > 1.5
        assert max(took) / min(took) < 2.0
        assert s.metric("firsttoken_pacing_wait_seconds_total") > 1.0
