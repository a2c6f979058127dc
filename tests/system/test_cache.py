"""Hot-prompt cache and canned answers, through a real server with --cache-ttl-s 5."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import Server, run_server

GENERATED = "firsttoken_tokens_generated_total"
TTL_S = 5.0


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    canned = Path(tmp_path_factory.mktemp("canned")) / "canned.toml"
    canned.write_text('[answers]\n"hi" = "Hello! How can I help you today?"\n')
    # TTFT 300 ms so a hit (no engine wait) is plainly faster than a miss.
    with run_server(
        "--cache-ttl-s", str(TTL_S), "--canned-answers", str(canned),
        "--synthetic-ttft-ms", "300", "--synthetic-itl-ms", "1",
        "--rate-limit-per-s", "0", "--ttft-slo-ms", "0",
    ) as s:  # fmt: skip
        yield s


def stream(server: Server, content: str, **params: object) -> tuple[float, str]:
    """(TTFT seconds, full text) of one streamed chat completion."""
    body = {"messages": [{"role": "user", "content": content}], "stream": True, **params}
    t0 = time.monotonic()
    first: float | None = None
    parts: list[str] = []
    done = False
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            done = done or line == "data: [DONE]"
            if line.startswith("data: {"):
                text = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if text:
                    first = first if first is not None else time.monotonic() - t0
                    parts.append(text)
    assert first is not None and done
    return first, "".join(parts)


def test_identical_deterministic_request_is_a_hit(cached: Server) -> None:
    miss_ttft, text = stream(cached, "cache me", max_tokens=40, temperature=0)
    generated = cached.metric(GENERATED)
    hit_ttft, again = stream(cached, "  cache me ", max_tokens=40, temperature=0)
    assert again == text  # identical text, from the cache (prompt normalised)
    assert cached.metric(GENERATED) == generated  # the engine produced nothing
    assert miss_ttft >= 0.25
    assert hit_ttft < miss_ttft / 2, (hit_ttft, miss_ttft)


def test_seed_is_part_of_the_key(cached: Server) -> None:
    stream(cached, "seeded", max_tokens=20, seed=1)
    generated = cached.metric(GENERATED)
    _, same = stream(cached, "seeded", max_tokens=20, seed=1)
    assert cached.metric(GENERATED) == generated  # hit
    _, other = stream(cached, "seeded", max_tokens=20, seed=2)
    assert cached.metric(GENERATED) == generated + 20  # different seed: a miss
    assert other != same


def test_sampling_without_seed_is_never_cached(cached: Server) -> None:
    for _ in range(2):
        generated = cached.metric(GENERATED)
        stream(cached, "random", max_tokens=10, temperature=0.7)
        assert cached.metric(GENERATED) == generated + 10


def test_errors_are_not_cached(cached: Server) -> None:
    params = {"max_tokens": 10, "temperature": 0, "synthetic": {"fail_after": 3}}
    for _ in range(2):
        generated = cached.metric(GENERATED)
        body = {"messages": [{"role": "user", "content": "fails"}], "stream": True, **params}
        with httpx.stream("POST", cached.v1 + "/chat/completions", json=body, timeout=30) as r:
            out = r.read()
        assert b"event: error" in out
        assert cached.metric(GENERATED) == generated + 3


def test_entries_expire_after_the_ttl(cached: Server) -> None:
    _, text = stream(cached, "expiring", max_tokens=10, temperature=0)
    generated = cached.metric(GENERATED)
    time.sleep(TTL_S + 0.3)
    miss_ttft, again = stream(cached, "expiring", max_tokens=10, temperature=0)
    assert again == text
    assert cached.metric(GENERATED) == generated + 10  # generated again
    assert miss_ttft >= 0.25


def test_canned_greeting(cached: Server) -> None:
    generated = cached.metric(GENERATED)
    ttft, text = stream(cached, "Hi!", temperature=1.0)
    assert text == "Hello! How can I help you today?"
    assert ttft < 0.25
    assert cached.metric(GENERATED) == generated
    # Word tokens, and max_tokens still applies.
    _, short = stream(cached, "hi", max_tokens=2)
    assert short == "Hello! How"


KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"

[[keys]]
name = "bob"
key = "sk-bob"
"""


@pytest.mark.parametrize("scope", ["key", "shared"])
def test_one_keys_entry_is_not_another_keys_hit(tmp_path: Path, scope: str) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    hits = "firsttoken_cache_hits_total"
    body = {"messages": [{"role": "user", "content": "alice's secret"}], "temperature": 0}
    with run_server(
        "--api-keys", str(keys), "--cache-ttl-s", "30", "--cache-scope", scope,
        "--synthetic-ttft-ms", "1", "--synthetic-itl-ms", "1",
    ) as srv:  # fmt: skip
        def ask(key: str) -> str:
            r = httpx.post(
                srv.v1 + "/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=10,
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        first = ask("sk-alice")
        assert srv.metric(hits) == 0
        assert ask("sk-bob") == first  # the same deterministic answer, either way
        # Per key (the default): bob's identical prompt went to the engine, and the public
        # counter did not move, so it tells bob nothing of what alice asked.
        assert srv.metric(hits) == (0 if scope == "key" else 1)
        assert ask("sk-alice") == first
        assert srv.metric(hits) == (1 if scope == "key" else 2)  # alice's own entry
