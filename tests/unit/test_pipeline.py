"""The request pipeline (`api/pipeline.py`) on virtual time: every format's request from its
head to its writer or its fold, through the real gateway and the synthetic engine (200 ms to
a first token, 20 ms between tokens: no real time passes), read over the ASGI transport."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response

from firsttoken.api.anthropic import MESSAGES
from firsttoken.api.native import STREAMS
from firsttoken.api.openai import CHAT, COMPLETIONS
from firsttoken.api.pipeline import Format, serve
from firsttoken.api.responses import RESPONSES
from firsttoken.app import create_app
from firsttoken.config import Settings
from firsttoken.formats.sse import EventDecoder
from tests.unit.virtual_loop import run

Sent = list[dict[str, Any]]


def _request(app: Any, path: str, body: bytes, headers: dict[str, str]) -> Request:
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays until the answer is written
        return {"type": "http.disconnect"}

    raw_headers = [(b"content-type", b"application/json")]
    raw_headers += [(k.encode(), v.encode()) for k, v in headers.items()]
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": raw_headers,
        "query_string": b"",
        "app": app,
    }
    return Request(scope, receive)


async def _answer(
    format: Format[Any], body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes, Any]:
    """Serve one request on a fresh app; the status, headers and body as the client reads
    them (an event stream read to its end), and the app's gateway."""
    app = create_app(Settings())
    gw = app.state.gateway
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    request = _request(app, "/v1/x", raw, headers or {})
    sent: Sent = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await gw.engine.start()
    async with anyio.create_task_group() as tg:
        await tg.start(gw.registry.run)
        response: Response | Callable[..., Awaitable[None]] = await serve(request, format)
        await response(request.scope, request.receive, send)  # type: ignore[call-arg]
        tg.cancel_scope.cancel()
    await gw.engine.close()
    start = sent[0]
    headers_out = {k.decode(): v.decode() for k, v in start["headers"]}
    data = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], headers_out, data, gw


def _events(data: bytes) -> list[tuple[str | None, str]]:
    return [(e.event, e.data or "") for e in EventDecoder().feed(data)]


CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_a_streamed_chat_answer_is_written_from_head_to_done() -> None:
    status, headers, data, _ = run(_answer(CHAT, {**CHAT_BODY, "stream": True}))
    assert status == 200
    assert headers["content-type"] == "text/event-stream"
    assert headers["x-resume-token"] and headers["x-stream-id"] and headers["x-request-id"]
    events = _events(data)
    assert events[-1] == (None, "[DONE]")
    chunks = [orjson.loads(d) for _, d in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) == 3


def test_a_whole_chat_answer_is_folded_into_one_body_with_usage() -> None:
    status, headers, data, gw = run(_answer(CHAT, CHAT_BODY))
    assert status == 200
    assert headers["x-stream-id"] and headers["x-request-id"]
    answer = orjson.loads(data)
    assert answer["object"] == "chat.completion"
    assert answer["id"] == "chatcmpl-" + headers["x-stream-id"]
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == 3
    assert gw.metrics.active_streams == 0  # its stream ended with the fold


def test_a_whole_completion_carries_text() -> None:
    status, _, data, _ = run(_answer(COMPLETIONS, {"prompt": "hi", "max_tokens": 2}))
    answer = orjson.loads(data)
    assert status == 200 and answer["object"] == "text_completion"
    assert answer["id"].startswith("cmpl-") and answer["choices"][0]["text"]


def test_an_anthropic_stream_carries_its_request_id_and_its_input_tokens() -> None:
    body = {"model": "synthetic", "max_tokens": 2, "stream": True}
    body["messages"] = CHAT_BODY["messages"]
    status, headers, data, _ = run(_answer(MESSAGES, body))
    assert status == 200 and headers["request-id"] == headers["x-request-id"]
    events = _events(data)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    start = orjson.loads(events[0][1])
    assert start["message"]["usage"]["input_tokens"] > 0  # the count admission took


def test_a_whole_anthropic_answer_is_a_message_object() -> None:
    body = {"model": "synthetic", "max_tokens": 2, "messages": CHAT_BODY["messages"]}
    status, headers, data, _ = run(_answer(MESSAGES, body))
    message = orjson.loads(data)
    assert status == 200 and headers["request-id"] == headers["x-request-id"]
    assert message["type"] == "message" and message["id"] == "msg_" + headers["x-stream-id"]
    assert message["usage"]["output_tokens"] == 2


