"""The official openai SDK, unchanged, against a real server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from firsttoken.engines import synthetic_tokens
from tests.servers import Server

MESSAGES = [{"role": "user", "content": "Why does streaming matter?"}]
PROMPT = "user: Why does streaming matter?"


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def test_models_lists_synthetic(server: Server) -> None:
    assert [m.id for m in client(server).models.list()] == ["synthetic"]


def test_models_retrieve(server: Server) -> None:
    """The SDK's `models.retrieve`: the model served, or 404 `model_not_found` in the error
    shape (it answered the page's 404 before, issue 26); an id with a slash is one id."""
    model = client(server).models.retrieve("synthetic")
    assert (model.id, model.object, model.owned_by) == ("synthetic", "model", "firsttoken")
    for unknown in ("gpt-9", "org/model"):
        with pytest.raises(openai.NotFoundError) as info:
            client(server).models.retrieve(unknown)
        assert info.value.code == "model_not_found"
        assert "this server serves: synthetic" in info.value.message
    r = httpx.post(server.v1 + "/models/synthetic", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_stream_chat_token_exact_with_usage(server: Server) -> None:
    expected, finish = synthetic_tokens(PROMPT, 7, 40)
    stream = client(server).chat.completions.create(
        model="synthetic",
        messages=MESSAGES,
        stream=True,
        max_tokens=40,
        seed=7,
        stream_options={"include_usage": True},
    )
    contents, finishes, usage, roles = [], [], None, []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        assert chunk.model == "synthetic" and chunk.id.startswith("chatcmpl-") and chunk.created
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                contents.append(choice.delta.content)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert contents == expected  # one chunk per token, token-exact
    assert roles == ["assistant"]
    assert finishes == [finish] == ["length"]
    assert usage is not None and usage.completion_tokens == 40
    assert usage.total_tokens == usage.prompt_tokens + 40


def test_max_completion_tokens_and_natural_stop(server: Server) -> None:
    got = client(server).chat.completions.create(
        model="synthetic", messages=MESSAGES, stream=True, max_completion_tokens=5
    )
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "".join(
        synthetic_tokens(PROMPT, None, 5)[0]
    )
    full, finish = synthetic_tokens(PROMPT, 3, None)
    assert finish == "stop" and 250 <= len(full) <= 400  # "about 300 tokens"


def test_non_streaming_chat_has_usage(server: Server) -> None:
    expected, _ = synthetic_tokens(PROMPT, 1, 25)
    resp = client(server).chat.completions.create(
        model="synthetic", messages=MESSAGES, max_tokens=25, seed=1
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.content == "".join(expected)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 25


def test_legacy_completions_stream_and_whole(server: Server) -> None:
    expected, _ = synthetic_tokens("Once upon a time", 2, 12)
    c = client(server)
    parts = [
        ch.choices[0].text
        for ch in c.completions.create(
            model="synthetic", prompt="Once upon a time", stream=True, max_tokens=12, seed=2
        )
        if ch.choices and ch.choices[0].text
    ]
    assert parts == expected
    whole = c.completions.create(
        model="synthetic", prompt="Once upon a time", max_tokens=12, seed=2
    )
    assert whole.object == "text_completion" and whole.choices[0].text == "".join(expected)
    assert whole.usage is not None and whole.usage.completion_tokens == 12


def test_stop_sequence_cuts_the_answer(server: Server) -> None:
    full = "".join(synthetic_tokens(PROMPT, 4, 60)[0])
    stop = full[40:44]
    resp = client(server).chat.completions.create(
        model="synthetic", messages=MESSAGES, max_tokens=60, seed=4, stop=[stop]
    )
    assert resp.choices[0].message.content == full[: full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_async_sdk_streams(server: Server) -> None:
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        out = []
        stream = await c.chat.completions.create(
            model="synthetic", messages=MESSAGES, stream=True, max_tokens=20, seed=9
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(chunk.choices[0].delta.content)
        await c.close()
        return out

    assert asyncio.run(run()) == synthetic_tokens(PROMPT, 9, 20)[0]


def test_error_mid_stream_raises_api_error_and_keeps_text(server: Server) -> None:
    expected, _ = synthetic_tokens(PROMPT, 5, 50)
    received: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client(server).chat.completions.create(
            model="synthetic",
            messages=MESSAGES,
            stream=True,
            max_tokens=50,
            seed=5,
            extra_body={"synthetic": {"fail_after": 8, "error_code": "engine_overloaded"}},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
    assert info.value.code == "engine_overloaded"
    assert "after 8 tokens" in info.value.message
    assert received == expected[:8]


def test_unknown_model_is_404_with_openai_shape(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(server).chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert info.value.code == "model_not_found"


def test_bad_max_tokens_is_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model="synthetic", messages=MESSAGES, max_tokens=0)
    assert info.value.param == "max_tokens"


def test_non_streaming_engine_error_is_an_http_error(server: Server) -> None:
    r = httpx.post(
        server.v1 + "/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 5, "synthetic": {"fail_after": 2}},
        timeout=10,
    )
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error"


def test_non_streaming_answers_live_the_same_lifecycle(server: Server) -> None:
    # TTFT, outcome and tokens come from the one stream lifecycle, as for a streaming answer.
    before = server.metrics()
    r = httpx.post(
        server.v1 + "/chat/completions",
        json={"messages": [{"role": "user", "content": "whole"}], "max_tokens": 7},
        timeout=10,
    )
    after = server.metrics()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta["firsttoken_ttft_seconds_count"] == 1
    assert delta['firsttoken_streams_total{outcome="completed"}'] == 1
    assert delta["firsttoken_tokens_sent_total"] == 7
