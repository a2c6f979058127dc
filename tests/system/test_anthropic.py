"""The official anthropic SDK, unchanged, against a real server's /v1/messages."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from firsttoken.engines import GenerationRequest, synthetic_tokens
from firsttoken.engines.synthetic import SyntheticOptions, answer_parts
from firsttoken.formats.sse import EventDecoder
from tests.rawhttp import RawStream
from tests.servers import Server, run_server

MESSAGES: list[Any] = [{"role": "user", "content": "Why does streaming matter?"}]
PROMPT = "user: Why does streaming matter?"  # how the server renders MESSAGES as text
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
}
ARGUMENTS = {"city": "Paris", "days": 3, "note": 'naïve "quoted" ☀️', "nested": {"a": [1, 2]}}


def client(server: Server, **kwargs: Any) -> anthropic.Anthropic:
    kwargs.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=server.url, max_retries=0, **kwargs)


def expected_parts(prompt: str, max_tokens: int, **knobs: Any) -> tuple[str, str]:
    """The synthetic engine's (thinking, text) for this request."""
    request = GenerationRequest(
        request_id="x", prompt=prompt, model="synthetic", max_tokens=max_tokens
    )
    parts, _ = answer_parts(request, SyntheticOptions.from_mapping(knobs))
    thinking = "".join(p.reasoning for p in parts if not isinstance(p, str))
    return thinking, "".join(p for p in parts if isinstance(p, str))


def test_stream_text_stream_token_exact(server: Server) -> None:
    expected, finish = synthetic_tokens(PROMPT, None, 40)
    with client(server).messages.stream(
        model="synthetic", max_tokens=40, messages=MESSAGES
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert texts == expected and finish == "length"  # one text_delta per token
    assert final.id.startswith("msg_") and final.model == "synthetic" and final.role == "assistant"
    assert [b.type for b in final.content] == ["text"]
    assert final.content[0].text == "".join(expected)  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 40 and final.usage.input_tokens > 0


def test_create_stream_event_sequence(server: Server) -> None:
    events = list(
        client(server).messages.create(
            model="synthetic", max_tokens=12, messages=MESSAGES, stream=True
        )
    )
    types = [e.type for e in events]
    assert types == (
        ["message_start", "content_block_start"]
        + ["content_block_delta"] * 12
        + ["content_block_stop", "message_delta", "message_stop"]
    )
    start = events[0].message  # type: ignore[union-attr]
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens > 0
    assert events[1].content_block.type == "text"  # type: ignore[union-attr]
    assert {e.index for e in events[1:15]} == {0}  # type: ignore[union-attr]
    assert events[-2].delta.stop_reason == "max_tokens"  # type: ignore[union-attr]
    assert events[-2].usage.output_tokens == 12  # type: ignore[union-attr]


def test_raw_wire_has_ping_no_done_and_stream_headers(server: Server) -> None:
    body = {"model": "synthetic", "max_tokens": 3, "messages": MESSAGES, "stream": True}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    r = httpx.post(server.v1 + "/messages", json=body, headers=headers, timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-stream-id"] and r.headers["x-resume-token"]
    events = EventDecoder().feed(r.content)
    names = [e.event for e in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-1] == "message_stop" and "[DONE]" not in r.text
    for event in events:  # every event's name is its data's type
        assert json.loads(event.data)["type"] == event.event


def test_non_streaming_text(server: Server) -> None:
    expected, _ = synthetic_tokens(PROMPT, None, 25)
    message = client(server).messages.create(model="synthetic", max_tokens=25, messages=MESSAGES)
    assert message.type == "message" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "".join(expected)  # type: ignore[union-attr]
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 25 and message.usage.input_tokens > 0
    natural = client(server).messages.create(
        model="synthetic",
        max_tokens=1000,
        messages=MESSAGES,
        extra_body={"synthetic": {"answer_tokens": 6}},
    )
    assert natural.stop_reason == "end_turn"


def test_a_document_block_is_taken_not_refused_as_a_string(server: Server) -> None:
    """The synthetic engine reads the text beside it (a document is not text it reads)."""
    pdf = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}
    content: list[Any] = [
        {"type": "document", "source": pdf, "title": "report", "citations": {"enabled": True}},
        {"type": "text", "text": "Sum it up."},
    ]
    message = client(server).messages.create(
        model="synthetic", max_tokens=5, messages=[{"role": "user", "content": content}]
    )
    assert message.stop_reason == "max_tokens" and message.content[0].type == "text"


def test_count_tokens_is_the_input_a_message_would_use(server: Server) -> None:
    """The SDK's `messages.count_tokens` (it got a 404, issue 26): `input_tokens` is what the
    same request's answer reports, system prompt and tools' conversation included."""
    sdk = client(server)
    conversation: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": "Let me look that up for you."},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow, in Paris?"}]},
    ]
    for kwargs in (
        {"messages": MESSAGES},
        {"messages": conversation, "system": "Be brief, and answer in French."},
    ):
        counted = sdk.messages.count_tokens(model="synthetic", **kwargs)
        answered = sdk.messages.create(model="synthetic", max_tokens=3, **kwargs)
        assert counted.input_tokens == answered.usage.input_tokens > 0
    longer = sdk.messages.count_tokens(model="synthetic", messages=conversation)
    assert (
        longer.input_tokens
        > sdk.messages.count_tokens(model="synthetic", messages=MESSAGES).input_tokens
    )
    with pytest.raises(anthropic.NotFoundError) as info:
        sdk.messages.count_tokens(model="claude-9", messages=MESSAGES)
    assert info.value.body["type"] == "error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        sdk.messages.count_tokens(model="synthetic", messages=[])


