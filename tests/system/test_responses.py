"""The OpenAI Responses API (`POST /v1/responses`) with the official openai SDK, unchanged,
against a real server."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from firsttoken.engines import GenerationRequest
from firsttoken.engines.synthetic import SyntheticOptions, answer_parts, synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.rawhttp import RawStream
from tests.servers import Server, run_server
from tests.upstreams import VLLM_ARGUMENTS, scripted_upstream

QUESTION = "Why does streaming matter?"
PROMPT = "user: " + QUESTION
WEATHER = {"city": "Paris", "units": "metric", "days": [1, 2, 3], "note": 'naïve ✨ "quoted"'}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": False,
    }
]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def expected_text(prompt: str = PROMPT, seed: int = 0, tokens: int = 30) -> list[str]:
    return synthetic_tokens(prompt, seed, None, tokens)[0]


def knobs(**synthetic: object) -> dict:
    return {"synthetic": synthetic}


def test_stream_helper_text_and_final_response(server: Server) -> None:
    expected = expected_text(seed=3)
    with client(server).responses.stream(
        model="synthetic",
        input=QUESTION,
        extra_body={"seed": 3, **knobs(answer_tokens=30)},
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas == expected  # one event per token, token-exact
    assert final.output_text == "".join(expected)
    assert final.status == "completed" and final.id.startswith("resp_")
    assert final.model == "synthetic" and final.object == "response"
    assert final.usage is not None and final.usage.output_tokens == len(expected)
    assert final.usage.total_tokens == final.usage.input_tokens + len(expected)


def test_create_stream_event_sequence(server: Server) -> None:
    events = list(
        client(server).responses.create(
            model="synthetic",
            input=QUESTION,
            stream=True,
            instructions="Be brief.",
            extra_body=knobs(answer_tokens=10),
        )
    )
    expected = expected_text("system: Be brief.\n" + PROMPT, tokens=10)
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(expected),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0  # strictly increasing
    created, completed = events[0], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []
    assert created.response.instructions == "Be brief."
    assert completed.response.id == created.response.id
    assert completed.response.output_text == "".join(expected)
    assert events[-4].text == "".join(expected)  # response.output_text.done


def reasoning_parts(seed: int = 0) -> tuple[str, str]:
    request = GenerationRequest(request_id="x", prompt=PROMPT, model="synthetic", seed=seed)
    parts, _ = answer_parts(request, SyntheticOptions(reasoning_tokens=6, answer_tokens=12))
    reasoning = "".join(p.reasoning for p in parts if not isinstance(p, str))
    return reasoning, "".join(p for p in parts if isinstance(p, str))


def test_reasoning_events_then_text(server: Server) -> None:
    reasoning, text = reasoning_parts()
    events = list(
        client(server).responses.create(
            model="synthetic",
            input=QUESTION,
            stream=True,
            extra_body=knobs(reasoning_tokens=6, answer_tokens=12),
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning"
    assert kinds.count("response.reasoning_text.delta") == 6
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done.text == reasoning
    # the reasoning item closes before the message opens
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == reasoning and final.output_text == text
    assert final.usage.output_tokens_details.reasoning_tokens == 6
    # the same answer, whole
    whole = client(server).responses.create(
        model="synthetic", input=QUESTION, extra_body=knobs(reasoning_tokens=6, answer_tokens=12)
    )
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == reasoning and whole.output_text == text
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens == 6


def test_function_call_arguments_reassemble_exactly(server: Server) -> None:
    call_knob = knobs(tool_call={"name": "get_weather", "arguments": WEATHER})
    with client(server).responses.stream(
        model="synthetic", input=QUESTION, tools=TOOLS, extra_body=call_knob
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 3  # the arguments arrive in fragments
    assert pieces[-1].snapshot == "".join(p.delta for p in pieces)  # the SDK's accumulation
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments) == json.loads(done.arguments) == WEATHER
    assert final.output_text == ""
    whole = client(server).responses.create(
        model="synthetic", input=QUESTION, tools=TOOLS, extra_body=call_knob
    )
    (same,) = whole.output
    assert same.type == "function_call" and json.loads(same.arguments) == WEATHER
    assert same.call_id == call.call_id  # deterministic, as the engine is


@pytest.mark.parametrize("stream", [True, False])
def test_agent_loop(server: Server, stream: bool) -> None:
    c = client(server)
    first = c.responses.create(
        model="synthetic",
        input=[{"role": "user", "content": QUESTION}],
        tools=TOOLS,
        extra_body=knobs(tool_call={"name": "get_weather", "arguments": WEATHER}),
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    result = {"temperature": 21}
    follow_up = [
        {"role": "user", "content": QUESTION},
        *first.output,  # what the SDK docs do: the previous output goes back as input
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(result)},
    ]
    prompt = f"{PROMPT}\nassistant: get_weather({call.arguments})\ntool: {json.dumps(result)}"
    expected = "".join(expected_text(prompt, tokens=15))
    if stream:
        with c.responses.stream(
            model="synthetic", input=follow_up, tools=TOOLS, extra_body=knobs(answer_tokens=15)
        ) as s:
            final = s.get_final_response()
    else:
        final = c.responses.create(
            model="synthetic", input=follow_up, tools=TOOLS, extra_body=knobs(answer_tokens=15)
        )
    assert final.status == "completed" and final.output_text == expected
    assert [o.type for o in final.output] == ["message"]


def test_non_streaming_text(server: Server) -> None:
    expected = expected_text(seed=4, tokens=20)
    r = client(server).responses.create(
        model="synthetic", input=QUESTION, extra_body={"seed": 4, **knobs(answer_tokens=20)}
    )
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "".join(expected)
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.usage is not None and r.usage.output_tokens == len(expected)


def test_max_output_tokens_is_incomplete(server: Server) -> None:
    expected = synthetic_tokens(PROMPT, None, 7)[0]
    events = list(
        client(server).responses.create(
            model="synthetic", input=QUESTION, stream=True, max_output_tokens=7
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == "".join(expected)
    whole = client(server).responses.create(model="synthetic", input=QUESTION, max_output_tokens=7)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text == "".join(expected) and whole.max_output_tokens == 7
    assert whole.usage is not None and whole.usage.output_tokens == 7


def test_error_mid_stream_raises_after_partial_text(server: Server) -> None:
    expected = expected_text()
    received: list[str] = []
    failed = []
    with pytest.raises(openai.APIError) as info:
        for event in client(server).responses.create(
            model="synthetic",
            input=QUESTION,
            stream=True,
            extra_body=knobs(answer_tokens=30, fail_after=8, error_code="engine_overloaded"),
        ):
            if event.type == "response.output_text.delta":
                received.append(event.delta)
            elif event.type == "response.failed":
                failed.append(event.response)
    assert info.value.code == "engine_overloaded"
    assert "after 8 tokens" in info.value.message
    assert received == expected[:8]
    (response,) = failed  # what arrived stays with the caller, in the failed response too
    assert response.status == "failed" and response.output_text == "".join(expected[:8])
    assert response.error.code == "engine_overloaded"


def test_error_mid_stream_raises_in_the_helper(server: Server) -> None:
    with pytest.raises(openai.APIError) as info:
        with client(server).responses.stream(
            model="synthetic", input=QUESTION, extra_body=knobs(fail_after=3)
        ) as stream:
            for _ in stream:
                pass
    assert info.value.code == "engine_error"


def test_non_streaming_engine_error_is_an_http_error(server: Server) -> None:
    r = httpx.post(
        server.v1 + "/responses",
        json={"input": QUESTION, "synthetic": {"fail_after": 2}},
        timeout=10,
    )
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"


def test_refusals_are_4xx_in_the_openai_shape(server: Server) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="synthetic", input=QUESTION, conversation="conv_1")
    assert info.value.param == "conversation"
    assert "previous_response_id" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="synthetic", input=QUESTION, tools=[{"type": "web_search"}])
    assert "function tools only" in info.value.message
    with pytest.raises(openai.NotFoundError) as nf:
        c.responses.create(model="gpt-9", input=QUESTION)
    assert nf.value.code == "model_not_found"
    r = httpx.post(server.v1 + "/responses", json={"input": QUESTION, "max_output_tokens": 0})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"code", "message", "type", "param"}
    assert error["type"] == "invalid_request_error" and error["param"] == "max_output_tokens"


def test_stream_headers_and_metrics(server: Server) -> None:
    before = server.metrics()
    with httpx.stream(
        "POST",
        server.v1 + "/responses",
        json={"input": QUESTION, "stream": True, "synthetic": {"answer_tokens": 5}},
        timeout=10,
    ) as r:
        body = r.read()
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-stream-id"] and r.headers["x-resume-token"]
    assert r.headers["x-accel-buffering"] == "no"
    events = list(EventDecoder().feed(body))
    assert events[-1].event == "response.completed"
    assert all(e.data != "[DONE]" for e in events)
    after = server.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta['firsttoken_streams_total{outcome="completed"}'] == 1
    assert delta["firsttoken_ttft_seconds_count"] == 1
    assert delta["firsttoken_tokens_sent_total"] == len(expected_text(tokens=5))


def test_async_sdk_streams(server: Server) -> None:
    async def run() -> str:
        c = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        async with c.responses.stream(
            model="synthetic", input=QUESTION, extra_body=knobs(answer_tokens=12)
        ) as stream:
            final = await stream.get_final_response()
        await c.close()
        return final.output_text

    assert asyncio.run(run()) == "".join(expected_text(tokens=12))


def test_responses_stream_resumes_by_stream_id() -> None:
    with run_server(
        "--openai-grace-s", "5", "--synthetic-itl-ms", "5", "--synthetic-ttft-ms", "10"
    ) as srv:
        s = RawStream(
            srv.port,
            "POST",
            "/v1/responses",
            {"input": "q", "stream": True, "synthetic": {"answer_tokens": 40}},
        )
        while s.body.count(b"event: response.output_text.delta") < 5:
            s.read_chunk()
        s.close()
        decoder = EventDecoder()
        seen = list(decoder.feed(s.body))
        stream_id, token = s.headers["x-stream-id"], s.headers["x-resume-token"]
        r = httpx.get(
            f"{srv.v1}/streams/{stream_id}/events",
            headers={"Authorization": f"Bearer {token}", "Last-Event-ID": decoder.last_event_id},
            timeout=10,
        )
        rest = list(EventDecoder().feed(r.content))
        assert int(rest[0].id or 0) == int(decoder.last_event_id or 0) + 1
        bodies = [json.loads(e.data) for e in seen + rest]
        assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
        assert [e.event for e in seen + rest] == [b["type"] for b in bodies]
        text = "".join(b["delta"] for b in bodies if b["type"] == "response.output_text.delta")
        expected = "".join(expected_text("user: q", tokens=40))
        assert text == expected
        assert bodies[-1]["type"] == "response.completed"
        assert bodies[-1]["response"]["output"][0]["content"][0]["text"] == expected


def test_relay_forwards_a_chat_body_and_renders_what_vllm_streams() -> None:
    """Through the relay: the upstream gets the Responses request as a Chat Completions
    body, and what a vLLM upstream streams (reasoning, a tool call in fragments, text with
    logprobs and unknown fields) comes back as Responses items."""
    open_ = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0")
    with (
        scripted_upstream() as up,
        run_server("--engine", "openai", *open_, "--upstream", up.url) as relay,
    ):
        c = client(relay)
        with c.responses.stream(
            model="vllm-tools",
            instructions="Be terse.",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Weather here?"},
                        {"type": "input_image", "image_url": "data:image/png;base64,iVBO"},
                    ],
                }
            ],
            tools=TOOLS,
            tool_choice="required",
            max_output_tokens=64,
        ) as stream:
            final = stream.get_final_response()
        sent = up.posts[-1]
        assert sent["messages"] == [
            {"role": "system", "content": "Be terse."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Weather here?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                ],
            },
        ]
        tool = {k: v for k, v in TOOLS[0].items() if k != "type"}
        assert sent["tools"] == [{"type": "function", "function": tool}]
        assert sent["tool_choice"] == "required" and sent["max_completion_tokens"] == 64
        assert sent["stream"] is True and sent["model"] == "vllm-tools"
        assert not {"input", "instructions", "max_output_tokens"} & set(sent)
        reasoning, call = final.output
        assert reasoning.type == "reasoning"
        assert reasoning.content[0].text == "The user wants the weather."
        assert call.type == "function_call" and call.call_id == "chatcmpl-tool-1"
        assert call.arguments == "".join(VLLM_ARGUMENTS)
        assert final.usage is not None  # the upstream's own count, as it sent it
        assert (final.usage.input_tokens, final.usage.output_tokens) == (31, 17)

        events = list(c.responses.create(model="vllm-reasoning", input="hi", stream=True))
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == "Hello world"
        whole = c.responses.create(model="vllm-reasoning", input="hi")
        assert [o.type for o in whole.output] == ["reasoning", "message"]
        assert whole.output_text == "Hello world"
