"""A splice over real processes: a gateway with routes over two `firsttoken serve` upstreams
(`kind = "openai"`, `continuation = "vllm"`), the one answering SIGKILLed mid-answer, or the
gateway owning the stream SIGKILLed and another taking it over (`--redis --durable`). The
text read across the seam is the undisturbed answer's, byte for byte, in the formats a relay
sends as `/v1/completions` (native streams, Completions), or the stream ends in an error
event: never a different text."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from firsttoken.engines.synthetic import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.rawhttp import RawStream
from tests.redis_server import run_redis
from tests.servers import Server, run_server, wait_for

OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0")
UPSTREAM = ("--synthetic-ttft-ms", "100", "--synthetic-itl-ms", "20", *OPEN)
MAX_TOKENS = 60
CUT_AT = 10  # tokens read before the kill
STREAMS = 6  # at once through one kill


def routes_file(tmp: Path, upstreams: list[Server], *kinds: str) -> str:
    """A route `chat` over the upstreams in order, as targets `u1`, `u2`... of `kinds` (one
    for all, or one each; default openai)."""
    lines: list[str] = []
    for i, upstream in enumerate(upstreams, 1):
        kind = kinds[min(i, len(kinds)) - 1] if kinds else "openai"
        continues = "vllm" if kind == "openai" else "anthropic"
        lines += [
            f"[targets.u{i}]",
            f'kind = "{kind}"',
            f'url = "{upstream.v1}"',
            'model = "synthetic"',
            f'continuation = "{continues}"',
            "idle_timeout_s = 2",
            "",
        ]
    names = ", ".join(f'"u{i}"' for i in range(1, len(upstreams) + 1))
    lines += ["[models.chat]", f"targets = [{names}]", ""]
    path = tmp / "routes.toml"
    path.write_text("\n".join(lines))
    return str(path)


@pytest.fixture
def upstreams() -> Iterator[list[Server]]:
    with ExitStack() as stack:
        yield [stack.enter_context(run_server(*UPSTREAM)) for _ in range(2)]


def whole(prompt: str) -> str:
    """The undisturbed answer."""
    return "".join(synthetic_tokens(prompt, None, MAX_TOKENS)[0])  # type: ignore[arg-type]


def read_until(stream: RawStream, marker: bytes, count: int) -> None:
    while stream.body.count(marker) < count:
        if not stream.read_chunk():
            raise AssertionError(f"ended early: {stream.body[-300:]!r}")


def read_to_end(stream: RawStream) -> None:
    try:
        while stream.read_chunk():
            pass
    except (ConnectionError, OSError):
        pass  # cut with its instance


def native(body: bytes) -> dict:
    """What a native stream's events say: its text, meta events, [DONE], error, last id."""
    decoder = EventDecoder()
    out: dict = {"text": "", "meta": [], "done": 0, "error": None}
    for event in decoder.feed(body):
        if event.data == "[DONE]":
            out["done"] += 1
        elif event.event == "error":
            out["error"] = json.loads(event.data or "")["error"]
        elif event.event == "meta":
            out["meta"].append(json.loads(event.data or ""))
        elif event.event is None and event.data:
            out["text"] += json.loads(event.data)["token"]
    out["last_id"] = decoder.last_event_id
    return out


def completions(body: bytes) -> dict:
    """What a Completions stream's events say: its text, [DONE], error, finish."""
    out: dict = {"text": "", "done": 0, "error": None, "finish": None}
    for event in EventDecoder().feed(body):
        if event.data == "[DONE]":
            out["done"] += 1
        elif event.event == "error":
            out["error"] = json.loads(event.data or "")["error"]
        elif event.data:
            for choice in json.loads(event.data)["choices"]:
                out["text"] += choice["text"]
                out["finish"] = choice["finish_reason"] or out["finish"]
    return out


