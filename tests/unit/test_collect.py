"""A whole answer folded as it arrives, and stopped at its byte cap."""

from __future__ import annotations

import asyncio

import pytest

from firsttoken.core.collect import Collector
from firsttoken.core.stream import Outcome, Stream
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.formats.render import ChatRenderer
from firsttoken.generation import Delta, ToolCallDelta


class _Generation:
    def __init__(self) -> None:
        self.cancelled = False

    def resume(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True


def _stream() -> Stream:
    return Stream(
        GenerationRequest(request_id="s1", prompt="hi", model="synthetic"),
        ChatRenderer("chatcmpl-s1", "synthetic", 0, True),
        format="openai",
        trace_id="t",
        grace_s=0.0,
        prompt_tokens=1,
        max_events=16,  # the log keeps 16 events; the fold keeps every piece
        accepted_at=0.0,
    )


def _collecting(max_bytes: int | None = None) -> tuple[Stream, Collector, _Generation]:
    stream, generation = _stream(), _Generation()
    collector = Collector(stream, max_bytes)
    stream.log.attach(collector)
    stream.generation = generation
    stream.begin()
    return stream, collector, generation


def test_pieces_are_folded_as_they_arrive() -> None:
    async def body() -> None:
        stream, collector, _ = _collecting()
        for word in ("Héllo", " there", " friend") * 20:
            stream.push(word)
        stream.push_delta(Delta(reasoning="hmm"))
        stream.push_delta(Delta(tool_calls=(ToolCallDelta(0, "call_1", "f", '{"a"'),)))
        stream.push_delta(Delta(tool_calls=(ToolCallDelta(0, arguments=": 1}"),)))
        stream.push("!", "stop")
        answer = collector.fold.done()
        assert answer.content == "Héllo there friend" * 20 + "!"
        assert answer.reasoning == "hmm"
        assert [(c.id, c.name, c.arguments) for c in answer.tool_calls] == [
            ("call_1", "f", '{"a": 1}')
        ]
        assert answer.finish_reason == "stop" and answer.usage["completion_tokens"] == 64
        # UTF-8 bytes of every piece of text: é is two.
        assert collector.fold.size == len(answer.content.encode()) + 3 + 8
        assert collector.failure is None

    asyncio.run(body())


def test_an_answer_past_its_cap_stops_the_stream() -> None:
    async def body() -> None:
        stream, collector, generation = _collecting(max_bytes=100)
        pushed = 0
        while stream.push("0123456789"):  # False once stopped
            pushed += 1
        # The 11th token passed 100 bytes (the hot path's own answer was already given:
        # the engine hears the stop through cancel()), and nothing went on after it.
        assert pushed == 11
        assert stream.outcome is Outcome.ERROR and stream.error_code == "response_too_large"
        assert generation.cancelled  # the engine heard it before its next step
        failure = collector.failure
        assert failure is not None and failure.status == 400 and failure.client_fault
        assert "--max-response-bytes" in failure.message

    asyncio.run(body())


def test_an_engine_error_is_the_answer() -> None:
    async def body() -> None:
        stream, collector, _ = _collecting()
        stream.push("a")
        stream.fail(EngineError("boom", "engine failed"))
        assert collector.failure is not None
        assert (collector.failure.code, collector.failure.message) == ("boom", "engine failed")
        with pytest.raises(EngineError):
            raise collector.failure

    asyncio.run(body())


def test_a_503_before_the_first_token_stays_a_503_and_after_it_is_a_502() -> None:
    """A 503 before the first byte says nothing was started, and a front door sends it to
    another instance: a whole answer that failed after its generation began must not say so
    (it would be generated twice)."""

    async def body() -> None:
        stream, collector, _ = _collecting()
        stream.fail(EngineError("route_unavailable", "no target", status=503))
        assert collector.failure is not None and collector.failure.status == 503

        stream, collector, _ = _collecting()
        stream.push("a")
        stream.fail(EngineError("route_unavailable", "no target left", status=503))
        assert collector.failure is not None and collector.failure.status == 502
        assert collector.failure.code == "route_unavailable"

    asyncio.run(body())