def test_a_responses_stream_and_a_whole_response() -> None:
    short = {"input": "hi", "synthetic": {"answer_tokens": 2}}  # ends by itself: completed
    status, _, data, _ = run(_answer(RESPONSES, {**short, "stream": True}))
    names = [name for name, _ in _events(data)]
    assert status == 200 and names[0] == "response.created" and names[-1] == "response.completed"
    status, headers, data, _ = run(_answer(RESPONSES, short))
    response = orjson.loads(data)
    assert status == 200 and response["object"] == "response"
    assert response["id"] == "resp_" + headers["x-stream-id"]
    assert response["status"] == "completed"


def test_a_native_stream_is_started_and_answered_with_its_handle() -> None:
    status, headers, data, gw = run(_answer(STREAMS, {"prompt": "hi", "max_tokens": 2}))
    handle = orjson.loads(data)
    assert status == 201
    assert handle["id"] == headers["x-stream-id"]
    assert handle["events_url"] == headers["location"]
    assert handle["resume_token"] in handle["events_url"]
    assert gw.registry._streams[handle["id"]].grace_s == gw.settings.resume_grace_s


def test_a_background_response_is_started_and_answered_queued_with_its_own_grace() -> None:
    body = {"model": "synthetic", "input": "hi", "background": True}
    status, headers, data, gw = run(_answer(RESPONSES, body))
    response = orjson.loads(data)
    assert status == 200 and response["object"] == "response"
    assert response["id"] == "resp_" + headers["x-stream-id"]
    assert response["status"] == "queued" and response["output"] == []
    assert response["background"] is True and response["store"] is True
    stream = gw.registry._streams[headers["x-stream-id"]]
    assert stream.grace_s == gw.settings.responses_ttl_s == 600.0  # no reader, and it runs
    assert stream.readers == 0 and stream.request.tenant == ""


def test_each_format_names_its_own_resume_grace() -> None:
    s = Settings(resume_grace_s=7.0, openai_grace_s=3.0)
    assert STREAMS.grace_s(s) == 7.0
    assert {f.grace_s(s) for f in (CHAT, COMPLETIONS, MESSAGES, RESPONSES)} == {3.0}


def test_a_refusal_before_the_stream_is_in_the_formats_error_shape() -> None:
    status, headers, data, _ = run(_answer(CHAT, b"{not json"))
    assert status == 400
    assert orjson.loads(data)["error"]["code"] == "invalid_json"
    status, headers, data, _ = run(_answer(MESSAGES, b"{not json"))
    body = orjson.loads(data)
    assert status == 400
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["request_id"] == headers["x-request-id"]


def test_an_unknown_model_is_refused_before_admission() -> None:
    status, _, data, gw = run(_answer(CHAT, {**CHAT_BODY, "model": "nope"}))
    assert status == 404 and orjson.loads(data)["error"]["code"] == "model_not_found"
    assert gw.metrics.active_streams == 0


def test_a_formats_own_check_refuses_a_valid_body() -> None:
    body = {
        "model": "synthetic",
        "max_tokens": 2,
        "messages": CHAT_BODY["messages"],
        "thread": {"id": "t1"},
    }
    status, _, data, _ = run(_answer(MESSAGES, body))
    error = orjson.loads(data)["error"]
    assert status == 400 and error["details"] == {"error_code": "thread_unsupported_request"}


def test_a_whole_answer_that_fails_is_an_http_error_with_its_code() -> None:
    failing = {**CHAT_BODY, "synthetic": {"fail_after": 1, "error_code": "boom"}}
    status, _, data, _ = run(_answer(CHAT, failing))
    assert status >= 400 and orjson.loads(data)["error"]["code"] == "boom"
    body = {"model": "synthetic", "max_tokens": 3, "messages": CHAT_BODY["messages"]}
    body["synthetic"] = failing["synthetic"]
    status, headers, data, _ = run(_answer(MESSAGES, body))
    error = orjson.loads(data)
    assert status >= 400 and error["type"] == "error"
    assert headers["request-id"] == headers["x-request-id"] and headers["x-stream-id"]
