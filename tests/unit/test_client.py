"""The Python client's stream state (sans-IO): what it keeps of each kind of event."""

from __future__ import annotations

import asyncio
import json

import pytest

from firsttoken.client import AsyncAnswer, AsyncClient, StreamError, TextStream


def sse(*events: tuple[int, str | None, object]) -> bytes:
    out = b""
    for seq, name, data in events:
        out += b"id: %d\n" % seq
        if name:
            out += b"event: " + name.encode() + b"\n"
        text = data if isinstance(data, str) else json.dumps(data)
        out += b"data: " + text.encode() + b"\n\n"
    return out


def test_native_reasoning_and_tool_call_are_kept_apart_from_the_text() -> None:
    state = TextStream()
    deltas = state._feed(
        sse(
            (1, None, {"reasoning": "Let me"}),
            (2, None, {"reasoning": " think"}),
            (3, None, {"token": "Calling"}),
            (4, None, {"tool_call": {"index": 0, "id": "c1", "name": "f", "arguments": ""}}),
            (5, None, {"tool_call": {"index": 0, "arguments": '{"a"'}}),
            (6, None, {"tool_call": {"index": 0, "arguments": ": 1}"}}),
            (7, "meta", {"finish_reason": "tool_calls", "usage": {"completion_tokens": 6}}),
            (8, None, "[DONE]"),
        )
    )
    assert deltas == ["Calling"] and state.text == "Calling"
    assert state.reasoning == "Let me think"
    assert state.tool_calls == [{"id": "c1", "name": "f", "arguments": '{"a": 1}'}]
    assert state.finish_reason == "tool_calls" and state.done
    assert state.last_event_id == "8"


def test_chat_chunks_reasoning_tool_calls_and_an_error_keep_the_partial_text() -> None:
    def chunk(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    state = TextStream()
    call = {"index": 0, "id": "c9", "type": "function", "function": {"name": "g", "arguments": ""}}
    state._feed(
        sse(
            (1, None, chunk({"reasoning_content": "hmm"})),
            (2, None, chunk({"content": "Hi"})),
            (3, None, chunk({"tool_calls": [call]})),
            (4, None, chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})),
        )
    )
    assert state.reasoning == "hmm" and state.text == "Hi"
    assert state.tool_calls == [{"id": "c9", "name": "g", "arguments": "{}"}]
    with pytest.raises(StreamError) as info:
        state._feed(sse((5, "error", {"error": {"code": "boom", "message": "no"}})))
    assert info.value.code == "boom" and info.value.text == "Hi"


def test_async_calls_all_await_to_an_answer_without_a_request() -> None:
    """`await client.chat(...)` and `await client.resume(...)` give the answer itself; nothing
    is sent before the first `async for` step (port 9: nothing listens there)."""

    async def run() -> None:
        async with AsyncClient("http://127.0.0.1:9") as client:
            chat = client.chat([{"role": "user", "content": "hi"}], max_tokens=3)
            assert await chat is chat
            resumed = await client.resume("s1", "token", last_event_id="4")
            assert isinstance(resumed, AsyncAnswer)
            assert (resumed.stream_id, resumed.last_event_id) == ("s1", "4")

    asyncio.run(run())


@pytest.mark.parametrize("code", ["http_502", "http_503", "stream_not_found", "store_unavailable"])
def test_a_resume_refused_while_instances_are_replaced_is_tried_again(code: str) -> None:
    """A deploy or a crash: the proxy in front finds no instance for a moment, or the one it
    finds does not know the stream yet. The answer's text is kept and the resume goes again."""
    client = AsyncClient("http://127.0.0.1:9")
    answer = AsyncAnswer(client, None)
    answer.state.stream_id, answer.state.resume_token = "s1", "t"
    assert answer._broken(StreamError(code, "", "")) > 0
    with pytest.raises(StreamError):
        answer._broken(StreamError("invalid_api_key", "", ""))  # the client's own problem
