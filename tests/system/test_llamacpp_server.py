"""A real upstream that no one here wrote: llama-cpp-python's own OpenAI-compatible server
(`python -m llama_cpp.server`) with SmolLM2-135M, two of them behind a routes file. One is
killed mid-answer; the answer goes on on the other through `/v1/completions`, with the chat
template rendered by the gateway (it does not understand `continue_final_message`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from firsttoken.engines.llamacpp import default_model_path
from firsttoken.formats.sse import EventDecoder
from tests.servers import ROOT, run_server, wait_for
from tests.upstreams import free_port

# A system message of our own: SmolLM2's template adds its default one only when there is
# none, and the gateway renders plain ChatML for the continuation.
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a few sentences about the sea."},
]
MAX_TOKENS = 64


class LlamaServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(default_model_path()),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--n_ctx",
                "2048",
                "--verbose",
                "false",
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/models", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def llama() -> Iterator[tuple[LlamaServer, LlamaServer]]:
    a, b = LlamaServer(), LlamaServer()
    try:
        wait_for(lambda: a.ready() and b.ready(), timeout=90, interval=0.2)
        yield a, b
    finally:
        a.kill()
        b.kill()


def _routes(tmp: Path, a: LlamaServer, b: LlamaServer) -> str:
    path = tmp / "routes.toml"
    path.write_text(
        "\n".join(
            f'[targets.{name}]\nkind = "openai"\nurl = "{s.url}"\nmodel = "smollm2"\n'
            'continuation = "completions"\nidle_timeout_s = 5\n'
            for name, s in (("a", a), ("b", b))
        )
        + '\n[models.smollm2]\ntargets = ["a", "b"]\n'
    )
    return str(path)


def _body() -> dict:
    return {
        "model": "smollm2",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }


def test_killed_mid_answer_the_answer_goes_on_elsewhere(
    tmp_path: Path, llama: tuple[LlamaServer, LlamaServer]
) -> None:
    a, b = llama
    # The answer uninterrupted, straight from b.
    whole = httpx.post(b.url + "/chat/completions", json={**_body(), "stream": False}, timeout=60)
    assert whole.status_code == 200, whole.text
    expected = whole.json()["choices"][0]["message"]["content"]
    with run_server("--routes", _routes(tmp_path, a, b)) as gw:
        text, chunks, before_kill, error, done, finish = "", 0, "", None, 0, None
        decoder = EventDecoder()
        with httpx.stream("POST", gw.v1 + "/chat/completions", json=_body(), timeout=60) as r:
            assert r.status_code == 200
            for raw in r.iter_raw():
                for event in decoder.feed(raw):
                    if event.event == "error":
                        error = json.loads(event.data or "")["error"]
                    elif event.data == "[DONE]":
                        done += 1
                    elif event.data:
                        choice = json.loads(event.data)["choices"][0]
                        piece = choice["delta"].get("content") or ""
                        text += piece
                        chunks += bool(piece)
                        finish = choice["finish_reason"] or finish
                        if chunks == 8 and not before_kill:
                            before_kill = text
                            a.kill()  # mid-answer, with tokens on their way
        # What the client sees: one answer that went on past the kill, and ended properly.
        assert error is None and done == 1, (text, error)
        assert finish in ("stop", "length")
        assert text.startswith(before_kill) and len(text) > len(before_kill)
        splices = [r for r in gw.log_records() if r["event"] == "route.splice"]
        assert [(s["from"], s["to"]) for s in splices] == [("a", "b")]
        # The continuation is the model's own, from the text as sent; it re-reads that text
        # as a prompt (tokenized anew, under our ChatML rendering), so it may word the rest
        # differently from an uninterrupted answer: the same opening is all that is promised.
        assert expected[: len(before_kill)] == before_kill
