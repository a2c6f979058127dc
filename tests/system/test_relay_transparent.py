"""The relay is transparent: the upstream gets the client's request as it was sent, and every
field of every upstream chunk reaches the client: tool calls, reasoning, logprobs, usage.

Two upstreams: a scripted one that replays what vLLM streams with its reasoning and tool
parsers on, and another firsttoken (the synthetic engine's `tool_call` and `reasoning_tokens`),
for an agent loop driven by the official `openai` SDK, unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.servers import Server, run_server, wait_for
from tests.upstreams import VLLM_ARGUMENTS, VLLM_USAGE, ScriptedUpstream, scripted_upstream

OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0")
RELAY = ("--engine", "openai", *OPEN)

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# Everything an agent sends: content parts with an image, an assistant's tool call and the
# tool's answer.
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Weather where this photo was taken?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        ],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "locate", "arguments": '{"photo": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Paris"},
]


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedUpstream, Server]]:
    with scripted_upstream() as up, run_server(*RELAY, "--upstream", up.url) as relay:
        yield up, relay


@pytest.fixture(scope="module")
def chain() -> Iterator[Server]:
    with ExitStack() as stack:
        upstream = stack.enter_context(
            run_server("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1", *OPEN)
        )
        yield stack.enter_context(run_server(*RELAY, "--upstream", upstream.v1))


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=30)


def test_upstream_gets_the_request_as_sent(scripted: tuple[ScriptedUpstream, Server]) -> None:
    up, relay = scripted
    sent = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "response_format": {"type": "text"},
        "max_completion_tokens": 64,
        "logprobs": True,
        "top_logprobs": 2,
        "user": "agent-7",
    }
    stream = client(relay).chat.completions.create(
        model="vllm-tools",
        stream=True,
        stream_options={"include_usage": False},
        **sent,
    )
    list(stream)
    posted = up.posts[-1]
    for field, value in sent.items():
        assert posted[field] == value, field
    # What the gateway changes: streaming on, usage on.
    assert posted["stream"] is True
    assert posted["stream_options"] == {"include_usage": True}
    assert posted["model"] == "vllm-tools"


def test_vllm_tool_call_and_reasoning_reach_the_client(
    scripted: tuple[ScriptedUpstream, Server],
) -> None:
    _, relay = scripted
    stream = client(relay).chat.completions.create(
        model="vllm-tools",
        messages=MESSAGES,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    reasoning: list[str] = []
    fragments: list[str] = []
    names: list[str] = []
    ids: list[str] = []
    finish = None
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            extra = delta.model_extra or {}
            if extra.get("reasoning_content"):
                reasoning.append(extra["reasoning_content"])
            for call in delta.tool_calls or ():
                assert call.index == 0
                if call.id:
                    ids.append(call.id)
                if call.function and call.function.name:
                    names.append(call.function.name)
                if call.function and call.function.arguments:
                    fragments.append(call.function.arguments)
            finish = choice.finish_reason or finish
    assert "".join(reasoning) == "The user wants the weather."
    assert ids == ["chatcmpl-tool-1"] and names == ["get_weather"]
    assert fragments == VLLM_ARGUMENTS  # fragment by fragment, as the upstream sent them
    assert json.loads("".join(fragments)) == {"city": "Paris", "unit": "c"}
    assert finish == "tool_calls"
    assert usage is not None and usage.completion_tokens == VLLM_USAGE["completion_tokens"]
    assert usage.prompt_tokens == VLLM_USAGE["prompt_tokens"]


def test_stream_helper_reassembles_the_tool_call(
    scripted: tuple[ScriptedUpstream, Server],
) -> None:
    _, relay = scripted
    with client(relay).chat.completions.stream(
        model="vllm-tools", messages=MESSAGES, tools=TOOLS
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    assert "tool_calls.function.arguments.done" in kinds
    call = final.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}  # type: ignore[union-attr]
    assert final.choices[0].finish_reason == "tool_calls"


def test_logprobs_and_unknown_delta_fields_pass_through(
    scripted: tuple[ScriptedUpstream, Server],
) -> None:
    _, relay = scripted
    chunks = list(
        client(relay).chat.completions.create(
            model="vllm-reasoning", messages=MESSAGES, stream=True, logprobs=True
        )
    )
    deltas = [c.choices[0] for c in chunks if c.choices]
    text = "".join(d.delta.content or "" for d in deltas)
    assert text == "Hello world"
    hello = next(d for d in deltas if d.delta.content == "Hello")
    assert hello.logprobs is not None and hello.logprobs.content[0].logprob == -0.1  # type: ignore[index]
    world = next(d for d in deltas if d.delta.content == " world")
    assert (world.delta.model_extra or {}).get("annotations") == []


def test_a_whole_answer_keeps_the_upstreams_logprobs(
    scripted: tuple[ScriptedUpstream, Server],
) -> None:
    _, relay = scripted
    answer = client(relay).chat.completions.create(
        model="vllm-reasoning", messages=MESSAGES, logprobs=True
    )
    assert answer.choices[0].message.content == "Hello world"
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [(t.token, t.logprob) for t in logprobs.content] == [("Hello", -0.1)]


def test_whole_answer_through_the_relay_keeps_tool_calls(
    scripted: tuple[ScriptedUpstream, Server],
) -> None:
    _, relay = scripted
    answer = client(relay).chat.completions.create(
        model="vllm-tools", messages=MESSAGES, tools=TOOLS
    )
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert (message.model_extra or {}).get("reasoning_content") == "The user wants the weather."
    call = message.tool_calls[0]  # type: ignore[index]
    assert call.id == "chatcmpl-tool-1"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}  # type: ignore[union-attr]
    assert answer.usage is not None and answer.usage.total_tokens == VLLM_USAGE["total_tokens"]


@pytest.fixture(scope="module")
def direct() -> Iterator[Server]:
    with run_server("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1", *OPEN) as server:
        yield server


@pytest.mark.parametrize("path", ["direct", "chain"])
def test_agent_loop(path: str, request: pytest.FixtureRequest) -> None:
    """tool call → tool result → final answer, streaming, reasoning first: every fragment
    from the synthetic engine (directly, and relayed from another firsttoken) reassembled by
    the SDK exactly."""
    api = client(request.getfixturevalue(path))
    arguments = {"city": "Zürich", "days": [1, 2], "detail": {"wind": True}}
    messages: list[Any] = [{"role": "user", "content": "What's the weather in Zürich?"}]
    with api.chat.completions.stream(
        model="synthetic",
        messages=messages,
        tools=TOOLS,
        extra_body={
            "synthetic": {
                "reasoning_tokens": 8,
                "tool_call": {"name": "get_weather", "arguments": arguments},
            }
        },
    ) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        first = stream.get_final_completion()
    assert len(deltas) > 3  # the arguments arrived in fragments
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert len((message.model_extra or {}).get("reasoning_content", "")) > 0
    call = message.tool_calls[0]  # type: ignore[index]
    assert json.loads(call.function.arguments) == arguments  # type: ignore[union-attr]
    assert first.usage is None or first.usage.completion_tokens_details is not None

    messages += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 °C"},
    ]
    text: list[str] = []
    with api.chat.completions.stream(model="synthetic", messages=messages, tools=TOOLS) as stream:
        for event in stream:
            if event.type == "content.delta":
                text.append(event.delta)
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "".join(text) and len(text) > 100
    assert final.choices[0].finish_reason == "stop"


# -- what the gateway decides, not the client (issue 37.3 and 37.4) ---------------------------

KEYS = """
[[keys]]
name = "lena"
key = "sk-lena"

