"""The anthropic target kind against a real Messages API upstream: a firsttoken server's own
`POST /v1/messages`, driven in-process through `AnthropicRelay.generate()`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import orjson
import pytest

from firsttoken.engines.anthropic_relay import AnthropicRelay
from firsttoken.generation import Delta, EngineError, GenerationRequest
from tests.servers import Server, run_server, wait_for
from tests.upstreams import free_port

MESSAGES = [{"role": "user", "content": "Why does streaming matter?"}]
ARGUMENTS = {"city": "Paris", "days": 3, "note": 'naïve "quoted" ☀️', "nested": {"a": [1, 2]}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
T = TypeVar("T")


def request(rid: str = "s1", **body: Any) -> GenerationRequest:
    chat = {"model": "synthetic", "messages": MESSAGES, **body}
    return GenerationRequest(request_id=rid, prompt="", model="synthetic", body=chat)


def with_relay(url: str, use: Callable[[AnthropicRelay], Awaitable[T]], **kwargs: Any) -> T:
    async def run() -> T:
        relay = AnthropicRelay(url, api_key="unused", **kwargs)
        await relay.start()
        try:
            return await use(relay)
        finally:
            await relay.close()

    return asyncio.run(run())


def collect(url: str, req: GenerationRequest, **kwargs: Any) -> list[Delta]:
    async def use(relay: AnthropicRelay) -> list[Delta]:
        return [d async for d in relay.generate(req)]

    return with_relay(url, use, **kwargs)


def failure(url: str, req: GenerationRequest, **kwargs: Any) -> EngineError:
    with pytest.raises(EngineError) as caught:
        collect(url, req, **kwargs)
    return caught.value


def test_text_is_the_servers_own_answer_and_usage_maps(server: Server) -> None:
    chat = httpx.post(
        server.v1 + "/chat/completions",
        json={"model": "synthetic", "messages": MESSAGES, "max_tokens": 12},
        timeout=10,
    ).json()

    async def use(relay: AnthropicRelay) -> tuple[tuple[str, ...], list[Delta], int]:
        deltas = [d async for d in relay.generate(request(max_tokens=12))]
        return relay.models, deltas, relay.tokens_generated

    models, deltas, generated = with_relay(server.url, use)  # a bare URL gets /v1
    assert models == ("synthetic",)  # from GET /v1/models
    assert "".join(d.text for d in deltas) == chat["choices"][0]["message"]["content"]
    assert generated == len(deltas) - 1 == 12
    last = deltas[-1]
    assert last.finish_reason == chat["choices"][0]["finish_reason"] == "length"
    assert last.usage is not None
    assert last.usage["prompt_tokens"] == chat["usage"]["prompt_tokens"] > 0
    assert last.usage["completion_tokens"] == 12
    assert last.usage["total_tokens"] == chat["usage"]["prompt_tokens"] + 12


def test_reasoning_comes_as_reasoning_deltas(server: Server) -> None:
    deltas = collect(server.v1, request(max_tokens=20, synthetic={"reasoning_tokens": 6}))
    kinds = ["r" if d.reasoning else "t" for d in deltas[:-1]]
    assert kinds == ["r"] * 6 + ["t"] * 14  # thinking first, then the text
    assert not any(d.text for d in deltas[:6])
    assert deltas[-1].finish_reason == "length"


def test_a_tool_call_comes_as_tool_call_deltas(server: Server) -> None:
    knobs = {"tool_call": {"name": "get_weather", "arguments": ARGUMENTS}}
    deltas = collect(server.v1, request(max_tokens=200, tools=TOOLS, synthetic=knobs))
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0].index == 0 and calls[0].name == "get_weather" and calls[0].id
    assert {c.index for c in calls} == {0}
    assert orjson.loads("".join(c.arguments for c in calls)) == ARGUMENTS
    assert deltas[-1].finish_reason == "tool_calls"


def test_a_bad_field_is_rejected_with_the_upstreams_400(server: Server) -> None:
    error = failure(server.v1, request(max_tokens=5, top_k=-1))
    assert error.code == "upstream_rejected" and error.status == 400
    assert "top_k" in error.message
    assert error.client_fault and not error.retryable and error.type == "invalid_request_error"


def test_a_model_the_target_lacks_is_the_targets_fault(server: Server) -> None:
    error = failure(server.v1, request(max_tokens=5), model="no-such-model")
    assert error.code == "upstream_rejected" and error.status == 404
    assert "no-such-model" in error.message
    assert error.retryable and not error.client_fault


def test_nothing_listening_is_unavailable_and_start_survives_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def use(relay: AnthropicRelay) -> tuple[tuple[str, ...], EngineError]:
        with pytest.raises(EngineError) as caught:
            async for _ in relay.generate(request(max_tokens=5)):
                pass
        return relay.models, caught.value

    models, error = with_relay(url, use)
    assert models == () and error.code == "upstream_unavailable" and error.retryable


@pytest.fixture
def slow() -> Iterator[Server]:
    """An upstream of its own, slow enough to act on mid-answer."""
    with run_server(
        "--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "50", "--rate-limit-per-s", "0"
    ) as s:
        yield s


def test_an_upstream_killed_mid_stream_is_truncated(slow: Server) -> None:
    async def use(relay: AnthropicRelay) -> tuple[str, EngineError]:
        got = ""
        deltas: AsyncIterator[Delta] = relay.generate(request(max_tokens=200))
        with pytest.raises(EngineError) as caught:
            async for d in deltas:
                got += d.text
                if got.count(" ") >= 3 and slow.proc.poll() is None:
                    slow.kill()
        return got, caught.value

    got, error = with_relay(slow.v1, use)
    assert got  # text arrived before the cut, and no finish after it
    assert error.code == "upstream_truncated" and error.retryable


def test_abort_ends_quietly_and_the_upstream_sees_us_leave(slow: Server) -> None:
    async def use(relay: AnthropicRelay) -> list[Delta]:
        deltas = []
        async for d in relay.generate(request("abort-me", max_tokens=200)):
            deltas.append(d)
            if len(deltas) == 1:
                await asyncio.sleep(0.3)  # the next read holds several events
            elif len(deltas) == 2:
                await relay.abort("abort-me")  # none of the rest may come out
        return deltas

    deltas = with_relay(slow.v1, use)
    assert len(deltas) == 2 and deltas[-1].finish_reason is None
    wait_for(lambda: slow.metric('firsttoken_streams_total{outcome="disconnected"}') == 1)
