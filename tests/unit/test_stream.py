"""A stream as the engine's sink, and the registry's grace, on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import orjson
import pytest

from firsttoken.admission.keys import ApiKey
from firsttoken.core import stream as stream_module
from firsttoken.core.chunking import CoalescePolicy
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.schedule import Schedule
from firsttoken.core.stream import Outcome, Stream, Usage
from firsttoken.engines import EngineError, GenerationRequest, SyntheticEngine
from firsttoken.formats.render import NativeRenderer
from firsttoken.generation import BaseEngine, Delta, Generation, Sink, ToolCallDelta
from firsttoken.telemetry.metrics import Metrics
from tests.unit.clock import FakeClock


def make(grace_s: float = 0.0) -> Stream:
    stream = Stream(
        GenerationRequest(request_id="s1", prompt="hi", model="synthetic", max_tokens=10),
        NativeRenderer(),
        format="native",
        trace_id="t",
        grace_s=grace_s,
        prompt_tokens=1,
        max_events=100,
        accepted_at=0.0,
        window=4,
    )
    return stream


def events(stream: Stream) -> list[tuple[str | None, object]]:
    out: list[tuple[str | None, object]] = []
    for e in stream.log.after(0):
        lines = e.wire.decode().strip().split("\n")
        name = next((x[7:] for x in lines if x.startswith("event: ")), None)
        data = next(x[6:] for x in lines if x.startswith("data: "))
        out.append((name, data if data == "[DONE]" else orjson.loads(data)))
    return out


def test_tokens_then_the_closing_events() -> None:
    stream = make()
    stream.begin()
    assert stream.push("a") and stream.push("b")
    stream.push("c", "length")
    got = events(stream)
    assert [d for _, d in got[:3]] == [{"token": "a"}, {"token": "b"}, {"token": "c"}]
    assert got[3][0] == "meta" and got[3][1]["finish_reason"] == "length"  # type: ignore[index]
    assert got[-1] == (None, "[DONE]")
    assert stream.outcome is Outcome.COMPLETED and stream.log.closed
    assert not stream.push("late")  # nothing after the end


def test_stop_ends_with_the_reason_and_no_done() -> None:
    stream = make()
    stream.begin()
    stream.push("a")
    stream.stop(Outcome.CANCELLED)
    name, data = events(stream)[-1]
    assert name == "error" and data["error"]["code"] == "cancelled"  # type: ignore[index]
    assert stream.outcome is Outcome.CANCELLED


def test_an_engine_error_keeps_the_coalesced_text_before_it() -> None:
    async def body() -> None:
        stream = make()
        stream.coalesce = CoalescePolicy(max_wait_s=10.0, max_bytes=1024)
        stream.begin()
        for t in ("Hello", " there", " friend"):  # no boundary: pending in the coalescer
            stream.push(t)
        stream.fail(EngineError("boom", "engine failed"))
        got = events(stream)
        texts = "".join(d["token"] for n, d in got if n is None and isinstance(d, dict))
        assert texts == "Hello there friend"
        assert got[-1][0] == "error" and stream.outcome is Outcome.ERROR

    asyncio.run(body())


class _Ticket:
    def __init__(self) -> None:
        self.client_fault = False
        self.key = ApiKey(name="k")

    def first_token(self, ttft_s: float) -> None:
        pass

    def seam(self, meta: object) -> None:
        pass

    def prompt_read(self) -> None:
        pass

    async def release(self, outcome: Outcome, usage: Usage | None = None) -> None:
        pass


@pytest.mark.parametrize("client_fault", [True, False])
def test_an_error_the_request_caused_is_told_to_its_ticket(client_fault: bool) -> None:
    stream = make()
    stream.ticket = ticket = _Ticket()
    stream.begin()
    stream.fail(EngineError("upstream_400", "bad request", client_fault=client_fault))
    assert ticket.client_fault is client_fault  # the breaker ignores the request's own errors


def test_an_abandoned_stream_stops_after_its_grace() -> None:
    async def body() -> None:
        clock = FakeClock()
        registry = StreamRegistry(SyntheticEngine(), Metrics(), ttl_s=10)
        registry.schedule = Schedule(clock=clock, call_at=clock.call_at)
        stream = make(grace_s=5.0)
        registry.attach(stream)
        registry.detach(stream)  # the last reader left
        clock.advance(4.9)
        assert stream.outcome is None
        registry.attach(stream)  # a reader came back: the grace timer no longer counts
        clock.advance(1.0)
        assert stream.outcome is None
        registry.detach(stream)
        clock.advance(5.1)
        assert stream.outcome is Outcome.DISCONNECTED

    asyncio.run(body())


def test_ttft_is_the_engines_not_a_late_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(start=100.0)
    monkeypatch.setattr(stream_module.time, "perf_counter", clock)
    stream = make()
    stream.accepted_at = 100.0  # the request's first byte
    seen: list[float] = []
    stream.on_first_token = lambda s, ttft: seen.append(ttft)
    stream.begin()
    clock.advance(0.2)
    stream.push("first")  # nobody reads yet
    clock.advance(6.0)  # a reader attaches much later and replays it: TTFT stays 0.2 s
    stream.push("second")
    assert seen == [pytest.approx(0.2)]


def test_a_cancel_is_not_reported_as_a_server_error() -> None:
    for reason, code, type_ in (
        (Outcome.CANCELLED, "cancelled", "cancelled"),
        (Outcome.DISCONNECTED, "stream_abandoned", "abandoned"),
    ):
        stream = make()
        stream.begin()
        stream.stop(reason)
        _, data = events(stream)[-1]
        assert data["error"]["code"] == code and data["error"]["type"] == type_  # type: ignore[index]


def test_coalescing_never_merges_across_kinds() -> None:
    """Text is coalesced; a structured delta flushes the pending text first and goes out on
    its own, so reasoning, text and tool-call fragments keep their order and boundaries."""

    async def body() -> None:
        stream = make()
        stream.coalesce = CoalescePolicy(max_wait_s=10.0, max_bytes=1024)
        stream.begin()
        stream.push_delta(Delta(reasoning="Let me"))
        stream.push_delta(Delta(reasoning=" think"))
        stream.push("Hello")  # a run's first token leaves at once
        stream.push(" there")  # these two wait in the coalescer: no boundary yet
        stream.push(" friend")
        call = ToolCallDelta(0, "call_1", "get_weather", "")
        stream.push_delta(Delta(tool_calls=(call,)))
        for piece in ('{"ci', 'ty": "Pa', 'ris"}'):
            stream.push_delta(Delta(tool_calls=(ToolCallDelta(0, arguments=piece),)))
        stream.push("Done")
        stream.finish("tool_calls")
        kinds = [next(iter(d)) for n, d in events(stream) if n is None and isinstance(d, dict)]
        assert kinds == ["reasoning", "reasoning", "token", "token", "tool_call",
                         *["tool_call"] * 3, "token"]  # fmt: skip
        got = [d for n, d in events(stream) if n is None and isinstance(d, dict)]
        assert got[3] == {"token": " there friend"}  # merged within its run only
        args = "".join(d["tool_call"]["arguments"] for d in got if "tool_call" in d)
        assert orjson.loads(args) == {"city": "Paris"}
        assert got[4]["tool_call"]["name"] == "get_weather"
        meta = next(d for n, d in events(stream) if n == "meta")
        assert meta["usage"]["completion_tokens"] == 10  # type: ignore[index]
        assert meta["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}  # type: ignore[index]

    asyncio.run(body())


def test_text_after_a_structured_delta_takes_the_template_again() -> None:
    stream = make()
    stream.begin()
    stream.push("a")
    stream.push_delta(Delta(reasoning="r"))
    stream.push("b")
    stream.push("c")
    assert stream._frame is not None  # back on the hot path
    got = [d for n, d in events(stream) if n is None and isinstance(d, dict)]
    assert got == [{"token": "a"}, {"reasoning": "r"}, {"token": "b"}, {"token": "c"}]


def _full_request() -> GenerationRequest:
    return GenerationRequest(
        request_id="s1",
        prompt="user: hi",
        model="synthetic",
        max_tokens=10,
        messages=({"role": "user", "content": "hi"},),
        body={"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]},
        options={"synthetic": {"ttft_ms": 60_000}},
    )


async def _started(engine: object, request: GenerationRequest) -> Stream:
    """`request` started on a running registry (with a reader, as a handler has one)."""
    stream = Stream(
        request,
        NativeRenderer(),
        format="native",
        trace_id="t",
        grace_s=0.0,
        prompt_tokens=1,
        max_events=100,
        accepted_at=0.0,
    )
    registry = StreamRegistry(engine, Metrics(), ttl_s=10)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(registry.run)
        registry.attach(stream)
        await registry.start(stream)
        for _ in range(5):  # a pull task's first steps
            await anyio.lowlevel.checkpoint()
        stream.stop(Outcome.CANCELLED)
        tg.cancel_scope.cancel()
    return stream


def test_a_step_engine_gets_the_whole_request_and_the_stream_keeps_less() -> None:
    class Recording(SyntheticEngine):
        opened: GenerationRequest | None = None

        def open(self, request: GenerationRequest, sink: Sink) -> Generation:
            self.opened = request
            return super().open(request, sink)

    async def body() -> None:
        engine, request = Recording(), _full_request()
        stream = await _started(engine, request)
        assert engine.opened is request
        kept = stream.request
        assert (kept.request_id, kept.model, kept.max_tokens) == ("s1", "synthetic", 10)
        assert kept.prompt == "" and kept.messages is None and kept.body is None
        assert not kept.options

    asyncio.run(body())


def test_a_pulled_engine_reads_the_whole_request_after_start_returns() -> None:
    class Pulled(BaseEngine):
        models = ("synthetic",)
        tokens_generated = 0
        seen: GenerationRequest | None = None

        async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
            self.seen = request  # a relay reads the body here, in its task
            yield Delta("a")
            await anyio.sleep_forever()

        async def abort(self, request_id: str) -> None:
            return None

    async def body() -> None:
        engine, request = Pulled(), _full_request()
        stream = await _started(engine, request)
        assert engine.seen is request and engine.seen.body is not None
        assert stream.request.body is None

    asyncio.run(body())


def test_usage_is_what_was_generated_when_cut() -> None:
    stream = make()
    stream.begin()
    stream.push_delta(Delta("", reasoning="think"))
    for text in "abcd":
        stream.push(text)
    stream.stop(Outcome.DISCONNECTED)  # its client left after 5 tokens
    assert stream.usage() == Usage(prompt=1, completion=5, reasoning=1, cached=0)


def test_usage_is_the_engines_own_count_when_it_gave_one() -> None:
    stream = make()
    stream.begin()
    stream.push("a")
    counted = {
        "prompt_tokens": 31,
        "completion_tokens": 17,
        "total_tokens": 48,
        "prompt_tokens_details": {"cached_tokens": 24},
        "completion_tokens_details": {"reasoning_tokens": 6},
    }
    stream.push_delta(Delta("", finish_reason="stop", usage=counted))
    assert stream.usage() == Usage(prompt=31, completion=17, reasoning=6, cached=24)


def test_a_malformed_engine_count_falls_back_to_the_streams() -> None:
    stream = make()
    stream.begin()
    stream.push("a")
    odd = {"completion_tokens": 3, "prompt_tokens": "many", "prompt_tokens_details": None}
    stream.push_delta(Delta("", finish_reason="stop", usage=odd))
    assert stream.usage() == Usage(prompt=1, completion=3, reasoning=0, cached=0)


class _Gen:
    cancelled = False

    def resume(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True


def test_a_moved_stream_stops_its_engine_and_closes_without_a_last_event() -> None:
    """Another instance goes on with it: its readers get what was made, then no end."""
    stream = make()
    stream.begin()
    generation = stream.generation = _Gen()
    ended: list[Stream] = []
    stream.on_end = ended.append
    stream.push("a")
    stream.move()
    assert generation.cancelled and stream.outcome is Outcome.MOVED and ended == [stream]
    assert stream.log.closed and events(stream) == [(None, {"token": "a"})]
    stream.stop(Outcome.CANCELLED)  # ended already: nothing more
    assert events(stream) == [(None, {"token": "a"})]


def test_a_stream_taken_over_checks_the_resume_token_by_its_digest() -> None:
    first = make()
    again = make()
    again.resume_token = ""  # only the digest travels with it
    again.token_digest = first.token_digest
    assert again.check_token(first.resume_token)
    assert not again.check_token("guess") and not again.check_token(None)


def test_a_taken_over_engines_count_is_made_the_whole_answers() -> None:
    """The engine counted its continuation (vLLM's way: the text before in its prompt); the
    client is told what an uninterrupted answer would have used."""
    stream = make()
    stream.begin()
    stream.carried = Usage(prompt=1, completion=6, reasoning=2)
    counted = {
        "prompt_tokens": 7,
        "completion_tokens": 4,
        "total_tokens": 11,
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    stream.finish("length", counted)
    usage = events(stream)[-2][1]["usage"]  # type: ignore[index]
    assert usage["prompt_tokens"] == 1 and usage["completion_tokens"] == 10
    assert usage["total_tokens"] == 11
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 2


def test_reasoning_before_a_takeover_is_counted_when_the_engine_counts_none() -> None:
    stream = make()
    stream.begin()
    stream.carried = Usage(prompt=1, completion=8, reasoning=5)
    stream.finish("stop", {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11})
    usage = events(stream)[-2][1]["usage"]  # type: ignore[index]
    assert usage["completion_tokens"] == 10
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 5}


def test_a_stream_taken_over_numbers_its_own_events_apart_from_the_old_owners() -> None:
    """The same seq made by two owners has two ids: a reader with the old owner's id of an
    event the new owner made again is found out (`has_event`)."""
    stream = make()
    stream.begin()
    stream.push("a")
    opened = stream.log.last_seq
    stream.number_as(2)
    stream.push("b")
    stream.push_delta(Delta(meta={"takeover": {}}))
    stream.push("c")
    base = 2 * 10**12
    ids = [int(e.wire.split(b"\n")[0][4:]) for e in stream.log.after(0)]
    assert ids[:opened] == list(range(1, opened + 1))
    assert ids[opened:] == [base + s for s in range(opened + 1, stream.log.last_seq + 1)]
    last = stream.log.last_seq
    assert stream.has_event(opened, opened) and stream.has_event(last, base + last)
    assert not stream.has_event(last, last)  # the old owner's id of that seq
    assert stream.has_event(last + 2, base + last + 2)  # numbered so when it comes
    assert not stream.has_event(last + 2, last + 2)


def test_the_record_a_store_keeps_names_the_key_that_made_the_stream() -> None:
    stream = Stream(
        GenerationRequest(request_id="s1", prompt="hi", model="synthetic", tenant="alice"),
        NativeRenderer(),
        format="responses",
        trace_id="t",
        grace_s=0,
        prompt_tokens=1,
        max_events=100,
        accepted_at=0.0,
    )
    # Another instance answers a response's reader by id only for that key.
    assert stream.record().tenant == "alice"
    assert make().record().tenant == ""  # an open server's caller
