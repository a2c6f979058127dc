"""The Responses API pieces without a server: the renderer's event sequences (checked
against the openai SDK's own event types and its stream accumulator), the request's
conversion to a Chat Completions body, and a whole answer as a Response."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai._models import construct_type
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from firsttoken.api.bodies import APIError
from firsttoken.api.pipeline import Ending
from firsttoken.api.responses.adapter import (
    RESPONSES,
    chat_body,
    chat_messages,
    response_base,
    transcript,
)
from firsttoken.api.responses.protocol import ResponsesRequest
from firsttoken.api.responses.stored import as_it_stands, log_seq, owns, starting_after
from firsttoken.config import Settings
from firsttoken.core.stream import Outcome, Stream
from firsttoken.formats.assemble import ChatAnswer, ToolCall
from firsttoken.formats.render import ChatRenderer
from firsttoken.formats.responses import ResponsesRenderer, response_from_answer, response_usage
from firsttoken.formats.sse import OWNER_IDS, event_id_of, event_payload
from firsttoken.generation import Delta, GenerationRequest, ToolCallDelta

USAGE = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def renderer(**request: Any) -> ResponsesRenderer:
    req = ResponsesRequest.model_validate({"input": "hi", **request})
    return ResponsesRenderer(response_base(req, "resp_k", "synthetic", 1700000000), "k")


def run(r: ResponsesRenderer, *steps: str | Delta, finish: str | None = "stop") -> list[dict]:
    """Drive the renderer as `Stream` does; every event parsed, name checked against type."""
    events: list[tuple[str | None, bytes]] = list(r.opening())
    in_text = False
    for step in steps:
        if isinstance(step, str):
            if not in_text:
                events.extend(r.begin_text())
                in_text = True
            events.append((r.token_event, r.token(step)))
        else:
            events.extend(r.part(step))
            in_text = False
    if finish is not None:
        events.extend(r.closing(finish, USAGE))
    out = []
    for name, data in events:
        body = json.loads(data)
        assert name == body["type"]
        out.append(body)
    return out


def sdk_check(events: list[dict]) -> Any:
    """Each event validates as the SDK's type; the SDK's stream helper accepts the sequence
    (output identities, indexes); returns the final response it assembled."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for body in events:
        if body["type"] not in ("error", "response.failed"):  # error codes are ours
            EVENTS.validate_python(body)
        event = construct_type(type_=ResponseStreamEvent, value=body)
        state.handle_event(event)  # type: ignore[arg-type]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return state._completed_response


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_text_stream_events_and_completed_response() -> None:
    events = run(renderer(), "Hel", "lo", "!")
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    delta = events[4]
    assert delta["item_id"] == "msg_k_0" and delta["output_index"] == 0
    assert delta["content_index"] == 0 and delta["logprobs"] == []
    assert events[7]["text"] == "Hello!"
    final = sdk_check(events)
    assert final.output_text == "Hello!" and final.status == "completed"
    completed = events[-1]["response"]
    assert completed["id"] == "resp_k" and completed["object"] == "response"
    assert completed["usage"] == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 7,
    }
    Response.model_validate(completed)  # the whole object, as the SDK types it


def test_reasoning_then_text() -> None:
    events = run(renderer(), Delta(reasoning="think"), Delta(reasoning="ing"), "Yes")
    assert types(events)[2:11] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert (
        events[2]["item"]["type"] == "reasoning" and events[3]["part"]["type"] == "reasoning_text"
    )
    assert events[6]["text"] == "thinking"
    final = sdk_check(events)
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "thinking"
    assert message.id == "msg_k_1" and final.output_text == "Yes"


def test_tool_call_fragments_become_a_function_call_item() -> None:
    steps = [
        Delta(tool_calls=(ToolCallDelta(0, "call_1", "get_weather", ""),)),
        Delta(tool_calls=(ToolCallDelta(0, arguments='{"ci'),)),
        Delta(tool_calls=(ToolCallDelta(0, arguments='ty":"Paris"}'),)),
    ]
    events = run(renderer(), *steps, finish="tool_calls")
    assert types(events)[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[2]["item"]
    assert added["call_id"] == "call_1" and added["name"] == "get_weather"
    assert added["arguments"] == ""
    assert events[5]["arguments"] == '{"city":"Paris"}'
    (call,) = sdk_check(events).output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}