def create(server: Server, prompt: str) -> dict:
    body = {"prompt": prompt, "model": "chat", "max_tokens": MAX_TOKENS}
    created = httpx.post(server.v1 + "/streams", json=body, timeout=10)
    assert created.status_code == 201, created.text
    return created.json()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_native_streams_spliced_after_an_upstream_sigkill_are_the_undisturbed_answers(
    tmp_path: Path, upstreams: list[Server], kind: str
) -> None:
    prompts = [f"a native stream spliced after a kill, {i}" for i in range(STREAMS)]
    with run_server("--routes", routes_file(tmp_path, upstreams, kind), *OPEN) as gateway:
        # The undisturbed answers, through the same route (the first target answers all).
        made = [create(gateway, p) for p in prompts]
        undisturbed = [
            native(httpx.get(gateway.url + c["events_url"], timeout=30).content) for c in made
        ]
        assert all(u["done"] == 1 and u["error"] is None for u in undisturbed)
        if kind == "openai":
            assert undisturbed[0]["text"] == whole(prompts[0])
        made = [create(gateway, p) for p in prompts]
        streams = [RawStream(gateway.port, "GET", c["events_url"]) for c in made]
        read_until(streams[-1], b'{"token":', CUT_AT)
        upstreams[0].kill()  # the first target answers (balance `order`)
        for stream, expected in zip(streams, undisturbed, strict=True):
            read_to_end(stream)
            seen = native(stream.body)
            assert seen["error"] is None, seen["error"]
            assert seen["text"] == expected["text"]
            assert seen["done"] == 1
            (failover,) = [m["failover"] for m in seen["meta"] if "failover" in m]
            assert (failover["from"], failover["to"]) == ("u1", "u2")


def test_a_target_that_cannot_continue_the_text_refuses_it_and_the_stream_ends_in_an_error(
    tmp_path: Path, upstreams: list[Server]
) -> None:
    # The Messages API renders the prompt as a user turn: its synthetic answer is another
    # one, so the prefill of the first leg's text is refused (400 invalid_continuation). The
    # reader keeps the text sent and is told; it never reads a different text as the rest.
    prompt = "a native stream no target can continue"
    routes = routes_file(tmp_path, upstreams, "openai", "anthropic")
    with run_server("--routes", routes, *OPEN) as gateway:
        stream = RawStream(gateway.port, "GET", create(gateway, prompt)["events_url"])
        read_until(stream, b'{"token":', CUT_AT)
        upstreams[0].kill()
        read_to_end(stream)
        seen = native(stream.body)
        assert seen["error"] is not None and seen["error"]["code"] == "upstream_truncated"
        assert seen["done"] == 0
        assert len(seen["text"]) >= CUT_AT and whole(prompt).startswith(seen["text"])

        def refused() -> list[dict]:
            return [
                r
                for r in gateway.log_records()
                if r["event"] == "route.target_failed" and r["target"] == "u2"
            ]

        assert "cannot continue" in wait_for(refused)[0]["error"]  # the log comes a bit later


def test_a_completions_stream_spliced_after_an_upstream_sigkill_is_the_undisturbed_answer(
    tmp_path: Path, upstreams: list[Server]
) -> None:
    prompt = "a completion spliced after a kill"
    with run_server("--routes", routes_file(tmp_path, upstreams), *OPEN) as gateway:
        body = {"prompt": prompt, "model": "chat", "max_tokens": MAX_TOKENS, "stream": True}
        stream = RawStream(gateway.port, "POST", "/v1/completions", body)
        assert stream.status == 200
        read_until(stream, b'"text":', CUT_AT)
        upstreams[0].kill()
        read_to_end(stream)
        seen = completions(stream.body)
        assert seen["error"] is None, seen["error"]
        assert seen["text"] == whole(prompt)
        assert (seen["done"], seen["finish"]) == (1, "length")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_native_stream_taken_over_by_another_gateway_is_the_undisturbed_answer(
    tmp_path: Path, upstreams: list[Server], sig: signal.Signals
) -> None:
    prompt = "a native stream taken over on routes"
    routes = routes_file(tmp_path, upstreams)
    with run_redis() as url, ExitStack() as stack:
        a, b = (
            stack.enter_context(run_server("--routes", routes, "--redis", url, "--durable", *OPEN))
            for _ in range(2)
        )
        body = {"prompt": prompt, "model": "chat", "max_tokens": MAX_TOKENS}
        created = httpx.post(a.v1 + "/streams", json=body, timeout=10).json()
        stream = RawStream(a.port, "GET", created["events_url"])
        read_until(stream, b'{"token":', CUT_AT)
        a.kill(sig)  # SIGTERM: a deploy, which hands its streams over
        read_to_end(stream)
        before = native(stream.body)
        resumed = httpx.get(
            b.url + created["events_url"],
            headers={"Last-Event-ID": before["last_id"]},
            timeout=30,
        )
        assert resumed.status_code == 200, resumed.text
        after = native(resumed.content)
        assert after["error"] is None, after["error"]
        assert before["text"] + after["text"] == whole(prompt)
        assert after["done"] == 1
        assert [m for m in after["meta"] if "takeover" in m]