def test_count_tokens_needs_a_key_like_messages(keyed: Server) -> None:
    counted = client(keyed, api_key="sk-alice").messages.count_tokens(
        model="synthetic", messages=MESSAGES
    )
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError):
        client(keyed, api_key="sk-nobody").messages.count_tokens(
            model="synthetic", messages=MESSAGES
        )


def test_system_prompt_is_part_of_the_prompt(server: Server) -> None:
    expected, _ = synthetic_tokens("system: Be brief.\n" + PROMPT, None, 10)
    message = client(server).messages.create(
        model="synthetic", max_tokens=10, system="Be brief.", messages=MESSAGES
    )
    assert message.content[0].text == "".join(expected)  # type: ignore[union-attr]


def test_stop_sequences_cut_the_answer(server: Server) -> None:
    full = "".join(synthetic_tokens(PROMPT, None, 60)[0])
    stop = full[40:44]
    message = client(server).messages.create(
        model="synthetic", max_tokens=60, messages=MESSAGES, stop_sequences=[stop]
    )
    assert message.content[0].text == full[: full.index(stop)]  # type: ignore[union-attr]
    # The engine's finish does not say which stop it was: end_turn, not stop_sequence.
    assert message.stop_reason == "end_turn"


def test_async_sdk_streams(server: Server) -> None:
    async def run() -> list[str]:
        c = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)
        async with c.messages.stream(model="synthetic", max_tokens=15, messages=MESSAGES) as stream:
            texts = [text async for text in stream.text_stream]
        await c.close()
        return texts

    assert asyncio.run(run()) == synthetic_tokens(PROMPT, None, 15)[0]