[[keys]]
name = "mo"
key = "sk-mo"
tokens_per_minute = 1000
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ScriptedUpstream, Server]]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    with (
        scripted_upstream() as up,
        run_server(*RELAY, "--upstream", up.url, "--api-keys", str(keys)) as relay,
    ):
        yield up, relay


def billed(server: Server, key: str) -> float:
    """The completion tokens billed to `key`, once its last stream's ticket is released."""
    name = f'firsttoken_key_tokens_total{{key="{key}",kind="completion"}}'
    wait_for(lambda: server.metric(name) > 0, timeout=5)
    time.sleep(0.2)  # a ticket is released just after the answer's last byte
    return server.metric(name)


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_the_upstream_gets_the_limit_that_was_admitted(
    keyed: tuple[ScriptedUpstream, Server], path: str
) -> None:
    # max_tokens 1 was admitted (the smaller of the two), max_completion_tokens 5,000 went
    # upstream as sent, and a vLLM upstream (max_completion_tokens wins) wrote and billed
    # 5,000. A client's `priority` reached vLLM's scheduler: -1000 jumped every other key.
    up, relay = keyed
    chat = path == "/chat/completions"
    body: dict[str, Any] = {"model": "vllm-limit", "max_tokens": 1}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    body |= {"max_completion_tokens": 5000, "priority": -1000, "best_of": 4, "top_k": 5}
    before = relay.metric('firsttoken_key_tokens_total{key="lena",kind="completion"}')
    r = httpx.post(
        relay.v1 + path, json=body, headers={"authorization": "Bearer sk-lena"}, timeout=30
    )
    assert r.status_code == 200, r.text
    posted = up.posts[-1]
    assert (posted["max_tokens"], posted["max_completion_tokens"]) == (1, 1)
    assert "priority" not in posted and "best_of" not in posted
    assert posted["top_k"] == 5  # sampling fields still pass as sent
    assert r.json()["usage"]["completion_tokens"] == 1
    assert billed(relay, "lena") - before == 1  # was 5,000


