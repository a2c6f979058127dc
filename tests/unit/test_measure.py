"""What diag reads out of a stream's bytes, without a network: why the answer ended."""

from __future__ import annotations

import json
import time

import pytest

from firsttoken.tools._measure import Kind, StreamResult, _Body


def read(kind: Kind, *blocks: str) -> StreamResult:
    result = StreamResult(url="http://127.0.0.1:9/x", kind=kind, started_at=time.time())
    body = _Body("", result)
    for i, block in enumerate(blocks):
        body.feed(0.01 * i, block.encode())
    return result


def test_native_finish_reason_and_usage_come_from_the_closing_meta() -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    meta = {"finish_reason": "length", "tokens": 2, "remaining": 0, "usage": usage}
    result = read(
        Kind.NATIVE,
        'id: 1\ndata: {"token":"a"}\n\n',
        'id: 2\ndata: {"token":"b"}\n\n',
        "id: 3\nevent: meta\ndata: " + json.dumps(meta) + "\n\n",
        "id: 4\ndata: [DONE]\n\n",
    )
    assert result.finish_reason == "length"
    assert result.usage == usage
    assert [e.text for e in result.content] == ["a", "b"]


@pytest.mark.parametrize(
    ("end", "response", "reason"),
    [
        ("response.completed", '{"status":"completed","incomplete_details":null}', "completed"),
        (
            "response.incomplete",
            '{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"}}',
            "max_output_tokens",
        ),
        (
            "response.incomplete",
            '{"status":"incomplete","incomplete_details":{"reason":"content_filter"}}',
            "content_filter",
        ),
    ],
)
def test_responses_finish_reason_is_the_status_or_why_it_is_incomplete(
    end: str, response: str, reason: str
) -> None:
    result = read(
        Kind.RESPONSES,
        'event: response.created\ndata: {"type":"response.created",'
        '"response":{"status":"in_progress"}}\n\n',
        'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        '"delta":"hi"}\n\n',
        f'event: {end}\ndata: {{"type":"{end}","response":{response}}}\n\n',
    )
    assert result.finish_reason == reason
    assert result.done


def test_chat_and_anthropic_finish_reasons_still_read() -> None:
    chat = read(
        Kind.CHAT,
        'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n',
        'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
        "data: [DONE]\n\n",
    )
    assert chat.finish_reason == "stop"
    messages = read(
        Kind.MESSAGES,
        'event: message_delta\ndata: {"type":"message_delta",'
        '"delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":1}}\n\n',
        'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    )
    assert messages.finish_reason == "end_turn"
