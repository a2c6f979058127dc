"""What teams do with the official openai SDK, run by whichever interpreter runs this file
against the server at argv[1] (its /v1 URL); prints one JSON object of what came back.

tests/system/test_openai2_sdk.py runs it with the SDK's 2.x line (.venv/openai2, made by
./scripts/test) and with the project's 3.x, and asserts on the same answers. It imports only
the SDK and the standard library: the 2.x venv holds nothing else."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from typing import Any

import openai

MESSAGES = [{"role": "user", "content": "Why does streaming matter?"}]
QUESTION = "What outlives its connection?"
SLOW = {"seed": 7, "synthetic": {"itl_ms": 20, "answer_tokens": 40}}


def chat(client: openai.OpenAI) -> dict[str, Any]:
    whole = client.chat.completions.create(
        model="synthetic", messages=MESSAGES, max_tokens=25, seed=1
    )
    assert whole.usage is not None
    parts, finishes, usage = [], [], None
    for chunk in client.chat.completions.create(
        model="synthetic",
        messages=MESSAGES,
        stream=True,
        max_tokens=40,
        seed=7,
        stream_options={"include_usage": True},
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert usage is not None
    return {
        "whole": whole.choices[0].message.content,
        "whole_finish": whole.choices[0].finish_reason,
        "whole_tokens": whole.usage.completion_tokens,
        "parts": parts,
        "finishes": finishes,
        "tokens": usage.completion_tokens,
    }


def completions(client: openai.OpenAI) -> dict[str, Any]:
    parts = [
        chunk.choices[0].text
        for chunk in client.completions.create(
            model="synthetic", prompt="Once upon a time", stream=True, max_tokens=12, seed=2
        )
        if chunk.choices and chunk.choices[0].text
    ]
    return {"parts": parts}


def responses(client: openai.OpenAI) -> dict[str, Any]:
    whole = client.responses.create(model="synthetic", input=QUESTION, extra_body=SLOW)
    assert whole.usage is not None
    types, deltas, final = [], [], None
    for event in client.responses.create(
        model="synthetic", input=QUESTION, stream=True, extra_body=SLOW
    ):
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            final = event.response.output_text
    return {
        "whole": whole.output_text,
        "whole_status": whole.status,
        "whole_tokens": whole.usage.output_tokens,
        "types": [types[0], types[-1]],
        "deltas": "".join(deltas),
        "final": final,
    }


def helpers(client: openai.OpenAI) -> dict[str, Any]:
    """The SDK's own helpers: `responses.stream()` and the async client."""
    with client.responses.stream(model="synthetic", input=QUESTION, extra_body=SLOW) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response().output_text

    async def streamed() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=str(client.base_url), api_key="unused", max_retries=0
        ) as sdk:
            out = []
            chunks = await sdk.chat.completions.create(
                model="synthetic", messages=MESSAGES, stream=True, max_tokens=20, seed=9
            )
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    out.append(chunk.choices[0].delta.content)
            return out

    return {"stream_final": final, "async_parts": asyncio.run(streamed())}


def resumed(client: openai.OpenAI) -> dict[str, Any]:
    """A background stream dropped after its sixth event (sequence numbers 0-5), read on with
    `retrieve(id, stream=True, starting_after=5)`; then one polled to its end."""
    stream = client.responses.create(
        model="synthetic", input=QUESTION, stream=True, background=True, extra_body=SLOW
    )
    first: list[Any] = []
    for event in stream:
        first.append(event)
        if len(first) == 6:
            break
    stream.close()
    response_id = first[0].response.id
    later = list(client.responses.retrieve(response_id, stream=True, starting_after=5))
    created = client.responses.create(
        model="synthetic", input=QUESTION, background=True, extra_body=SLOW
    )
    polled = client.responses.retrieve(created.id)
    deadline = time.monotonic() + 10
    while polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        polled = client.responses.retrieve(created.id)

    def text(events: list[Any]) -> str:
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")

    return {
        "first_sequence": [e.sequence_number for e in first],
        "later_sequence": [e.sequence_number for e in later],
        "text": text(first) + text(later),
        "last": later[-1].type,
        "final": later[-1].response.output_text,
        "created_status": created.status,
        "polled_status": polled.status,
        "polled_text": polled.output_text,
    }


def cancelled(client: openai.OpenAI) -> dict[str, Any]:
    long = {"seed": 7, "synthetic": {"itl_ms": 20, "answer_tokens": 500}}
    created = client.responses.create(
        model="synthetic", input=QUESTION, background=True, extra_body=long
    )
    time.sleep(0.2)
    answer = client.responses.cancel(created.id)
    return {
        "same_id": answer.id == created.id,
        "status": answer.status,
        "retrieved": client.responses.retrieve(created.id).status,
    }


def embeddings(client: openai.OpenAI) -> dict[str, Any]:
    texts = ["the first token", "arrives soon"]
    packed = client.embeddings.create(model="synthetic", input=texts)  # base64, decoded by it
    floats = client.embeddings.create(model="synthetic", input=texts, encoding_format="float")
    short = client.embeddings.create(model="synthetic", input="x", dimensions=8)
    raw = client.embeddings.create(model="synthetic", input="x", encoding_format="base64")
    return {
        "same": [d.embedding for d in packed.data] == [d.embedding for d in floats.data],
        "indexes": [d.index for d in floats.data],
        "dims": [len(d.embedding) for d in floats.data],
        "first": floats.data[0].embedding[:4],
        "prompt_tokens": floats.usage.prompt_tokens,
        "model": floats.model,
        "short": len(short.data[0].embedding),
        "base64_bytes": len(base64.b64decode(str(raw.data[0].embedding))),
    }


def errors(client: openai.OpenAI) -> dict[str, Any]:
    """A stream that fails after its 200: the SDK raises `APIError` with the event's code."""
    out: dict[str, Any] = {}
    parts: list[str] = []
    try:
        for chunk in client.chat.completions.create(
            model="synthetic",
            messages=MESSAGES,
            stream=True,
            max_tokens=50,
            seed=5,
            extra_body={"synthetic": {"fail_after": 8, "error_code": "engine_overloaded"}},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
    except openai.APIError as exc:
        out["chat"] = {"code": exc.code, "message": exc.message, "parts": parts}
    deltas: list[str] = []
    failed = None
    try:
        for event in client.responses.create(
            model="synthetic",
            input=QUESTION,
            stream=True,
            extra_body={"synthetic": {"fail_after": 8, "error_code": "engine_overloaded"}},
        ):
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.failed":
                failed = event.response.status
    except openai.APIError as exc:
        out["responses"] = {"code": exc.code, "deltas": len(deltas), "failed": failed}
    try:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    except openai.NotFoundError as exc:
        out["unknown_model"] = {"status": exc.status_code, "code": exc.code}
    return out


def main() -> None:
    client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
    calls = (chat, completions, responses, helpers, resumed, cancelled, embeddings, errors)
    results = {call.__name__: call(client) for call in calls}
    print(json.dumps({"sdk": openai.__version__, **results}))


if __name__ == "__main__":
    main()