def test_a_request_never_takes_more_than_its_keys_minute_has_left(
    keyed: tuple[ScriptedUpstream, Server],
) -> None:
    # mo has 1,000 tokens a minute and asks for 100,000: it was admitted as asked, and
    # 100,005 tokens were billed; then it was lowered to what was left, unseen. Now a limit
    # it names that cannot fit is refused, and an answer that names none may take what is
    # left of the minute.
    up, relay = keyed
    if (left := 60 - time.time() % 60) < 10:
        time.sleep(left + 0.5)  # don't straddle the minute the budget counts in
    never = httpx.post(
        relay.v1 + "/completions",
        json={"model": "vllm-limit", "prompt": "hi", "max_tokens": 100_000},
        headers={"authorization": "Bearer sk-mo"},
        timeout=30,
    )
    assert never.status_code == 400, never.text
    assert never.json()["error"]["param"] == "max_tokens"
    r = httpx.post(
        relay.v1 + "/completions",
        json={"model": "vllm-limit", "prompt": "hi"},
        headers={"authorization": "Bearer sk-mo"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    limit = up.posts[-1]["max_tokens"]
    assert 990 <= limit < 1000  # what the prompt left of 1,000
    assert billed(relay, "mo") == limit
    refused = httpx.post(
        relay.v1 + "/completions",
        json={"model": "vllm-limit", "prompt": "hi", "max_tokens": 1},
        headers={"authorization": "Bearer sk-mo"},
        timeout=30,
    )
    assert refused.status_code == 429 and "retry-after" in refused.headers
    assert refused.json()["error"]["code"] == "token_budget_exceeded"


def test_a_messages_document_reaches_an_openai_target_as_a_file_part(
    scripted: tuple[ScriptedUpstream, Server],
) -> None:
    up, relay = scripted
    pdf = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}
    content: list[Any] = [
        {"type": "document", "source": pdf, "title": "report.pdf"},
        {"type": "document", "source": {"type": "text", "data": "Plain notes."}},
        {"type": "text", "text": "Sum them up."},
    ]
    messages = anthropic.Anthropic(base_url=relay.url, api_key="unused", max_retries=0)
    answer = messages.messages.create(
        model="ok", max_tokens=20, messages=[{"role": "user", "content": content}]
    )
    assert answer.stop_reason == "end_turn"
    sent = up.posts[-1]["messages"][-1]["content"]
    assert sent == [
        {
            "type": "file",
            "file": {"file_data": "data:application/pdf;base64,JVBERi0x", "filename": "report.pdf"},
        },
        {"type": "text", "text": "Plain notes."},
        {"type": "text", "text": "Sum them up."},
    ]
    by_url = {"type": "document", "source": {"type": "url", "url": "https://x.test/a.pdf"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages.messages.create(
            model="ok", max_tokens=20, messages=[{"role": "user", "content": [by_url]}]
        )
    assert "by URL" in str(refused.value)


def test_responses_include_logprobs_carries_the_upstreams(
    scripted: tuple[ScriptedUpstream, Server],
) -> None:
    up, relay = scripted
    include: Any = ["message.output_text.logprobs"]
    events = list(
        client(relay).responses.create(
            model="vllm-reasoning", input="Say hello", include=include, stream=True
        )
    )
    assert up.posts[-1]["logprobs"] is True
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    hello = next(d for d in deltas if d.delta == "Hello")
    assert [(lp.token, lp.logprob) for lp in hello.logprobs] == [("Hello", -0.1)]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == ["Hello"]
    final = events[-1].response  # type: ignore[union-attr]
    (text,) = [c for item in final.output if item.type == "message" for c in item.content]
    assert [lp.token for lp in text.logprobs] == ["Hello"]  # type: ignore[union-attr]
    whole = client(relay).responses.create(model="vllm-reasoning", input="Say hi", include=include)
    (part,) = [c for item in whole.output if item.type == "message" for c in item.content]
    assert [lp.token for lp in part.logprobs] == ["Hello"]  # type: ignore[union-attr]
