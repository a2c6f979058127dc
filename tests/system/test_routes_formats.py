"""Splices across formats, on real firsttoken upstreams (the synthetic engine continues an
answer like vLLM, and takes an Anthropic prefill): an Anthropic-format upstream behind an
OpenAI client, and an OpenAI upstream behind an Anthropic client, each cut mid-answer by a
proxy that drops the connection. The client's text must equal the uninterrupted answer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.proxy import CuttableProxy
from tests.servers import Server, run_server

UPSTREAM = ("--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "15", "--rate-limit-per-s", "0")
MAX_TOKENS = 60
CUT_AFTER = 12  # chunks the client reads before the first target's connection drops


@pytest.fixture(scope="module")
def ups() -> Iterator[tuple[Server, Server]]:
    with run_server(*UPSTREAM) as u1, run_server(*UPSTREAM) as u2:
        yield u1, u2


def _gateway(tmp: Path, first: str, first_url: str, second: str, second_url: str) -> str:
    path = tmp / "routes.toml"
    continuation = {"openai": "vllm", "anthropic": "anthropic"}
    path.write_text(
        f'[targets.a]\nkind = "{first}"\nurl = "{first_url}"\nmodel = "synthetic"\n'
        f'continuation = "{continuation[first]}"\n\n'
        f'[targets.b]\nkind = "{second}"\nurl = "{second_url}"\nmodel = "synthetic"\n'
        f'continuation = "{continuation[second]}"\n\n'
        '[models.chat]\ntargets = ["a", "b"]\n'
    )
    return str(path)


def _uninterrupted(up: Server) -> str:
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": MAX_TOKENS,
    }
    resp = httpx.post(up.v1 + "/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def _cut_later(proxy: CuttableProxy, seen: threading.Event) -> None:
    def run() -> None:
        seen.wait(30)
        proxy.cut()

    threading.Thread(target=run, daemon=True).start()


def test_anthropic_upstream_behind_an_openai_client(
    tmp_path: Path, ups: tuple[Server, Server]
) -> None:
    u1, u2 = ups
    expected = _uninterrupted(u2)
    with ExitStack() as stack:
        proxy = CuttableProxy(int(u1.url.rsplit(":", 1)[1]))
        stack.callback(proxy.close)
        routes = _gateway(tmp_path, "openai", proxy.url + "/v1", "anthropic", u2.v1)
        gw = stack.enter_context(run_server("--routes", routes))
        client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)
        seen, text, chunks, ids = threading.Event(), "", 0, set()
        finish = None
        _cut_later(proxy, seen)
        for chunk in client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        ):
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
                chunks += 1
                if chunks == CUT_AFTER:
                    seen.set()
        assert text == expected
        assert finish in ("stop", "length") and len(ids) == 1
        splices = [r for r in gw.log_records() if r["event"] == "route.splice"]
        assert [(s["from"], s["to"]) for s in splices] == [("a", "b")]
        # Usage over both legs equals an uninterrupted answer's.
        direct = httpx.post(
            u2.v1 + "/chat/completions",
            json={
                "model": "synthetic",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": MAX_TOKENS,
            },
        ).json()["usage"]
        assert usage.completion_tokens == direct["completion_tokens"]
        assert usage.prompt_tokens == direct["prompt_tokens"]


def test_openai_upstream_behind_an_anthropic_client(
    tmp_path: Path, ups: tuple[Server, Server]
) -> None:
    u1, u2 = ups
    expected = _uninterrupted(u2)
    with ExitStack() as stack:
        proxy = CuttableProxy(int(u1.url.rsplit(":", 1)[1]))
        stack.callback(proxy.close)
        routes = _gateway(tmp_path, "anthropic", proxy.url + "/v1", "openai", u2.v1)
        gw = stack.enter_context(run_server("--routes", routes))
        client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
        seen, deltas = threading.Event(), 0
        _cut_later(proxy, seen)
        with client.messages.stream(
            model="chat", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "hi"}]
        ) as s:
            kinds = []
            for event in s:
                kinds.append(event.type)
                if event.type == "content_block_delta":
                    deltas += 1
                    if deltas == CUT_AFTER:
                        seen.set()
            message = s.get_final_message()
        assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
        assert "".join(b.text for b in message.content if b.type == "text") == expected
        assert message.stop_reason in ("end_turn", "max_tokens")
        splices = [r for r in gw.log_records() if r["event"] == "route.splice"]
        assert [(s["from"], s["to"]) for s in splices] == [("a", "b")]
