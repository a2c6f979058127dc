"""The request the relay sends its upstream for a continuation, without sockets: a completion
(a native stream's prompt) grows by the text sent and says where the seam is; a chat
continues its final message."""

from __future__ import annotations

import orjson

from firsttoken.engines.relay import RelayEngine
from firsttoken.generation import Delta, GenerationRequest
from firsttoken.routing.splice import Transcript, continuation


def sent(*texts: str) -> Transcript:
    transcript = Transcript()
    for text in texts:
        transcript.add(Delta(text))
    return transcript


def relayed(request: GenerationRequest) -> tuple[str, dict]:
    path, body = RelayEngine("http://127.0.0.1:1/v1", model="up")._body(request)
    return path, orjson.loads(body)


def test_a_native_streams_continuation_grows_the_prompt_and_names_the_seam() -> None:
    request = GenerationRequest(
        request_id="n1", prompt="Tell me about streams.", model="chat", max_tokens=10
    )
    follow = continuation(request, sent(" The", " throu"))
    assert follow is not None
    path, body = relayed(follow)
    assert path == "/completions"
    assert body["prompt"] == "Tell me about streams. The throu"
    assert body["continue_final_text"] == " The throu"
    assert body["max_tokens"] == 8
    # A fresh one: its prompt alone.
    path, body = relayed(request)
    assert body["prompt"] == "Tell me about streams." and "continue_final_text" not in body


def test_a_completions_body_is_sent_as_the_splice_grew_it() -> None:
    request = GenerationRequest(
        request_id="c1",
        prompt="Once upon",
        model="chat",
        body={"model": "chat", "prompt": "Once upon"},
    )
    follow = continuation(request, sent(" a", " time"))
    assert follow is not None
    path, body = relayed(follow)
    assert path == "/completions"
    assert (body["prompt"], body["continue_final_text"]) == ("Once upon a time", " a time")