def test_two_tool_calls_are_two_items() -> None:
    steps = [
        Delta(tool_calls=(ToolCallDelta(0, "call_a", "f", "{}"),)),
        Delta(tool_calls=(ToolCallDelta(1, "call_b", "g", "{"),)),
        Delta(tool_calls=(ToolCallDelta(1, arguments="}"),)),
    ]
    final = sdk_check(run(renderer(), *steps, finish="tool_calls"))
    assert [(c.call_id, c.name, c.arguments) for c in final.output] == [
        ("call_a", "f", "{}"),
        ("call_b", "g", "{}"),
    ]


def test_an_id_repeated_on_every_fragment_is_one_call() -> None:
    steps = [
        Delta(tool_calls=(ToolCallDelta(0, "call_a", "f", '{"x"'),)),
        Delta(tool_calls=(ToolCallDelta(0, "call_a", None, ":1}"),)),
    ]
    (call,) = sdk_check(run(renderer(), *steps, finish="tool_calls")).output
    assert (call.call_id, call.name, call.arguments) == ("call_a", "f", '{"x":1}')


def test_refusal_then_text_share_one_message() -> None:
    events = run(renderer(), Delta(refusal="No."), " But", " yes")
    assert "response.refusal.delta" in types(events) and "response.refusal.done" in types(events)
    (message,) = sdk_check(events).output
    assert [p.type for p in message.content] == ["refusal", "output_text"]
    assert message.content[0].refusal == "No." and message.content[1].text == " But yes"


def test_length_finish_is_incomplete() -> None:
    events = run(renderer(max_output_tokens=2), "a", "b", finish="length")
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["max_output_tokens"] == 2
    assert last["response"]["output"][0]["status"] == "incomplete"
    sdk_check(events)


def test_error_mid_text_fails_with_partial_output() -> None:
    r = renderer()
    events = run(r, "par", "tial", finish=None)
    events += [json.loads(data) for _, data in r.error("engine_overloaded", "boom")]
    failed, error = events[-2:]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "engine_overloaded", "message": "boom"}
    (message,) = failed["response"]["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "partial"
    # `event: error`: the SDK's error event fields, and the top-level `error` it raises on.
    assert error["type"] == "error" and error["code"] == "engine_overloaded"
    assert error["error"]["code"] == "engine_overloaded" and error["error"]["message"] == "boom"
    sdk_check(events)


def test_cancel_is_a_cancelled_response() -> None:
    r = renderer()
    run(r, "x", finish=None)
    name, data = r.error("cancelled", "the stream was cancelled", "cancelled")[0]
    assert name == "response.failed" and json.loads(data)["response"]["status"] == "cancelled"


def test_response_from_answer() -> None:
    base = response_base(ResponsesRequest(input="hi"), "resp_k", "synthetic", 1)
    answer = ChatAnswer(
        content="",
        reasoning="hmm",
        tool_calls=[ToolCall("call_1", "f", '{"a":1}')],
        finish_reason="tool_calls",
        usage={**USAGE, "completion_tokens_details": {"reasoning_tokens": 1}},
    )
    body = response_from_answer(base, "k", answer)
    parsed = Response.model_validate(body)
    assert parsed.status == "completed"
    assert [o.type for o in parsed.output] == ["reasoning", "function_call"]
    assert parsed.output[0].id == "rs_k_0" and parsed.output[1].id == "fc_k_1"
    assert parsed.usage is not None and parsed.usage.output_tokens_details.reasoning_tokens == 1
    text = response_from_answer(base, "k", ChatAnswer(content="Hi", finish_reason="length"))
    assert text["status"] == "incomplete" and text["output"][0]["status"] == "incomplete"
    assert Response.model_validate(text).output_text == "Hi"


def test_usage_keeps_cached_tokens() -> None:
    usage = response_usage({**USAGE, "prompt_tokens_details": {"cached_tokens": 2}})
    assert usage["input_tokens_details"]["cached_tokens"] == 2


# -- the request -------------------------------------------------------------------------


def request(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate(body)


def test_string_input_and_instructions() -> None:
    req = request(input="Hi", instructions="Be brief.", max_output_tokens=9, temperature=0.5)
    assert chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    body = chat_body(req, "m")
    assert body["max_completion_tokens"] == 9 and body["temperature"] == 0.5
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and "max_output_tokens" not in body
    gen = RESPONSES.generation(req, "m", "id")
    assert gen.prompt == "system: Be brief.\nuser: Hi"
    assert gen.max_tokens == 9 and gen.body == body


AGENT_INPUT = [
    {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "Weather "},
            {"type": "input_text", "text": "here?"},
            {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"},
        ],
    },
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}],
    },
    {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"c":"P"}'},
    {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    {
        "type": "function_call_output",
        "call_id": "c2",
        "output": [{"type": "input_text", "text": "noon"}],
    },
]


