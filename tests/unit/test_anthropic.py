"""The Messages renderer driven through a real stream, its events folded by the anthropic SDK's
own accumulator; and the request's translation to Chat Completions."""

from __future__ import annotations

from typing import Any

import orjson
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from firsttoken.api.anthropic.adapter import MESSAGES, chat_body, prompt_text
from firsttoken.api.anthropic.protocol import MessagesRequest
from firsttoken.api.bodies import APIError
from firsttoken.api.pipeline import Ending
from firsttoken.core.stream import Stream
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.formats.anthropic import MessagesRenderer, message_object, stop_reason
from firsttoken.formats.assemble import ChatAnswer, ToolCall
from firsttoken.formats.render import ChatRenderer
from firsttoken.generation import Delta, ToolCallDelta

_EVENT = TypeAdapter(RawMessageStreamEvent)


def make(max_events: int = 200) -> Stream:
    renderer = MessagesRenderer("msg_s1", "synthetic", input_tokens=3)
    stream = Stream(
        GenerationRequest(request_id="s1", prompt="hi", model="synthetic", max_tokens=50),
        renderer,
        format="anthropic",
        trace_id="t",
        grace_s=0.0,
        prompt_tokens=3,
        max_events=max_events,
        accepted_at=0.0,
    )
    stream.begin()
    return stream


def events(stream: Stream) -> list[tuple[str | None, dict[str, Any]]]:
    out = []
    for e in stream.log.after(0):
        lines = e.wire.decode().strip().split("\n")
        name = next((x[7:] for x in lines if x.startswith("event: ")), None)
        data = next(x[6:] for x in lines if x.startswith("data: "))
        out.append((name, orjson.loads(data)))
    return out


def shape(got: list[tuple[str | None, dict[str, Any]]]) -> list[str]:
    """Each event as `name` or `name[index]:delta type`, the event name always its data's type."""
    out = []
    for name, data in got:
        assert name == data["type"]
        label = name
        if "index" in data:
            label += f"[{data['index']}]"
        if name == "content_block_delta":
            label += ":" + data["delta"]["type"]
        if name == "content_block_start":
            label += ":" + data["content_block"]["type"]
        out.append(label)
    return out


