"""The relay's chunk reader: an upstream read's bytes → deltas in one call, the usual read
(whole `data: {json}` events) split without a text decode, anything else through the full
SSE decoder, with the same deltas either way."""

from __future__ import annotations

import random

import orjson
import pytest

from firsttoken.engines.relay import _ChunkReader
from firsttoken.generation import Delta, EngineError


def _event(obj: object) -> bytes:
    return b"data: %s\n\n" % orjson.dumps(obj)


def _content(text: str, finish: str | None = None) -> bytes:
    return _event({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


ANSWER = (
    _event({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
    + b"".join(_content(t) for t in ("Hé", "llo", " wörld", "。"))
    + _event({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]})
    + _content("", "stop")
    + _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    + b"data: [DONE]\n\n"
)


def _read(reads: list[bytes]) -> tuple[list[Delta], Delta]:
    reader = _ChunkReader(chat=True)
    deltas: list[Delta] = []
    for data in reads:
        deltas += reader.feed_deltas(data)
        assert reader.failure is None
        if reader.ended:
            break
    return deltas, reader.last()


def test_whole_events_and_any_split_of_them_give_the_same_deltas() -> None:
    whole = _read([ANSWER])
    assert [d.text for d in whole[0]] == ["Hé", "llo", " wörld", "。", ""]
    assert whole[0][4].reasoning == "hm"
    assert whole[1] == Delta("", "stop", usage={"prompt_tokens": 3, "completion_tokens": 5})
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(ANSWER)), rng.randint(1, 12)))
        reads = [ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(ANSWER)], strict=True)]
        assert _read(reads) == whole  # cut mid-event, mid-character: the full decoder's way


@pytest.mark.parametrize(
    "answer",
    [
        ANSWER.replace(b"\n", b"\r\n"),  # CRLF line ends
        ANSWER.replace(b"data: ", b"data:"),  # no space after the colon
        "\ufeff".encode() + ANSWER,  # a byte-order mark first
        b": keep-alive\n\n" + ANSWER,  # a comment
        b"event: message\nid: 1\n" + ANSWER,  # other fields before an event
    ],
)
def test_any_other_form_of_event_stream_gives_the_same_deltas(answer: bytes) -> None:
    assert _read([answer]) == _read([ANSWER])


def test_an_error_after_a_token_in_the_same_read_comes_after_that_token() -> None:
    reader = _ChunkReader(chat=True)
    deltas = reader.feed_deltas(_content("a") + _event({"error": {"message": "engine died"}}))
    assert [d.text for d in deltas] == ["a"]
    assert isinstance(reader.failure, EngineError) and reader.failure.message == "engine died"


def test_bad_utf8_is_replaced_as_the_full_decoder_does() -> None:
    reader = _ChunkReader(chat=True)
    deltas = reader.feed_deltas(b'data: {"choices":[{"delta":{"content":"a\xff"}}]}\n\n')
    assert [d.text for d in deltas] == ["a\ufffd"]


def test_data_that_is_not_json_is_a_bad_response() -> None:
    reader = _ChunkReader(chat=True)
    assert reader.feed_deltas(b"data: {nope\n\n") == []
    assert reader.failure is not None and reader.failure.code == "upstream_bad_response"


def test_heartbeat_comments_are_not_kept() -> None:
    reader = _ChunkReader(chat=True)
    for _ in range(100):
        assert reader.feed_deltas(b": keep-alive\n\n") == []
    assert reader.comments == []