def test_items_become_chat_messages() -> None:
    assert chat_messages(request(input=AGENT_INPUT)) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather "},
                {"type": "text", "text": "here?"},
                {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"c":"P"}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]
    assert transcript(request(input=AGENT_INPUT)) == [
        ("user", "Weather here?"),
        ("assistant", "Let me check."),
        ("assistant", 'weather({"c":"P"})'),
        ("assistant", "time({})"),
        ("tool", "sunny"),
        ("tool", "noon"),
    ]


def test_a_call_without_a_message_opens_an_assistant_turn() -> None:
    items = [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ]
    assert chat_messages(request(input=items))[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def test_tools_tool_choice_and_text_format() -> None:
    tool = {
        "type": "function",
        "name": "weather",
        "description": "the weather",
        "parameters": {"type": "object", "properties": {}},
        "strict": True,
    }
    body = chat_body(
        request(
            input="q",
            tools=[tool],
            tool_choice={"type": "function", "name": "weather"},
            parallel_tool_calls=False,
            text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
            reasoning={"effort": "low"},
            top_logprobs=2,
            synthetic={"ttft_ms": 5},
        ),
        "m",
    )
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "the weather",
                "parameters": {"type": "object", "properties": {}},
                "strict": True,
            },
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": {"type": "object"}},
    }
    assert body["reasoning_effort"] == "low"
    assert body["logprobs"] is True and body["top_logprobs"] == 2
    assert body["synthetic"] == {"ttft_ms": 5}
    for choice in ("auto", "none", "required"):
        assert chat_body(request(input="q", tool_choice=choice), "m")["tool_choice"] == choice
    allowed = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "function", "name": "f"}],
    }
    assert chat_body(request(input="q", tool_choice=allowed), "m")["tool_choice"] == {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "auto",
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
    }


def test_response_base_echoes_the_request() -> None:
    req = request(
        input="q",
        instructions="sys",
        tools=[{"type": "function", "name": "f"}],
        metadata={"a": "b"},
        temperature=0.2,
    )
    base = response_base(req, "resp_x", "m", 5)
    assert base["instructions"] == "sys" and base["metadata"] == {"a": "b"}
    assert base["temperature"] == 0.2 and base["tool_choice"] == "auto"
    assert base["tools"][0]["name"] == "f" and base["tools"][0]["type"] == "function"
    Response.model_validate(base)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "q", "conversation": "conv_1"}, "conversation", "not kept here"),
        ({"input": "q", "tools": [{"type": "web_search"}]}, "tools.0", "function tools only"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"input": [{"type": "computer_call_output"}]}, "input", "unsupported input item"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input",
            "image_url",
        ),
        ({"input": "q", "tool_choice": {"type": "web_search"}}, "tool_choice", "allowed_tools"),
        ({"input": "q", "max_output_tokens": 0}, "max_output_tokens", "greater than"),
        ({}, "input", "Field required"),
        ({"input": "q", "background": True, "store": False}, "background", "need store"),
    ],
)
def test_refused_requests(body: dict, param: str, words: str) -> None:
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate(body)
    error = info.value.errors()[0]
    assert ".".join(str(p) for p in error["loc"]).startswith(param)
    assert words in str(info.value)


def test_the_responses_adapter_plans_a_stream_or_a_folded_response() -> None:
    streamed = RESPONSES.plan(
        request(input="q", stream=True, stream_options={"coalesce": "off"}), "m", "s1", 3
    )
    assert streamed.ending is Ending.STREAM and isinstance(streamed.renderer, ResponsesRenderer)
    assert streamed.coalesce == "off" and not streamed.meta  # SDKs would misread meta events
    whole = RESPONSES.plan(request(input="q"), "m", "s1", 3)
    assert whole.ending is Ending.WHOLE and isinstance(whole.renderer, ChatRenderer)
    assert whole.fold is not None
    response = whole.fold(ChatAnswer(content="ok", usage={"prompt_tokens": 3}))
    assert response["id"] == "resp_s1" and response["status"] == "completed"


# -- responses read back by id (`stored.py`) ----------------------------------------------


def stream_of(r: ResponsesRenderer, tenant: str = "alice") -> Stream:
    request = GenerationRequest(request_id="k", prompt="hi", model="synthetic", tenant=tenant)
    return Stream(
        request,
        r,
        format="responses",
        trace_id="t",
        grace_s=0,
        prompt_tokens=1,
        max_events=100,
        accepted_at=0.0,
    )


