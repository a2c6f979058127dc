"""An agent loop — reasoning, a tool call, the tool's result, the final answer — streamed with
each official SDK, against the synthetic engine directly and through the relay (a firsttoken
relay in front of another firsttoken): the Anthropic and Responses requests are translated to
Chat Completions on the way up, and their events rendered back from the relayed chunks. And
the OpenAI Agents SDK's own loop, which sends the same `tool_call` knob on every turn: the
engine answers the tool's result in text, so the run ends after two turns."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import agents
import anthropic
import openai
import pytest

from tests.servers import Server, run_server

OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0")
FAST = ("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1", *OPEN)
ARGUMENTS = {"city": "Zürich", "days": [1, 2], "detail": {"wind": True, "note": 'a "quoted"'}}
KNOBS = {"reasoning_tokens": 12, "tool_call": {"name": "get_weather", "arguments": ARGUMENTS}}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "array"}},
    "required": ["city"],
}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    with ExitStack() as stack:
        direct = stack.enter_context(run_server(*FAST))
        relay = stack.enter_context(
            run_server("--engine", "openai", "--upstream", direct.v1, *OPEN)
        )
        yield {"direct": direct, "relay": relay}


@pytest.mark.parametrize("path", ["direct", "relay"])
def test_anthropic_agent_loop(path: str, servers: dict[str, Server]) -> None:
    server = servers[path]
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools: Any = [{"name": "get_weather", "description": "weather", "input_schema": SCHEMA}]
    messages: list[Any] = [{"role": "user", "content": "Weather in Zürich?"}]
    with client.messages.stream(
        model="synthetic",
        max_tokens=400,
        messages=messages,
        tools=tools,
        extra_body={"synthetic": KNOBS},
    ) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    assert kinds.count("input_json") > 3  # the arguments arrived in fragments
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    thinking, call = first.content
    assert thinking.type == "thinking" and thinking.thinking
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == ARGUMENTS
    assert first.stop_reason == "tool_use"

    messages += [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    with client.messages.stream(
        model="synthetic", max_tokens=400, messages=messages, tools=tools
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert len(text) > 100 and final.stop_reason == "end_turn"
    assert [block.type for block in final.content] == ["text"]
    assert final.content[0].text == text  # type: ignore[union-attr]


@pytest.mark.parametrize("path", ["direct", "relay"])
def test_responses_agent_loop(path: str, servers: dict[str, Server]) -> None:
    server = servers[path]
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    items: list[Any] = [{"role": "user", "content": "Weather in Zürich?"}]
    with client.responses.stream(
        model="synthetic", input=items, tools=tools, extra_body={"synthetic": KNOBS}
    ) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") > 3
    assert "response.reasoning_text.delta" in kinds
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == ARGUMENTS

    items += [
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
    ]
    text: list[str] = []
    with client.responses.stream(model="synthetic", input=items, tools=tools) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                text.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(text)
    assert len(final.output_text) > 100


AGENT_CALL = {"name": "get_weather", "arguments": {"city": "Zürich"}}


@pytest.mark.parametrize("path", ["direct", "relay"])
@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_an_agents_sdk_run_ends_once_the_tool_answered(
    kind: str, path: str, servers: dict[str, Server]
) -> None:
    agents.set_tracing_disabled(True)  # nothing leaves for OpenAI's trace exporter
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}, 21 C"

    client = openai.AsyncOpenAI(base_url=servers[path].v1, api_key="unused", max_retries=0)
    model: agents.Model
    if kind == "responses":
        model = agents.OpenAIResponsesModel(model="synthetic", openai_client=client)
    else:
        model = agents.OpenAIChatCompletionsModel(model="synthetic", openai_client=client)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=model,
        # The same settings, knob included, go with every turn of the loop.
        model_settings=agents.ModelSettings(
            extra_body={"synthetic": {**KNOBS, "tool_call": AGENT_CALL}}
        ),
    )

    async def run() -> tuple[Any, list[str]]:
        result = agents.Runner.run_streamed(agent, input="Weather in Zürich?", max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert calls == ["Zürich"]  # called once, by the first turn
    assert "raw_response_event" in kinds  # streamed
    assert isinstance(result.final_output, str) and len(result.final_output) > 100
    assert result.current_turn == 2
    items = [item.type for item in result.new_items]
    assert items.count("tool_call_item") == 1 and items.count("tool_call_output_item") == 1
    assert items[-1] == "message_output_item"
