"""The synthetic engine continues its own answers as vLLM does (`continue_final_message`) and
as Anthropic does (a prefill): a cut answer's text, sent back as the final assistant message,
is continued into exactly the answer an uninterrupted request gets. Official SDKs, real
servers: plain, batching, and a relay in front of a plain one (which must pass the fields)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.servers import Server, run_server

OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0")
FAST = ("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1", *OPEN)
BATCHING = ("--batch-max", "8", "--batch-timeout-ms", "1", "--batch-step-base-ms", "1", *OPEN)
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
QUESTION: list[Any] = [{"role": "user", "content": "Tell me about streams."}]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    with ExitStack() as stack:
        plain = stack.enter_context(run_server(*FAST))
        batching = stack.enter_context(run_server(*BATCHING))
        relay = stack.enter_context(run_server("--engine", "openai", "--upstream", plain.v1, *OPEN))
        yield {"plain": plain, "batching": batching, "relay": relay}


@dataclass
class Answer:
    text: list[str]  # content deltas, one per token
    reasoning: list[str]
    finish: str | None
    usage: Any


def chat(server: Server, messages: list[Any], max_tokens: int, **extra: Any) -> Answer:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="synthetic",
        messages=messages,
        max_tokens=max_tokens,
        seed=11,
        stream=True,
        stream_options={"include_usage": True, "coalesce": "off"},  # type: ignore[typeddict-unknown-key]
        extra_body=extra or None,
    )
    answer = Answer([], [], None, None)
    for chunk in stream:
        answer.usage = chunk.usage or answer.usage
        for choice in chunk.choices:
            if choice.delta.content:
                answer.text.append(choice.delta.content)
            reasoning = getattr(choice.delta, "reasoning_content", None)
            if reasoning:
                answer.reasoning.append(reasoning)
            answer.finish = choice.finish_reason or answer.finish
    return answer


@pytest.mark.parametrize("kind", ["plain", "batching", "relay"])
@pytest.mark.parametrize("knobs", [{}, {"style": "markdown"}, {"reasoning_tokens": 8}])
def test_a_continued_answer_is_the_uninterrupted_one(
    kind: str, knobs: dict[str, Any], servers: dict[str, Server]
) -> None:
    server = servers[kind]
    extra = {"synthetic": knobs} if knobs else {}
    limit = 70
    full = chat(server, QUESTION, limit, **extra)
    thinking = len(full.reasoning)
    assert thinking == knobs.get("reasoning_tokens", 0) and full.finish == "length"
    assert len(full.text) == limit - thinking
    for k in (0, 1, 13, len(full.text) - 1):
        prefix = "".join(full.text[:k])
        messages = [*QUESTION, {"role": "assistant", "content": prefix}]
        # The cut answer had `thinking + k` tokens; max_tokens counts what remains.
        rest = chat(server, messages, limit - thinking - k, **extra, **CONTINUE)
        assert prefix + "".join(rest.text) == "".join(full.text), k
        assert rest.text == full.text[k:] and rest.reasoning == []  # reasoning not repeated
        assert rest.finish == full.finish
        # As vLLM counts it: the prefix is prompt, the completion only what came now.
        assert rest.usage.prompt_tokens == full.usage.prompt_tokens + k
        assert rest.usage.completion_tokens == limit - thinking - k
        assert rest.usage.total_tokens == rest.usage.prompt_tokens + rest.usage.completion_tokens


def test_a_whole_answer_continues_too(servers: dict[str, Server]) -> None:
    client = openai.OpenAI(base_url=servers["plain"].v1, api_key="unused", max_retries=0)
    full = client.chat.completions.create(model="synthetic", messages=QUESTION, seed=3)
    text = full.choices[0].message.content or ""
    assert full.choices[0].finish_reason == "stop" and len(text) > 200
    cut = text[: text.index(" ", 40)]  # word starts are token starts in prose
    rest = client.chat.completions.create(
        model="synthetic",
        messages=[*QUESTION, {"role": "assistant", "content": cut}],
        seed=3,
        extra_body=CONTINUE,
    )
    assert cut + (rest.choices[0].message.content or "") == text
    assert rest.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kind", ["plain", "batching"])
def test_a_text_that_does_not_start_the_answer_is_a_400(
    kind: str, servers: dict[str, Server]
) -> None:
    server = servers[kind]
    full = chat(server, QUESTION, 30)
    long_token = next(i for i, t in enumerate(full.text) if i > 2 and len(t.strip()) >= 3)
    refused = [
        "Something else entirely",
        "".join(full.text[:long_token]) + full.text[long_token][:2],  # mid-token
        "".join(full.text[:5]).upper(),
    ]
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    for prefix in refused:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="synthetic",
                messages=[*QUESTION, {"role": "assistant", "content": prefix}],
                max_tokens=10,
                seed=11,
                stream=True,
                extra_body=CONTINUE,
            )
        error = info.value.body
        assert isinstance(error, dict)
        assert error["code"] == "invalid_continuation" and error["param"] == "messages"
    # Before the first byte: a JSON error, not an event stream.
    response = httpx.post(
        server.v1 + "/chat/completions",
        json={
            "model": "synthetic",
            "messages": [*QUESTION, {"role": "assistant", "content": "Nope"}],
            "stream": True,
            **CONTINUE,
        },
    )
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] == "invalid_continuation"


def complete(server: Server, prompt: str, max_tokens: int, **extra: Any) -> Answer:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="synthetic",
        prompt=prompt,
        max_tokens=max_tokens,
        seed=11,
        stream=True,
        stream_options={"include_usage": True, "coalesce": "off"},  # type: ignore[typeddict-unknown-key]
        extra_body=extra or None,
    )
    answer = Answer([], [], None, None)
    for chunk in stream:
        answer.usage = chunk.usage or answer.usage
        for choice in chunk.choices:
            if choice.text:
                answer.text.append(choice.text)
            answer.finish = choice.finish_reason or answer.finish
    return answer


@pytest.mark.parametrize("kind", ["plain", "batching", "relay"])
def test_a_completion_whose_prompt_ends_with_its_answers_start_continues_it(
    kind: str, servers: dict[str, Server]
) -> None:
    # What a route's splice sends a firsttoken upstream for a native stream or a
    # completion: the prompt grown by the text sent, and `continue_final_text` naming it.
    server = servers[kind]
    prompt, limit = "Tell me about streams.", 60
    full = complete(server, prompt, limit)
    assert full.finish == "length" and len(full.text) == limit
    for k in (1, 13, limit - 1):
        sent = "".join(full.text[:k])
        rest = complete(server, prompt + sent, limit - k, continue_final_text=sent)
        assert rest.text == full.text[k:] and rest.finish == full.finish, k
        # As a continued chat counts it: the text continued is prompt.
        assert rest.usage.prompt_tokens == full.usage.prompt_tokens + k
        assert rest.usage.completion_tokens == limit - k
    # Another text is refused, never continued: before the first byte, naming the field
    # (through a relay, the upstream's refusal comes after its 200, as an error event).
    response = httpx.post(
        server.v1 + "/completions",
        json={
            "model": "synthetic",
            "prompt": prompt + " Not the answer",
            "continue_final_text": " Not the answer",
            "stream": True,
        },
    )
    if kind == "relay":
        assert "event: error" in response.text and "cannot continue" in response.text
        return
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_continuation", "continue_final_text")


def test_continue_final_message_asks_for_an_assistant_message_and_no_new_turn(
    servers: dict[str, Server],
) -> None:
    url = servers["plain"].v1 + "/chat/completions"
    assistant = [*QUESTION, {"role": "assistant", "content": ""}]
    for body in (
        {"messages": QUESTION, **CONTINUE},  # the last message is the user's
        {"messages": assistant, "continue_final_message": True},  # a new turn too
    ):
        response = httpx.post(url, json={"model": "synthetic", **body})
        assert response.status_code == 400, body
        assert "continue_final_message" in response.json()["error"]["message"]


def anthropic_text(client: anthropic.Anthropic, messages: list[Any], max_tokens: int) -> Any:
    with client.messages.stream(
        model="synthetic", max_tokens=max_tokens, messages=messages
    ) as stream:
        text = list(stream.text_stream)
        return text, stream.get_final_message()


@pytest.mark.parametrize("kind", ["plain", "batching"])
def test_an_anthropic_prefill_continues_the_answer(kind: str, servers: dict[str, Server]) -> None:
    client = anthropic.Anthropic(base_url=servers[kind].url, api_key="unused", max_retries=0)
    full, message = anthropic_text(client, QUESTION, 50)
    assert message.stop_reason == "max_tokens" and len(full) == 50
    for k in (1, 20, 49):
        prefill = "".join(full[:k])
        messages = [*QUESTION, {"role": "assistant", "content": prefill}]
        rest, continued = anthropic_text(client, messages, 50 - k)
        # The response holds only the continuation.
        assert prefill + "".join(rest) == "".join(full) and rest == full[k:]
        assert continued.stop_reason == "max_tokens"
        assert continued.usage.output_tokens == 50 - k
        assert continued.usage.input_tokens == message.usage.input_tokens + k
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="synthetic",
            max_tokens=5,
            messages=[*QUESTION, {"role": "assistant", "content": "Not my answer"}],
        )
    assert "cannot continue" in str(info.value)


def test_knobs_past_their_bounds_are_refused(servers: dict[str, Server]) -> None:
    url = servers["plain"].v1 + "/chat/completions"
    for knob in ("answer_tokens", "reasoning_tokens"):
        body = {"model": "synthetic", "messages": QUESTION, "synthetic": {knob: 100_001}}
        response = httpx.post(url, json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == f"synthetic.{knob}"
    body = {"model": "synthetic", "messages": QUESTION, "max_tokens": 1}
    body["synthetic"] = {"answer_tokens": 100_000}
    assert httpx.post(url, json=body).json()["choices"][0]["finish_reason"] == "length"
