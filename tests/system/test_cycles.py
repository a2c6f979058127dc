"""A request leaves no reference cycles behind: what it made is freed by reference counting
as it ends, not by the cyclic collector, whose passes stop the event loop (~18 objects a
request in cycles made a 25 ms pause every ~1,000 streams, in every stream's TTFT tail).

The server runs with `tests/gc_probe` on its path: after a warm-up, it keeps whatever the
collector finds instead of freeing it, and reports it by type."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.servers import Server, run_server

PROBE = Path(__file__).resolve().parents[1] / "gc_probe"
CHAT = {"model": "synthetic", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def _env(out: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(PROBE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "FIRSTTOKEN_TEST_GC_OUT": str(out)}


def _records(out: Path, n: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = out.read_text().splitlines() if out.exists() else []
        if len(lines) >= n:
            return [json.loads(line) for line in lines]
        time.sleep(0.05)
    raise AssertionError(f"the probe wrote {out.read_text() if out.exists() else 'nothing'}")


@contextmanager
def probed(out: Path, *args: str) -> Iterator[Server]:
    with run_server(*args, env=_env(out)) as server:
        yield server


def cycles_after(server: Server, out: Path, requests: list[Callable[[], None]]) -> dict:
    """What the collector finds made by `requests`, run after each ran once (a warm-up:
    lazy imports and caches are made once, not per request)."""
    for request in requests:
        request()
    server.proc.send_signal(signal.SIGUSR2)
    _records(out, 1)
    for _ in range(5):
        for request in requests:
            request()
    time.sleep(0.5)  # streams whose client left end on the server's side
    server.proc.send_signal(signal.SIGUSR2)
    return _records(out, 2)[1]["garbage"]


def chat_kinds(url: str) -> list[Callable[[], None]]:
    def streamed() -> None:
        with httpx.stream("POST", url, json={**CHAT, "stream": True}, timeout=10) as r:
            assert r.status_code == 200
            assert r.read().endswith(b"data: [DONE]\n\n")

    def whole() -> None:
        r = httpx.post(url, json=CHAT, timeout=10)
        assert r.status_code == 200, r.text

    def cut() -> None:  # the client leaves after its first bytes
        body = {**CHAT, "stream": True, "max_tokens": 500}
        with httpx.stream("POST", url, json=body, timeout=10) as r:
            assert next(r.iter_bytes())

    def refused() -> None:
        r = httpx.post(url, json={**CHAT, "max_tokens": -1}, timeout=10)
        assert r.status_code == 400

    return [streamed, whole, cut, refused]


def test_every_api_leaves_no_cycles(tmp_path: Path) -> None:
    out = tmp_path / "gc.jsonl"
    with probed(out, "--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "2") as server:
        base = server.url

        def native() -> None:
            r = httpx.post(f"{base}/v1/streams", json={"prompt": "hi", "max_tokens": 5})
            assert r.status_code == 201, r.text
            events = httpx.get(base + r.json()["events_url"], timeout=10)
            assert b"event: done" in events.content or b"[DONE]" in events.content

        def messages() -> None:
            body = {**CHAT, "stream": True}
            r = httpx.post(f"{base}/v1/messages", json=body, timeout=10)
            assert b"message_stop" in r.content

        def responses() -> None:
            body = {"model": "synthetic", "input": "hi", "stream": True, "max_output_tokens": 8}
            r = httpx.post(f"{base}/v1/responses", json=body, timeout=10)
            assert b"event: response.incomplete" in r.content  # at max_output_tokens

        def page() -> None:
            assert httpx.get(f"{base}/healthz").status_code == 200
            assert httpx.get(f"{base}/").status_code == 200

        kinds = [*chat_kinds(f"{base}/v1/chat/completions"), native, messages, responses, page]
        assert cycles_after(server, out, kinds) == {}


def test_the_relay_leaves_no_cycles(tmp_path: Path) -> None:
    """Through a route to an upstream, a client that leaves included (the leg's failure, the
    upstream connection closed before its end)."""
    out = tmp_path / "gc.jsonl"
    with run_server("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "2") as upstream:
        relay_args = ("--engine", "openai", "--upstream", upstream.v1)
        with probed(out, *relay_args) as server:
            kinds = chat_kinds(f"{server.v1}/chat/completions")
            assert cycles_after(server, out, kinds) == {}
