"""The Python client's stream state (sans-IO): what it keeps of each kind of event."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from firsttoken.client import (
    AsyncAnswer,
    AsyncClient,
    Client,
    StreamError,
    StreamInterrupted,
    TextStream,
)
from tests.unit import virtual_loop


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


@pytest.mark.parametrize(
    "code", ["http_502", "http_503", "stream_not_found", "store_unavailable", "server_draining"]
)
def test_a_resume_refused_while_instances_are_replaced_is_tried_again(code: str) -> None:
    """A deploy or a crash: the proxy in front finds no instance for a moment, or the one it
    finds does not know the stream yet. The answer's text is kept and the resume goes again."""
    client = AsyncClient("http://127.0.0.1:9")
    answer = AsyncAnswer(client, None)
    answer.state.stream_id, answer.state.resume_token = "s1", "t"
    assert answer._broken(StreamError(code, "", "")) > 0
    with pytest.raises(StreamError):
        answer._broken(StreamError("invalid_api_key", "", ""))  # the client's own problem


# -- a create refused before its first byte (fake clock: `virtual_loop`) --------------------

CHAT_URL = "http://gw/v1/chat/completions"


def refused(code: str = "server_draining", retry_after: str | None = "5", status: int = 503):
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    body = {"error": {"code": code, "message": "refused", "type": "server_error"}}
    return httpx.Response(status, json=body, headers=headers)


def chat_stream(*words: str, done: bool = True, stream_id: str | None = "s1") -> httpx.Response:
    chunks = [
        (i + 1, None, {"choices": [{"index": 0, "delta": {"content": w}}]})
        for i, w in enumerate(words)
    ]
    if done:
        chunks.append((len(chunks) + 1, None, "[DONE]"))
    headers = {"content-type": "text/event-stream"}
    if stream_id is not None:
        headers |= {"x-stream-id": stream_id, "x-resume-token": "tok"}
    return events(sse(*chunks), headers)


def events(body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    """A 200 event stream, read as it arrives (not a body read whole beforehand)."""
    headers = {"content-type": "text/event-stream", **(headers or {})}
    return httpx.Response(200, stream=httpx.ByteStream(body), headers=headers)


class Scripted:
    """The server's answers, in order, for an httpx transport; every request it was sent."""

    def __init__(self, *answers: httpx.Response) -> None:
        self.answers = list(answers)
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return self.answers.pop(0)

    def sent(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.seen]


def async_client(script: Scripted, **options: object) -> AsyncClient:
    client = AsyncClient("http://gw", **options)  # type: ignore[arg-type]
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(script))
    return client


async def read_chat(client: AsyncClient) -> tuple[str, float]:
    """The answer's text and the (virtual) seconds it took."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    answer = await client.chat([{"role": "user", "content": "hi"}])
    text = "".join([d async for d in answer])
    return text, loop.time() - started


def test_a_create_refused_with_503_is_sent_again_after_its_retry_after() -> None:
    script = Scripted(
        refused("server_draining", "5"), refused("overloaded", "3"), chat_stream("Hi", " there")
    )

    async def body() -> None:
        text, took = await read_chat(async_client(script))
        assert text == "Hi there"
        assert took == 8.0  # 5 s, then 3 s: each refusal's own Retry-After

    virtual_loop.run(body())
    assert script.sent() == ["POST /v1/chat/completions"] * 3


def test_a_refused_create_without_retry_after_waits_the_client_s_backoff() -> None:
    script = Scripted(refused(retry_after=None), refused(retry_after=None), chat_stream("ok"))

    async def body() -> None:
        text, took = await read_chat(async_client(script, backoff_s=0.25))
        assert (text, took) == ("ok", 0.75)  # 0.25 s, then 0.5 s

    virtual_loop.run(body())


def test_refused_creates_are_sent_again_at_most_create_retries_times() -> None:
    script = Scripted(*(refused("overloaded", "2") for _ in range(4)))

    async def body() -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(StreamError) as info:
            await read_chat(async_client(script, create_retries=2))
        assert (info.value.code, info.value.status, info.value.retry_after_s) == (
            "overloaded",
            503,
            2.0,
        )
        assert loop.time() - started == 4.0

    virtual_loop.run(body())
    assert len(script.seen) == 3  # the first and two more; the fourth answer is never asked


@pytest.mark.parametrize(
    "answer",
    [
        refused("rate_limited", "1", status=429),  # the key's own limit: not another instance's
        refused("server_draining", "120"),  # past max_retry_after_s (60): given up, not slept
        refused("invalid_request_error", None, status=400),
    ],
    ids=["429", "retry_after_too_long", "400"],
)
def test_other_refusals_are_not_sent_again(answer: httpx.Response) -> None:
    script = Scripted(answer, chat_stream("never"))

    async def body() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(StreamError):
            await read_chat(async_client(script))
        assert loop.time() == virtual_loop.START  # no wait at all

    virtual_loop.run(body())
    assert len(script.seen) == 1


def test_nothing_is_created_again_after_the_200() -> None:
    """Once the stream answered 200, an error event or a cut never sends the create again:
    the stream exists, and a break resumes it (GET with Last-Event-ID) or ends the answer."""
    overloaded = sse(
        (1, None, {"choices": [{"index": 0, "delta": {"content": "a"}}]}),
        (2, "error", {"error": {"code": "overloaded", "message": "shed"}}),
    )
    script = Scripted(
        events(overloaded, {"x-stream-id": "s1"}),
        chat_stream("b", stream_id=None, done=False),  # cut, and no id to resume with
        chat_stream("c", done=False),  # cut: resumed by id, never created again
        refused("server_draining", "1"),  # the resume refused by a draining instance
        chat_stream("d"),
    )

    async def body() -> None:
        client = async_client(script)
        with pytest.raises(StreamError) as info:
            await read_chat(client)
        assert info.value.code == "overloaded" and info.value.text == "a"
        with pytest.raises(StreamInterrupted):
            await read_chat(client)
        text, _ = await read_chat(client)
        assert text == "cd"

    virtual_loop.run(body())
    assert script.sent() == [
        "POST /v1/chat/completions",
        "POST /v1/chat/completions",
        "POST /v1/chat/completions",
        "GET /v1/streams/s1/events",
        "GET /v1/streams/s1/events",
    ]


def test_a_native_create_refused_with_503_is_sent_again_after_its_retry_after() -> None:
    native = sse((1, None, {"token": "x"}), (2, None, "[DONE]"))
    script = Scripted(
        refused("server_draining", "5"),
        httpx.Response(200, json={"id": "s9", "resume_token": "tok"}),
        events(native),
    )

    async def body() -> None:
        loop = asyncio.get_running_loop()
        answer = await async_client(script).stream("hi")
        assert loop.time() - virtual_loop.START == 5.0
        assert "".join([d async for d in answer]) == "x"

    virtual_loop.run(body())
    assert script.sent() == ["POST /v1/streams", "POST /v1/streams", "GET /v1/streams/s9/events"]


def test_the_sync_client_waits_the_same_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    script = Scripted(
        refused("overloaded", "3"),
        chat_stream("Hi"),
        refused("overloaded", "4"),
        httpx.Response(200, json={"id": "s2", "resume_token": "tok"}),
        events(sse((1, None, {"token": "y"}), (2, None, "[DONE]"))),
    )
    with Client("http://gw") as client:
        client._http = httpx.Client(transport=httpx.MockTransport(script))
        assert "".join(client.chat([{"role": "user", "content": "hi"}])) == "Hi"
        assert "".join(client.stream("hi")) == "y"
    assert slept == [3.0, 4.0]