def sdk_message(got: list[tuple[str | None, dict[str, Any]]]) -> Any:
    """What the SDK's `get_final_message()` makes of these events."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    for name, data in got:
        if name in ("ping", "error"):
            continue
        event = _EVENT.validate_python(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def test_text_stream_events() -> None:
    stream = make()
    for token in ("Hello", ",", " world"):
        assert stream.push(token)
    stream.push("!", "length")
    got = events(stream)
    assert shape(got) == [
        "message_start",
        "ping",
        "content_block_start[0]:text",
        "content_block_delta[0]:text_delta",
        "content_block_delta[0]:text_delta",
        "content_block_delta[0]:text_delta",
        "content_block_delta[0]:text_delta",
        "content_block_stop[0]",
        "message_delta",
        "message_stop",
    ]
    start = got[0][1]["message"]
    assert start["id"] == "msg_s1" and start["role"] == "assistant" and start["content"] == []
    assert start["stop_reason"] is None and start["usage"]["input_tokens"] == 3
    assert got[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert got[-2][1]["usage"]["output_tokens"] == 4
    message = sdk_message(got)
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Hello, world!"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4


def test_thinking_then_text() -> None:
    stream = make()
    stream.push_delta(Delta(reasoning="Let me"))
    stream.push_delta(Delta(reasoning=" think"))
    stream.push("Answer")
    stream.push(" here", "stop")
    got = events(stream)
    assert shape(got)[2:] == [
        "content_block_start[0]:thinking",
        "content_block_delta[0]:thinking_delta",
        "content_block_delta[0]:thinking_delta",
        "content_block_delta[0]:signature_delta",
        "content_block_stop[0]",
        "content_block_start[1]:text",
        "content_block_delta[1]:text_delta",
        "content_block_delta[1]:text_delta",
        "content_block_stop[1]",
        "message_delta",
        "message_stop",
    ]
    message = sdk_message(got)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Let me think" and message.content[0].signature
    assert message.content[1].text == "Answer here"
    assert message.stop_reason == "end_turn"


def test_tool_use_input_reassembled_by_the_sdk() -> None:
    arguments = orjson.dumps({"city": "Paris", "units": ["c", "f"], "n": 3}).decode()
    stream = make()
    stream.push("Let me look.")
    stream.push_delta(Delta(tool_calls=(ToolCallDelta(0, "call_1", "get_weather", ""),)))
    pieces = [arguments[i : i + 5] for i in range(0, len(arguments), 5)]
    for piece in pieces[:-1]:
        stream.push_delta(Delta(tool_calls=(ToolCallDelta(0, arguments=piece),)))
    stream.push_delta(
        Delta(tool_calls=(ToolCallDelta(0, arguments=pieces[-1]),), finish_reason="tool_calls")
    )
    got = events(stream)
    labels = shape(got)
    assert labels[2:5] == [
        "content_block_start[0]:text",
        "content_block_delta[0]:text_delta",
        "content_block_stop[0]",
    ]
    assert labels[5] == "content_block_start[1]:tool_use"
    assert labels[6:-3] == ["content_block_delta[1]:input_json_delta"] * len(pieces)
    assert labels[-3:] == ["content_block_stop[1]", "message_delta", "message_stop"]
    block = got[5][1]["content_block"]
    assert block == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    message = sdk_message(got)
    assert message.content[1].input == orjson.loads(arguments)
    assert message.content[1].name == "get_weather" and message.content[1].id == "call_1"
    assert message.stop_reason == "tool_use"


def test_text_after_a_tool_call_opens_a_new_text_block() -> None:
    stream = make()
    stream.push_delta(Delta(tool_calls=(ToolCallDelta(0, "c0", "a", "{}"),)))
    stream.push_delta(Delta(tool_calls=(ToolCallDelta(1, "c1", "b", '{"x":1}'),)))
    stream.push("done", "stop")
    labels = shape(events(stream))
    assert labels[2:-2] == [
        "content_block_start[0]:tool_use",
        "content_block_delta[0]:input_json_delta",
        "content_block_stop[0]",
        "content_block_start[1]:tool_use",
        "content_block_delta[1]:input_json_delta",
        "content_block_stop[1]",
        "content_block_start[2]:text",
        "content_block_delta[2]:text_delta",
        "content_block_stop[2]",
    ]


def test_a_repeated_call_id_continues_its_block() -> None:
    stream = make()
    for piece in ('{"a"', ":", "1}"):
        stream.push_delta(Delta(tool_calls=(ToolCallDelta(0, "c0", "f", piece),)))
    stream.finish("tool_calls")
    got = events(stream)
    assert shape(got)[2:-2] == [
        "content_block_start[0]:tool_use",
        "content_block_delta[0]:input_json_delta",
        "content_block_delta[0]:input_json_delta",
        "content_block_delta[0]:input_json_delta",
        "content_block_stop[0]",
    ]
    assert sdk_message(got).content[0].input == {"a": 1}


def test_error_mid_stream_is_anthropic_error_event() -> None:
    stream = make()
    stream.push("partial")
    stream.fail(EngineError("engine_overloaded", "busy"))
    got = events(stream)
    assert got[-1] == (
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}},
    )
    stream = make()
    stream.fail(EngineError("engine_error", "boom"))
    assert events(stream)[-1][1]["error"]["type"] == "api_error"


def test_empty_answer_has_no_block() -> None:
    stream = make()
    stream.finish("stop")
    assert shape(events(stream)) == ["message_start", "ping", "message_delta", "message_stop"]


def test_stop_reasons() -> None:
    assert stop_reason("stop") == "end_turn"
    assert stop_reason("length") == "max_tokens"
    assert stop_reason("tool_calls") == "tool_use"
    assert stop_reason("content_filter") == "refusal"


def test_message_object_from_a_chat_answer() -> None:
    answer = ChatAnswer(
        content="Sure.",
        reasoning="hmm",
        tool_calls=[ToolCall("call_9", "lookup", '{"q": "x"}')],
        finish_reason="tool_calls",
        usage={"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13},
    )
    message = message_object("msg_1", "synthetic", answer)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][0]["thinking"] == "hmm" and message["content"][0]["signature"]
    assert message["content"][2]["input"] == {"q": "x"}
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 4, "output_tokens": 9}
    bad = ChatAnswer(tool_calls=[ToolCall("c", "f", "{not json")])
    assert message_object("m", "s", bad)["content"][0]["input"] == {"arguments": "{not json"}


# -- the request ---------------------------------------------------------------------------------


AGENT_TURN = {
    "model": "synthetic",
    "max_tokens": 100,
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the weather in Paris?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw=="},
                },
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "call_1",
                    "content": [{"type": "text", "text": "18 C"}],
                },
                {"type": "text", "text": "Thanks"},
            ],
        },
    ],
    "tools": [
        {
            "name": "weather",
            "description": "Current weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "stop_sequences": ["END"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 40,
    "metadata": {"user_id": "u1"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "synthetic": {"reasoning_tokens": 3},
    "unknown_field": True,
}


def test_agent_turn_as_chat_completions_body() -> None:
    body = chat_body(MessagesRequest.model_validate(AGENT_TURN), "synthetic")
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the weather in Paris?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw=="}},
            ],
        },
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "user", "content": "Thanks"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["stop"] == ["END"] and body["max_tokens"] == 100 and body["stream"] is True
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.5, 0.9, 40)
    assert body["user"] == "u1" and body["synthetic"] == {"reasoning_tokens": 3}
    assert "unknown_field" not in body and "thinking" not in body


def test_tool_choice_mapping() -> None:
    def choice(tc: dict[str, Any]) -> Any:
        request = {**AGENT_TURN, "tool_choice": tc}
        return chat_body(MessagesRequest.model_validate(request))["tool_choice"]

    assert choice({"type": "auto"}) == "auto"
    assert choice({"type": "none"}) == "none"
    assert choice({"type": "any"}) == "required"
    assert choice({"type": "tool", "name": "weather"}) == {
        "type": "function",
        "function": {"name": "weather"},
    }


def test_generation_request_prompt_and_limits() -> None:
    request = MessagesRequest.model_validate(
        {
            "model": "synthetic",
            "max_tokens": 7,
            "system": "S",
            "messages": [{"role": "user", "content": "Q"}],
            "stop_sequences": ["x", "y"],
            "temperature": 0.2,
            "synthetic": {"ttft_ms": 5},
        }
    )
    generation = MESSAGES.generation(request, "synthetic", "id1")
    assert generation.prompt == "system: S\nuser: Q"
    assert generation.max_tokens == 7 and generation.stop == ("x", "y")
    assert generation.seed is None and generation.temperature == 0.2
    assert generation.options["synthetic"]["ttft_ms"] == 5
    assert generation.messages == (
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
    )
    assert generation.body is not None and generation.body["model"] == "synthetic"


def test_prompt_renders_the_agent_turn_as_chat_does() -> None:
    body = chat_body(MessagesRequest.model_validate(AGENT_TURN))
    assert prompt_text(body["messages"]) == (
        "system: Be brief.\n"
        "user: What is the weather in Paris?\n"
        "assistant: Checking.\n"
        "tool: 18 C\n"
        "user: Thanks"
    )


def test_url_image_and_string_tool_result() -> None:
    request = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
                    ],
                },
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
                },
            ],
        }
    )
    messages = chat_body(request)["messages"]
    assert messages[0]["content"] == [
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}}
    ]
    assert messages[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert messages[2:] == [{"role": "tool", "tool_call_id": "t", "content": "ok"}]


def test_the_messages_adapter_plans_a_stream_with_its_input_tokens_or_a_folded_message() -> None:
    request = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    stream = MessagesRequest.model_validate({**request, "stream": True})
    streamed = MESSAGES.plan(stream, "m", "s1", 9)
    assert streamed.ending is Ending.STREAM
    assert isinstance(streamed.renderer, MessagesRenderer) and streamed.renderer.input_tokens == 9
    whole = MESSAGES.plan(MessagesRequest.model_validate(request), "m", "s1", 9)
    assert whole.ending is Ending.WHOLE and isinstance(whole.renderer, ChatRenderer)
    assert whole.fold is not None
    message = whole.fold(ChatAnswer(content="ok", usage={"prompt_tokens": 9}))
    assert message["id"] == "msg_s1" and message["content"] == [{"type": "text", "text": "ok"}]


def test_the_messages_adapter_answers_errors_in_anthropics_shape() -> None:
    refused = MESSAGES.refused(APIError(429, "rate_limited", "slow down"), "t1")
    body = orjson.loads(refused.body)
    assert refused.status_code == 429 and refused.headers["x-request-id"] == "t1"
    assert body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
        "request_id": "t1",
    }
    failed = MESSAGES.failed(
        EngineError("upstream_timeout", "late", status=503), "t1", {"x-stream-id": "s1"}
    )
    body = orjson.loads(failed.body)
    assert failed.status_code == 503 and failed.headers["x-stream-id"] == "s1"
    assert failed.headers["retry-after"] == "1"
    assert body["error"] == {"type": "timeout_error", "message": "late"}


def test_cache_control_markers_reach_an_anthropic_target_unchanged() -> None:
    from firsttoken.engines.anthropic_relay import messages_body

    marker = {"type": "ephemeral"}
    body = MessagesRequest.model_validate(
        {
            "model": "claude",
            "max_tokens": 10,
            "system": [{"type": "text", "text": "a long system prompt", "cache_control": marker}],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a long document", "cache_control": marker}
                    ],
                }
            ],
        }
    )
    chat = chat_body(body)
    upstream = messages_body(
        GenerationRequest(request_id="r", prompt="", model="claude", body=chat)
    ).body
    assert upstream["system"] == [
        {"type": "text", "text": "a long system prompt", "cache_control": marker}
    ]
    assert upstream["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a long document", "cache_control": marker}],
        }
    ]


def test_usage_shows_the_prompt_caches_reads_and_writes_apart() -> None:
    from firsttoken.formats.anthropic import cache_counts

    usage = {
        "prompt_tokens": 3210,
        "prompt_tokens_details": {"cached_tokens": 3000, "cache_write_tokens": 200},
    }
    assert cache_counts(usage) == {
        "input_tokens": 10,
        "cache_creation_input_tokens": 200,
        "cache_read_input_tokens": 3000,
    }
    assert cache_counts({"prompt_tokens": 5}) == {"input_tokens": 5}
