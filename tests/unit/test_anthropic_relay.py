"""The anthropic target kind without sockets: a Chat Completions body as a Messages body, the
upstream's recorded event streams as deltas, the prefill's whitespace, and error mapping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Any

import orjson
import pytest

from firsttoken.api.anthropic.adapter import chat_body
from firsttoken.api.anthropic.protocol import MessagesRequest
from firsttoken.engines.anthropic_relay import (
    DEFAULT_MAX_TOKENS,
    MessagesReader,
    http_error,
    messages_body,
    read_stream,
)
from firsttoken.engines.upstream import retry_after
from firsttoken.generation import Delta, EngineError, GenerationRequest, ToolCallDelta


def body_of(chat: dict[str, Any], model: str | None = None, **fields: Any) -> dict[str, Any]:
    request = GenerationRequest(
        request_id="r1", prompt="", model=chat.get("model", "route"), body=chat, **fields
    )
    return messages_body(request, model).body


def sse(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (name.encode(), orjson.dumps(data)) for name, data in events
    )


def read(raw: bytes, trimmed: str = "", piece: int = 7) -> list[Delta]:
    """The deltas of a recorded stream, fed in pieces of `piece` bytes (events split anywhere,
    inside UTF-8 sequences too)."""

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), piece):
            yield raw[i : i + piece]

    async def run() -> list[Delta]:
        return [d async for d in read_stream(chunks(), MessagesReader(trimmed))]

    return asyncio.run(run())


def start(input_tokens: int = 25, **usage: int) -> tuple[str, dict[str, Any]]:
    message = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-sonnet-4-5",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 1, **usage},
    }
    return "message_start", {"type": "message_start", "message": message}


def block(index: int, content: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_start", {
        "type": "content_block_start",
        "index": index,
        "content_block": content,
    }


def delta(index: int, **fields: Any) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": fields}


def text(index: int, piece: str) -> tuple[str, dict[str, Any]]:
    return delta(index, type="text_delta", text=piece)


def stop(index: int) -> tuple[str, dict[str, Any]]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


def end(reason: str = "end_turn", output_tokens: int = 15) -> list[tuple[str, dict[str, Any]]]:
    return [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": None},
                "usage": {"output_tokens": output_tokens},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


PING = ("ping", {"type": "ping"})


# -- the body ---------------------------------------------------------------------------------


def test_messages_system_parts_and_images() -> None:
    body = body_of(
        {
            "model": "chat",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use SI units."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is on these?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                        {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}},
                    ],
                },
            ],
        },
        model="claude-sonnet-4-5",
    )
    assert body["model"] == "claude-sonnet-4-5"
    assert body["system"] == [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "Use SI units."},
    ]
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is on these?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                },
                {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
            ],
        }
    ]
    assert body["max_tokens"] == DEFAULT_MAX_TOKENS
    assert body["stream"] is True


def test_one_system_message_is_a_string_and_the_model_defaults_to_the_requests() -> None:
    body = body_of(
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    )
    assert body["system"] == "S" and body["model"] == "route"


def test_tool_calls_and_results_alternate_roles() -> None:
    body = body_of(
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "weather", "arguments": "not json"},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                {
                    "role": "tool",
                    "tool_call_id": "call_2",
                    "content": [{"type": "text", "text": "21 C"}],
                },
                {"role": "user", "content": "And tomorrow?"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "description": "Today's weather",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                        },
                    },
                }
            ],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
    )
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "weather", "input": {"arguments": "not json"}},
    ]
    assert body["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"},
        {
            "type": "tool_result",
            "tool_use_id": "call_2",
            "content": [{"type": "text", "text": "21 C"}],
        },
        {"type": "text", "text": "And tomorrow?"},
    ]
    assert body["tools"] == [
        {
            "name": "weather",
            "description": "Today's weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("auto", {"type": "auto"}),
        ("none", {"type": "none"}),
        ("required", {"type": "any"}),
        ({"type": "function", "function": {"name": "f"}}, {"type": "tool", "name": "f"}),
        (None, None),
    ],
)
def test_tool_choice(choice: Any, expected: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    if choice is not None:
        chat["tool_choice"] = choice
    body = body_of(chat)
    assert body.get("tool_choice") == expected
    assert body["tools"] == [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]


def test_limits_sampling_and_what_passes_through() -> None:
    body = body_of(
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 50,
            "max_completion_tokens": 40,
            "stop": "END",
            "temperature": 1.7,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 7,
            "n": 2,
            "logit_bias": {"1": 2},
            "response_format": {"type": "json_object"},
            "stream_options": {"include_usage": True},
            "metadata": {"user_id": "u-1", "purpose": "eval"},
            "synthetic": {"reasoning_tokens": 3},
            "continue_final_message": False,
        }
    )
    assert body == {
        "model": "route",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        "max_tokens": 40,  # max_completion_tokens first, as OpenAI reads them
        "stream": True,
        "stop_sequences": ["END"],
        "temperature": 1.0,  # Messages' largest
        "top_p": 0.9,
        "top_k": 5,
        "synthetic": {"reasoning_tokens": 3},
        "metadata": {"user_id": "u-1"},
    }


def test_user_becomes_metadata_and_requests_limits_fill_in() -> None:
    body = body_of({"messages": [{"role": "user", "content": "x"}], "user": "u-2"}, max_tokens=9)
    assert body["metadata"] == {"user_id": "u-2"} and body["max_tokens"] == 9


@pytest.mark.parametrize(
    ("effort", "max_tokens", "thinking"),
    [
        ("low", 8000, {"type": "enabled", "budget_tokens": 1024}),
        ("medium", 8000, {"type": "enabled", "budget_tokens": 4096}),
        ("high", 20000, {"type": "enabled", "budget_tokens": 16384}),
        ("high", 8000, {"type": "enabled", "budget_tokens": 7999}),  # under max_tokens
        ("low", 1000, None),  # no budget fits: no thinking rather than a 400
        ("none", 8000, None),
    ],
)
def test_reasoning_effort_becomes_thinking(effort: str, max_tokens: int, thinking: Any) -> None:
    body = body_of(
        {
            "messages": [{"role": "user", "content": "x"}],
            "reasoning_effort": effort,
            "max_tokens": max_tokens,
            "temperature": 0.2,
        }
    )
    assert body.get("thinking") == thinking
    # Thinking takes no temperature but 1: the client's 0.2 goes where thinking is on.
    assert ("temperature" in body) is (thinking is None)


def test_thinking_given_wins_over_reasoning_effort() -> None:
    given = {"type": "enabled", "budget_tokens": 2000}
    body = body_of(
        {
            "messages": [{"role": "user", "content": "x"}],
            "thinking": given,
            "reasoning_effort": "high",
        }
    )
    assert body["thinking"] == given


def test_a_request_without_a_body_sends_its_prompt() -> None:
    request = GenerationRequest(
        request_id="r1",
        prompt="hello there",
        model="m",
        max_tokens=5,
        stop=("x",),
        options={"synthetic": {"itl_ms": 1}},
    )
    body = messages_body(request).body
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hello there"}]}
    ]
    assert body["max_tokens"] == 5 and body["stop_sequences"] == ["x"]
    assert body["synthetic"] == {"itl_ms": 1}


def test_a_completions_body_sends_its_prompt_as_the_users_turn() -> None:
    body = body_of({"model": "m", "prompt": "Once upon a time", "max_tokens": 8})
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}
    ]


def test_a_native_streams_continuation_is_its_prompt_then_a_prefill() -> None:
    # What a splice asks of a prompt without a body: the answer so far is the assistant's
    # prefill, not lost (the model would answer the prompt from the start again).
    request = GenerationRequest(
        request_id="r1",
        prompt="Tell me.",
        model="m",
        max_tokens=5,
        options={"continuation": " The throu"},
    )
    call = messages_body(request)
    assert call.body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Tell me."}]},
        {"role": "assistant", "content": [{"type": "text", "text": " The throu"}]},
    ]


def test_a_continued_completions_body_is_its_prompt_then_a_prefill() -> None:
    # The splice grew the prompt by the text sent and named it: not a new, longer question.
    body = body_of({"prompt": "Once upon a time", "continue_final_text": " a time"})
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Once upon"}]},
        {"role": "assistant", "content": [{"type": "text", "text": " a time"}]},
    ]
    assert "continue_final_text" not in body


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
        {"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}},
    ],
)
def test_what_a_messages_upstream_cannot_take_is_the_clients_400(part: dict[str, Any]) -> None:
    with pytest.raises(EngineError) as caught:
        body_of({"messages": [{"role": "user", "content": [part]}]})
    assert caught.value.status == 400 and caught.value.client_fault
    assert not caught.value.retryable


# -- the prefill --------------------------------------------------------------------------------


def continuation(prefix: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": "Count."},
            {"role": "assistant", "content": prefix},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }


def test_a_continuation_is_a_prefill_without_its_trailing_whitespace() -> None:
    request = GenerationRequest(
        request_id="r1", prompt="", model="m", body=continuation("one two \n")
    )
    call = messages_body(request)
    assert call.body["messages"][-1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "one two"}],
    }
    assert call.trimmed == " \n"
    assert "continue_final_message" not in call.body and "add_generation_prompt" not in call.body


def test_a_whitespace_only_prefill_goes_whole() -> None:
    call = messages_body(
        GenerationRequest(request_id="r1", prompt="", model="m", body=continuation("  "))
    )
    assert [m["role"] for m in call.body["messages"]] == ["user"] and call.trimmed == "  "


@pytest.mark.parametrize(
    ("trimmed", "pieces", "expected"),
    [
        (" ", [" three", " four"], "three four"),  # the model repeats the space
        (" ", ["three"], "three"),  # it does not: nothing to drop
        (" \n", [" ", "\nthree"], "three"),  # repeated across two deltas
        ("\n\n", ["\nthree"], "three"),  # repeats part of it, then text
        ("  ", [" x", " y"], "x y"),  # a part, then a mismatch: the rest is the answer's
        ("", [" three"], " three"),
    ],
)
def test_the_continuation_drops_what_it_repeats_of_the_trimmed_whitespace(
    trimmed: str, pieces: list[str], expected: str
) -> None:
    raw = sse(
        start(),
        block(0, {"type": "text", "text": ""}),
        *(text(0, p) for p in pieces),
        stop(0),
        *end(),
    )
    deltas = read(raw, trimmed)
    assert "".join(d.text for d in deltas) == expected
    assert all(d.text for d in deltas[:-1])  # no empty deltas for dropped text


def test_prefill_then_continuation_sees_no_character_twice_or_missing() -> None:
    full = "one two \n three four"
    for cut in range(1, len(full)):
        prefix, rest = full[:cut], full[cut:]  # the client holds `prefix`
        call = messages_body(
            GenerationRequest(request_id="r1", prompt="", model="m", body=continuation(prefix))
        )
        sent = call.body["messages"][-1]["content"][0]["text"] if prefix.strip() else ""
        # The model continues the prefill it was given: what it says is the full answer's rest
        # after the trimmed prefill, in word-ish pieces.
        said = full[len(sent) :]
        pieces = [said[i : i + 3] for i in range(0, len(said), 3)]
        raw = sse(
            start(), block(0, {"type": "text", "text": ""}), *(text(0, p) for p in pieces), *end()
        )
        assert "".join(d.text for d in read(raw, call.trimmed)) == rest, cut


# -- the events -----------------------------------------------------------------------------


def test_text_stream() -> None:
    raw = sse(
        start(),
        block(0, {"type": "text", "text": ""}),
        PING,
        text(0, "Hello"),
        text(0, ", wörld"),
        text(0, "!"),
        stop(0),
        *end("end_turn", 15),
    )
    deltas = read(raw, piece=5)
    assert [d.text for d in deltas] == ["Hello", ", wörld", "!", ""]
    last = deltas[-1]
    assert last.finish_reason == "stop"
    assert last.usage == {
        "prompt_tokens": 25,
        "completion_tokens": 15,
        "total_tokens": 40,
        "prompt_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    }


def test_thinking_then_text() -> None:
    raw = sse(
        start(),
        block(0, {"type": "thinking", "thinking": ""}),
        delta(0, type="thinking_delta", thinking="Let me see"),
        delta(0, type="thinking_delta", thinking=" - 2+2."),
        delta(0, type="signature_delta", signature="EqQBCgIYAh"),
        stop(0),
        block(1, {"type": "text", "text": ""}),
        text(1, "4"),
        stop(1),
        *end(),
    )
    deltas = read(raw)
    assert [(d.reasoning, d.text) for d in deltas[:-1]] == [
        ("Let me see", ""),
        (" - 2+2.", ""),
        ("", "4"),
    ]


def test_tool_use_fragments() -> None:
    pieces = ["", '{"location":', ' "San Fra', 'ncisco, CA"', ', "unit": "fah', 'renheit"}']
    raw = sse(
        start(),
        block(0, {"type": "text", "text": ""}),
        text(0, "Checking."),
        stop(0),
        block(1, {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {}}),
        *(delta(1, type="input_json_delta", partial_json=p) for p in pieces),
        stop(1),
        block(2, {"type": "tool_use", "id": "toolu_02", "name": "get_time", "input": {}}),
        stop(2),  # a call without arguments
        *end("tool_use", 80),
    )
    deltas = read(raw)
    calls = [c for d in deltas for c in d.tool_calls]
    assert calls[0] == ToolCallDelta(0, "toolu_01", "get_weather", "")
    first = "".join(c.arguments for c in calls if c.index == 0)
    assert orjson.loads(first) == {"location": "San Francisco, CA", "unit": "fahrenheit"}
    assert [c for c in calls if c.index == 1] == [
        ToolCallDelta(1, "toolu_02", "get_time", ""),
        ToolCallDelta(1, arguments="{}"),
    ]
    assert deltas[-1].finish_reason == "tool_calls"


def test_cache_usage_counts_in_the_prompt() -> None:
    raw = sse(
        start(10, cache_creation_input_tokens=200, cache_read_input_tokens=3000),
        block(0, {"type": "text", "text": ""}),
        text(0, "ok"),
        stop(0),
        *end("max_tokens", 42),
    )
    last = read(raw)[-1]
    assert last.finish_reason == "length"
    assert last.usage == {
        "prompt_tokens": 3210,
        "completion_tokens": 42,
        "total_tokens": 3252,
        "prompt_tokens_details": {"cached_tokens": 3000, "cache_write_tokens": 200},
    }


@pytest.mark.parametrize(
    ("reason", "finish"),
    [
        ("stop_sequence", "stop"),
        ("pause_turn", "stop"),
        ("refusal", "content_filter"),
        ("something_new", "stop"),
    ],
)
def test_stop_reasons(reason: str, finish: str) -> None:
    raw = sse(start(), block(0, {"type": "text", "text": ""}), text(0, "x"), stop(0), *end(reason))
    assert read(raw)[-1].finish_reason == finish


@pytest.mark.parametrize(
    ("kind", "retryable"),
    [("overloaded_error", True), ("api_error", True), ("invalid_request_error", False)],
)
def test_error_event(kind: str, retryable: bool) -> None:
    raw = sse(
        start(),
        block(0, {"type": "text", "text": ""}),
        text(0, "Hel"),
        ("error", {"type": "error", "error": {"type": kind, "message": "Overloaded"}}),
    )
    with pytest.raises(EngineError) as caught:
        read(raw)
    assert caught.value.code == kind and caught.value.message == "Overloaded"
    assert caught.value.retryable is retryable


def test_a_body_that_ends_before_message_stop_is_truncated() -> None:
    raw = sse(start(), block(0, {"type": "text", "text": ""}), text(0, "Hel"), *end()[:1])
    with pytest.raises(EngineError) as caught:
        read(raw)
    assert caught.value.code == "upstream_truncated" and caught.value.retryable


@pytest.mark.parametrize(
    "raw",
    [
        b"data: not json\n\n",
        b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0}\n\n',
        b"event: content_block_delta\ndata: [1, 2]\n\n",
    ],
)
def test_a_malformed_event_is_a_bad_response(raw: bytes) -> None:
    with pytest.raises(EngineError) as caught:
        read(raw)
    assert caught.value.code == "upstream_bad_response" and caught.value.retryable


# -- errors before the stream ---------------------------------------------------------------

NOW = 1_800_000_000.0


def anthropic_error(kind: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


@pytest.mark.parametrize("status", [429, 500, 503, 529])
def test_overload_and_server_errors_are_retryable_with_retry_after(status: int) -> None:
    error = http_error(
        anthropic_error("overloaded_error", "Overloaded"), status, {"retry-after": "7"}, NOW
    )
    assert error.retryable and not error.client_fault
    assert error.status == status and error.retry_after_s == 7.0
    assert error.message == "Overloaded" and error.code == f"upstream_{status}"


def test_a_bad_request_is_rejected_with_the_upstreams_status_and_message() -> None:
    raw = anthropic_error("invalid_request_error", "max_tokens: Field required")
    error = http_error(raw, 400, {}, NOW)
    assert (error.code, error.status, error.message) == (
        "upstream_rejected",
        400,
        "max_tokens: Field required",
    )
    assert error.client_fault and not error.retryable and error.type == "invalid_request_error"


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_targets_own_setup_fault_is_not_the_clients(status: int) -> None:
    error = http_error(
        anthropic_error("authentication_error", "invalid x-api-key"), status, {}, NOW
    )
    assert error.code == "upstream_rejected" and error.status == status
    assert not error.client_fault and error.retryable


def test_a_plain_error_body_is_its_status_and_a_message_is_bounded() -> None:
    page = b"<html><body><h1>502 Bad Gateway</h1>" + b"x" * 2000 + b"</body></html>"
    error = http_error(page, 502, {}, NOW)
    # Not an error shape: the status alone reaches the client, the page only the log.
    assert error.message == "the upstream answered 502 Bad Gateway"
    assert error.upstream_said is not None and error.upstream_said.startswith("502 Bad Gateway")
    long = http_error(b'{"error": {"message": "' + b"no " * 400 + b'"}}', 422, {}, NOW)
    assert len(long.message) == 500 and long.code == "upstream_rejected"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30", 30.0),
        ("1.5", 1.5),
        ("-3", 0.0),
        (formatdate(NOW + 120, usegmt=True), 120.0),
        (formatdate(NOW - 60, usegmt=True), 0.0),  # a date past: now
        ("soon", None),
        ("inf", None),
        (None, None),
    ],
)
def test_retry_after(value: str | None, seconds: float | None) -> None:
    assert retry_after(value, NOW) == seconds


def test_a_messages_document_reaches_an_anthropic_target_as_it_was_sent() -> None:
    """A Messages client's `document` block rides through the Chat Completions body whole:
    title, context, citations and its cache marker reach the Anthropic target."""
    document = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"},
        "title": "Q3 report",
        "context": "the board's copy",
        "citations": {"enabled": True},
        "cache_control": {"type": "ephemeral"},
    }
    asked = MessagesRequest.model_validate(
        {
            "model": "claude",
            "max_tokens": 10,
            "messages": [
                {"role": "user", "content": [document, {"type": "text", "text": "Sum it up."}]}
            ],
        }
    )
    body = body_of(chat_body(asked))
    assert body["messages"] == [
        {"role": "user", "content": [document, {"type": "text", "text": "Sum it up."}]}
    ]
