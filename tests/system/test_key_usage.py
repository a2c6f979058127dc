"""Usage per key (issue 29.3): `firsttoken_key_tokens_total{key, kind}` counts what each key
was billed, by the key's name from the keys file (`open` without one), and every `stream.*`
log line names the key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.servers import Server, run_server, wait_for
from tests.upstreams import VLLM_CACHED_USAGE, scripted_upstream

KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"

[[keys]]
name = "bob"
key = "sk-bob"
priority = 1
weight = 2

[[keys]]
name = "carol"
key = "sk-carol"
"""
KINDS = ("prompt", "completion", "reasoning", "cached")
MSG = [{"role": "user", "content": "usage per key"}]


def tokens(server: Server, key: str) -> dict[str, float]:
    metrics = server.metrics()
    return {
        kind: metrics[f'firsttoken_key_tokens_total{{key="{key}",kind="{kind}"}}'] for kind in KINDS
    }


def counted(server: Server, key: str, expected: dict[str, float]) -> None:
    """The key's counters reach `expected` (a stream's ticket is released just after its
    answer's last byte), and say exactly that."""
    wait_for(lambda: tokens(server, key) == expected, timeout=5)
    assert tokens(server, key) == expected


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path: Path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    args = ("--api-keys", str(path), "--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "2")
    with run_server(*args) as server:
        yield server


def test_two_keys_are_counted_apart_by_name(keyed: Server) -> None:
    assert tokens(keyed, "carol") == dict.fromkeys(KINDS, 0.0)  # every key's series, at 0
    alice = client(keyed, "sk-alice").chat.completions.create(
        model="synthetic",
        messages=MSG,
        max_tokens=12,  # type: ignore[arg-type]
    )
    stream = client(keyed, "sk-bob").chat.completions.create(
        model="synthetic",
        messages=MSG,  # type: ignore[arg-type]
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"synthetic": {"reasoning_tokens": 3}},
    )
    bob = [c.usage for c in stream if c.usage is not None][-1]
    assert alice.usage is not None
    counted(
        keyed,
        "alice",
        {
            "prompt": alice.usage.prompt_tokens,
            "completion": alice.usage.completion_tokens,
            "reasoning": 0,
            "cached": 0,
        },
    )
    assert alice.usage.completion_tokens == 12
    reasoning = bob.completion_tokens_details.reasoning_tokens  # type: ignore[union-attr]
    assert reasoning == 3
    counted(
        keyed,
        "bob",
        {
            "prompt": bob.prompt_tokens,
            "completion": bob.completion_tokens,
            "reasoning": reasoning,
            "cached": 0,
        },
    )
    assert tokens(keyed, "carol") == dict.fromkeys(KINDS, 0.0)
    # Only names from the keys file: no series for anyone else.
    names = {
        k.split('key="')[1].split('"')[0]
        for k in keyed.metrics()
        if k.startswith("firsttoken_key_tokens_total{")
    }
    assert names == {"alice", "bob", "carol"}


def test_every_stream_log_line_names_its_key(keyed: Server) -> None:
    r = httpx.post(
        keyed.v1 + "/completions",
        headers={"Authorization": "Bearer sk-carol"},
        json={"prompt": "log", "max_tokens": 3},
        timeout=10,
    )
    stream_id = r.headers["x-stream-id"]

    def lines() -> list[dict]:
        return [rec for rec in keyed.log_records() if rec.get("stream") == stream_id]

    wait_for(lambda: any(rec["event"] == "stream.finished" for rec in lines()))
    events = {rec["event"] for rec in lines()}
    assert "stream.finished" in events
    stream_lines = [rec for rec in lines() if rec["event"].startswith("stream.")]
    assert {rec.get("key") for rec in stream_lines} == {"carol"}


def test_an_open_server_counts_key_open_and_upstream_cached_tokens() -> None:
    # A relay over a vLLM-shaped upstream that reports its prefix cache's part of the prompt.
    with (
        scripted_upstream() as up,
        run_server("--engine", "openai", "--upstream", up.url) as relay,
    ):
        before = tokens(relay, "open")
        assert before == dict.fromkeys(KINDS, 0.0)
        stream = client(relay, "none").chat.completions.create(
            model="vllm-cached",
            messages=MSG,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [c.usage for c in stream if c.usage is not None][-1]
        assert usage.prompt_tokens_details.cached_tokens == 24  # type: ignore[union-attr]
        counted(
            relay,
            "open",
            {
                "prompt": VLLM_CACHED_USAGE["prompt_tokens"],
                "completion": VLLM_CACHED_USAGE["completion_tokens"],
                "reasoning": 1,
                "cached": 24,
            },
        )
        finished = [r for r in relay.log_records() if r.get("event") == "stream.finished"]
        assert finished and finished[-1]["key"] == "open"


def test_a_client_that_leaves_before_the_first_token_pays_its_prompt(tmp_path: Path) -> None:
    """Cut during the prefill (300 ms to the first token, cut at 100 ms): the engine read the
    prompt, so the key is billed it and its tokens_per_minute counts it."""
    import time

    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS + '\n[[keys]]\nname = "dave"\nkey = "sk-dave"\ntokens_per_minute = 1000\n')
    args = ("--api-keys", str(keys), "--synthetic-ttft-ms", "300", "--synthetic-itl-ms", "2")
    words = [{"role": "user", "content": "a long prompt " * 90}]
    with run_server(*args) as server:
        probe = client(server, "sk-carol").chat.completions.create(
            model="synthetic", messages=words, max_tokens=1
        )
        assert probe.usage is not None
        prompt = probe.usage.prompt_tokens
        assert 250 < prompt < 333, prompt  # three fit in the minute, a fourth does not
        if time.time() % 60 > 45:  # all in one clock minute
            time.sleep(61 - time.time() % 60)
        body = {"model": "synthetic", "messages": words, "stream": True}
        for _ in range(3):
            with httpx.stream(
                "POST",
                server.v1 + "/chat/completions",
                json=body,
                headers={"authorization": "Bearer sk-dave"},
                timeout=10,
            ) as cut:
                assert cut.status_code == 200
                time.sleep(0.1)  # and gone, before the first token
        counted(
            server, "dave", {"prompt": 3 * prompt, "completion": 0, "reasoning": 0, "cached": 0}
        )
        again = httpx.post(
            server.v1 + "/chat/completions",
            json=body,
            headers={"authorization": "Bearer sk-dave"},
            timeout=10,
        )
        assert again.status_code == 429 and again.json()["error"]["code"] == "token_budget_exceeded"