def test_thinking_blocks_streaming_and_not(server: Server) -> None:
    thinking, text = expected_parts(PROMPT, 30, reasoning_tokens=6)
    knobs = {"synthetic": {"reasoning_tokens": 6}}
    with client(server).messages.stream(
        model="synthetic",
        max_tokens=30,
        messages=MESSAGES,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body=knobs,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds and "signature" in kinds and "text" in kinds
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == thinking  # type: ignore[union-attr]
    assert final.content[0].signature  # type: ignore[union-attr]
    assert final.content[1].text == text  # type: ignore[union-attr]
    whole = client(server).messages.create(
        model="synthetic", max_tokens=30, messages=MESSAGES, extra_body=knobs
    )
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == thinking  # type: ignore[union-attr]
    assert whole.content[1].text == text  # type: ignore[union-attr]


def test_tool_use_input_reassembled_exactly(server: Server) -> None:
    knobs = {"synthetic": {"tool_call": {"name": "get_weather", "arguments": ARGUMENTS}}}
    with client(server).messages.stream(
        model="synthetic",
        max_tokens=500,
        messages=MESSAGES,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        extra_body=knobs,
    ) as stream:
        partials = [e for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    assert len(partials) > 3  # the arguments came in pieces
    assert final.stop_reason == "tool_use"
    [block] = final.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    assert block.input == ARGUMENTS
    whole = client(server).messages.create(
        model="synthetic", max_tokens=500, messages=MESSAGES, tools=[WEATHER], extra_body=knobs
    )  # type: ignore[list-item]
    assert whole.stop_reason == "tool_use"
    assert whole.content[0].type == "tool_use" and whole.content[0].input == ARGUMENTS


def test_agent_loop_tool_result_then_final_text(server: Server) -> None:
    c = client(server)
    first = c.messages.create(
        model="synthetic",
        max_tokens=500,
        messages=MESSAGES,
        tools=[WEATHER],  # type: ignore[list-item]
        extra_body={"synthetic": {"tool_call": {"name": "get_weather", "arguments": ARGUMENTS}}},
    )
    [call] = first.content
    assert call.type == "tool_use"
    history: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}],
        },
    ]
    expected, _ = synthetic_tokens(PROMPT + "\nassistant: \ntool: 18 C, sunny", None, 20)
    with c.messages.stream(
        model="synthetic",
        max_tokens=20,
        messages=history,
        tools=[WEATHER],  # type: ignore[list-item]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(expected)
    assert final.stop_reason == "max_tokens" and [b.type for b in final.content] == ["text"]


def test_error_mid_stream_raises_and_keeps_the_text(server: Server) -> None:
    expected, _ = synthetic_tokens(PROMPT, None, 50)
    received: list[str] = []
    with client(server).messages.stream(
        model="synthetic",
        max_tokens=50,
        messages=MESSAGES,
        extra_body={"synthetic": {"fail_after": 8, "error_code": "engine_overloaded"}},
    ) as stream:
        with pytest.raises(anthropic.APIStatusError) as info:
            for text in stream.text_stream:
                received.append(text)
        snapshot = stream.current_message_snapshot
    assert received == expected[:8]
    assert snapshot.content[0].text == "".join(expected[:8])  # type: ignore[union-attr]
    assert info.value.type == "overloaded_error"
    assert info.value.api_message is not None and "after 8 tokens" in info.value.api_message
    # Not streaming: the same failure is a 500 in the same shape.
    with pytest.raises(anthropic.InternalServerError) as whole:
        client(server).messages.create(
            model="synthetic",
            max_tokens=50,
            messages=MESSAGES,
            extra_body={"synthetic": {"fail_after": 8, "error_code": "engine_overloaded"}},
        )
    assert whole.value.type == "overloaded_error"


def test_invalid_requests_are_4xx_in_anthropic_shape(server: Server) -> None:
    url = server.v1 + "/messages"
    r = httpx.post(url, json={"model": "synthetic", "messages": MESSAGES}, timeout=10)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    bad_block = {"role": "user", "content": [{"type": "video", "url": "x"}]}
    r = httpx.post(
        url, json={"model": "synthetic", "max_tokens": 5, "messages": [bad_block]}, timeout=10
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client(server).messages.create(
            model="synthetic", max_tokens=5, messages=MESSAGES, extra_body={"temperature": 1.5}
        )  # this SDK no longer has `temperature`; older ones send it
    assert info.value.type == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client(server).messages.create(model="claude-nope", max_tokens=5, messages=MESSAGES)
    assert missing.value.type == "not_found_error"


def test_a_thread_is_refused_with_the_code_the_sdk_falls_back_on(server: Server) -> None:
    # What the SDK's tool runner sends on its second turn: only the new message.
    body = {
        "model": "synthetic",
        "max_tokens": 20,
        "messages": MESSAGES,
        "thread": {"type": "continue", "previous_message_id": "msg_x"},
    }
    headers = {"anthropic-beta": "message-threads-2026-08-12"}
    r = httpx.post(server.v1 + "/messages", json=body, headers=headers, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "`thread`" in error["message"]
    assert error["details"] == {"error_code": "thread_unsupported_request"}
    # The SDK types it as its own error class: the one its threads read.
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(server).messages.create(
            model="synthetic", max_tokens=5, messages=MESSAGES, extra_body={"thread": {}}
        )
    assert type(refused.value).__name__ == "ThreadUnsupportedRequestError"


@pytest.mark.parametrize("stream", [False, True])
def test_the_sdks_tool_runner_ends_in_two_turns(server: Server, stream: bool) -> None:
    calls: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "18 C, sunny"

    def posts() -> float:
        return server.metric('firsttoken_streams_total{outcome="completed"}')

    before = posts()
    knobs = {"synthetic": {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}}
    runner = client(server).beta.messages.tool_runner(
        model="synthetic",
        max_tokens=1000,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[get_weather],
        max_iterations=5,
        stream=stream,
        extra_body=knobs,  # the engine calls the tool on every turn that has no tool result
    )
    if stream:
        replies = [turn.get_final_message() for turn in runner]  # type: ignore[union-attr]
    else:
        replies = list(runner)
    assert calls == ["Paris"]
    assert [r.stop_reason for r in replies] == ["tool_use", "end_turn"]
    assert replies[-1].content[0].type == "text"
    # Each turn was answered once: the refused threaded tries were never streams.
    assert posts() - before == 2


def test_streams_total_counts_messages(server: Server) -> None:
    key = 'firsttoken_streams_total{outcome="completed"}'
    before = server.metric(key)
    client(server).messages.create(model="synthetic", max_tokens=3, messages=MESSAGES)
    list(
        client(server).messages.create(
            model="synthetic", max_tokens=3, messages=MESSAGES, stream=True
        )
    )
    assert server.metric(key) >= before + 2


KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    with run_server(
        "--api-keys", str(path), "--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1"
    ) as s:
        yield s


def test_x_api_key_and_bearer_auth(keyed: Server) -> None:
    expected, _ = synthetic_tokens(PROMPT, None, 5)
    message = client(keyed, api_key="sk-alice").messages.create(
        model="synthetic", max_tokens=5, messages=MESSAGES
    )
    assert message.content[0].text == "".join(expected)  # type: ignore[union-attr]
    bearer = anthropic.Anthropic(
        base_url=keyed.url, auth_token="sk-alice", api_key=None, max_retries=0
    )
    assert bearer.messages.create(model="synthetic", max_tokens=5, messages=MESSAGES).content
    with pytest.raises(anthropic.AuthenticationError) as info:
        client(keyed, api_key="sk-nobody").messages.create(
            model="synthetic", max_tokens=5, messages=MESSAGES
        )
    assert info.value.type == "authentication_error"
    assert info.value.body["type"] == "error"  # type: ignore[index]
    # The refusal names the header Anthropic's clients send, not only Bearer.
    assert "x-api-key" in info.value.body["error"]["message"]  # type: ignore[index]


def test_resume_continues_exactly() -> None:
    with run_server(
        "--openai-grace-s", "5", "--synthetic-itl-ms", "5", "--synthetic-ttft-ms", "10"
    ) as srv:
        s = RawStream(
            srv.port,
            "POST",
            "/v1/messages",
            {"model": "synthetic", "max_tokens": 40, "messages": MESSAGES, "stream": True},
            {"x-api-key": "unused", "anthropic-version": "2023-06-01"},
        )
        while s.body.count(b'"text_delta"') < 5:
            s.read_chunk()
        s.close()
        decoder = EventDecoder()
        seen = decoder.feed(s.body)
        stream_id, token = s.headers["x-stream-id"], s.headers["x-resume-token"]
        r = httpx.get(
            f"{srv.v1}/streams/{stream_id}/events",
            headers={"Authorization": f"Bearer {token}", "Last-Event-ID": decoder.last_event_id},
            timeout=10,
        )
        rest = EventDecoder().feed(r.content)
        assert int(rest[0].id) == int(decoder.last_event_id) + 1  # exactly the events after
        text = ""
        for event in seen + rest:
            data = json.loads(event.data)
            if event.event == "content_block_delta":
                text += data["delta"]["text"]
        assert rest[-1].event == "message_stop"
        assert [e.event for e in seen + rest].count("message_start") == 1
        assert text == "".join(synthetic_tokens(PROMPT, None, 40)[0])
