"""An OpenAI-style chunk read back as its delta (`firsttoken/formats/chunks.py`): one decoder for
an upstream's chunks (the relay) and a stream's own (a takeover's replay)."""

from __future__ import annotations

import pytest

from firsttoken.delta import Delta, ToolCallDelta
from firsttoken.formats.chunks import BadChunk, chunk_delta


def chat(fields: dict, finish: str | None = None, **choice) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish, **choice}]}


def test_the_usual_chunk_is_its_text_and_the_role_chunk_is_nothing() -> None:
    assert chunk_delta(chat({"content": "Hi"}), chat=True) == (Delta("Hi"), None)
    assert chunk_delta(chat({"role": "assistant", "content": ""}), chat=True) == (None, None)
    assert chunk_delta(chat({}, "stop"), chat=True) == (None, "stop")
    assert chunk_delta({"choices": [], "usage": {"total_tokens": 3}}, chat=True) == (None, None)


def test_everything_a_chunk_carries_comes_back_in_one_delta() -> None:
    logprobs = {"content": [{"token": "Hi", "logprob": -0.1}]}
    fields = {
        "content": "Hi",
        "reasoning_content": "so",
        "refusal": None,
        "tool_calls": [{"index": 1, "id": "c1", "function": {"name": "f", "arguments": "{"}}],
        "annotations": [],
    }
    delta, finish = chunk_delta(chat(fields, logprobs=logprobs), chat=True)
    call = ToolCallDelta(1, "c1", "f", "{")
    expected = Delta("Hi", None, "so", (call,), "", logprobs, {"annotations": []})
    assert (delta, finish) == (expected, None)
    # vLLM's older name for the reasoning text.
    assert chunk_delta(chat({"reasoning": "hm"}), chat=True)[0] == Delta(reasoning="hm")


def test_a_completion_chunk_keeps_its_logprobs() -> None:
    chunk = {"choices": [{"text": "Hi", "logprobs": {"tokens": ["Hi"]}, "finish_reason": None}]}
    assert chunk_delta(chunk, chat=False) == (Delta("Hi", logprobs={"tokens": ["Hi"]}), None)


@pytest.mark.parametrize(
    ("chunk", "is_chat"),
    [
        (chat({"content": 3, "reasoning_content": "x"}), True),
        (chat({"tool_calls": [{"index": "0", "function": {"arguments": ""}}]}), True),
        ({"choices": ["not a choice"]}, True),
        ({"choices": [{"text": 5}]}, False),
    ],
)
def test_a_chunk_of_the_wrong_shape_says_so(chunk: dict, is_chat: bool) -> None:
    with pytest.raises(BadChunk, match="wrong shape"):
        chunk_delta(chunk, chat=is_chat)