def framed(stream: Stream) -> list[tuple[int, int | None, str | None, dict]]:
    """The log's events: (seq, SSE id, name, data)."""
    log = stream.log
    out = []
    for seq in range(1, log.last_seq + 1):
        wire = log.wire(seq)
        assert wire is not None
        name, data = event_payload(wire)
        out.append((seq, event_id_of(wire), name, json.loads(data)))
    return out


@pytest.mark.parametrize("fence", [1, 2, 7])
def test_sequence_number_is_the_log_seq_less_one_whoever_made_the_event(fence: int) -> None:
    stream = stream_of(renderer())
    stream.begin()
    stream.number_as(fence)  # a takeover's ids from here on; the count goes on
    for text in ("a", "b", "c"):
        stream.push(text)
    stream.finish("stop")
    events = framed(stream)
    assert len(events) > 8
    for seq, event_id, _, data in events:
        assert data["sequence_number"] == seq - 1 and log_seq(data["sequence_number"]) == seq
        assert event_id == (seq if fence == 1 or seq <= 2 else fence * OWNER_IDS + seq)


def test_starting_after_is_the_log_seq_to_read_after_or_a_400_naming_it() -> None:
    assert starting_after(None, 10) == 0 and starting_after("", None) == 0  # from the start
    assert starting_after("0", 10) == 1 and starting_after("9", 10) == 10
    assert starting_after("123456", None) == 123457  # a mirror's end is not known yet
    for bad, last in (("-1", 10), ("x", 10), ("1.5", 10), ("²", 10), ("9" * 19, None)):
        with pytest.raises(APIError) as info:
            starting_after(bad, last)
        assert info.value.status == 400 and info.value.param == "starting_after"
    with pytest.raises(APIError) as info:
        starting_after("10", 10)  # sequence numbers 0-9: nothing numbered 10 was sent
    assert "past this response's last event so far (sequence_number 9)" in info.value.message


def test_the_response_as_it_stands_from_its_events() -> None:
    stream = stream_of(renderer())
    stream.begin()
    stream.push("a")
    running = as_it_stands(name_data(stream))
    assert running is not None and running["status"] == "in_progress"
    assert running["id"] == "resp_k" and running["output"] == []
    stream.push("b")
    stream.finish("stop")
    done = as_it_stands(name_data(stream))
    assert done is not None and done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "ab"
    cut = stream_of(renderer(max_output_tokens=1))
    cut.begin()
    cut.push("a")
    cut.finish("length")
    assert (as_it_stands(name_data(cut)) or {})["status"] == "incomplete"
    assert as_it_stands([("ping", b"{}"), (None, b'{"token":"x"}')]) is None  # no Response


def test_a_cancelled_response_stands_cancelled_with_what_it_made() -> None:
    stream = stream_of(renderer())
    stream.begin()
    stream.push("a")
    stream.stop(Outcome.CANCELLED)
    response = as_it_stands(name_data(stream))
    assert response is not None and response["status"] == "cancelled"
    assert response["error"]["code"] == "cancelled"
    assert response["output"][0]["content"][0]["text"] == "a"


def test_only_the_key_that_made_a_response_owns_it() -> None:
    stream = stream_of(renderer(), tenant="alice")
    assert owns(stream, "alice") and not owns(stream, "bob") and not owns(stream, "")
    open_server = stream_of(renderer(), tenant="")
    assert owns(open_server, "")  # no keys file: every caller is the one unnamed key


def test_a_background_request_plans_a_handle_and_its_own_grace() -> None:
    plan = RESPONSES.plan(request(input="q", background=True), "m", "s1", 3)
    assert plan.ending is Ending.HANDLE and isinstance(plan.renderer, ResponsesRenderer)
    streamed = RESPONSES.plan(request(input="q", background=True, stream=True), "m", "s1", 3)
    assert streamed.ending is Ending.STREAM
    settings = Settings(openai_grace_s=2.0, responses_ttl_s=50.0)
    assert RESPONSES.grace_for(request(input="q", background=True), settings) == 50.0
    assert RESPONSES.grace_for(request(input="q", stream=True), settings) == 2.0
    base = response_base(request(input="q", background=True), "resp_s1", "m", 1)
    assert base["background"] is True and base["store"] is True
    assert response_base(request(input="q"), "resp_s1", "m", 1)["store"] is True
    assert response_base(request(input="q", store=False), "resp_s1", "m", 1)["store"] is False
    chained = response_base(request(input="q", previous_response_id="resp_a"), "resp_b", "m", 1)
    assert chained["previous_response_id"] == "resp_a"


def name_data(stream: Stream) -> list[tuple[str | None, bytes]]:
    return [(name, json.dumps(data).encode()) for _, _, name, data in framed(stream)]
