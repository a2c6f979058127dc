from __future__ import annotations

import json

from firsttoken.engines import EngineError, GenerationRequest, SyntheticEngine, synthetic_tokens
from firsttoken.engines.base import Delta
from firsttoken.engines.synthetic import SyntheticOptions, answer_parts
from tests.unit.clock import FakeClock


class Sink:
    def __init__(self, room: bool = True) -> None:
        self.tokens: list[tuple[float, str]] = []
        self.finished: str | None = None
        self.error: EngineError | None = None
        self.room = room
        self.clock: FakeClock | None = None

    def push(self, text: str, finish: str | None = None) -> bool:
        assert self.clock is not None
        self.tokens.append((self.clock.now, text))
        if finish is not None:
            self.finished = finish
        return self.room

    def finish(self, reason: str) -> None:
        self.finished = reason

    def fail(self, error: EngineError) -> None:
        self.error = error


def start(
    ttft_ms: float = 100, itl_ms: float = 10, **synthetic: object
) -> tuple[SyntheticEngine, FakeClock, Sink, object]:
    clock = FakeClock()
    engine = SyntheticEngine(ttft_ms=ttft_ms, itl_ms=itl_ms)
    engine._loop = clock  # type: ignore[assignment]
    sink = Sink()
    sink.clock = clock
    request = GenerationRequest(
        "r1", "hello", "synthetic", max_tokens=20, options={"synthetic": synthetic}
    )
    return engine, clock, sink, engine.open(request, sink)


def test_tokens_come_on_the_clock_and_token_exact() -> None:
    engine, clock, sink, _ = start()
    clock.advance(0.099)
    assert sink.tokens == []
    clock.advance(0.001)
    assert len(sink.tokens) == 1
    clock.advance(0.190)
    expected, finish = synthetic_tokens("hello", None, 20)
    assert [t for _, t in sink.tokens] == expected
    assert sink.finished == finish == "length"
    gaps = [b - a for (a, _), (b, _) in zip(sink.tokens, sink.tokens[1:], strict=False)]
    assert all(abs(g - 0.010) < 0.0011 for g in gaps)
    assert engine.tokens_generated == 20


def test_streams_due_in_the_same_millisecond_share_one_timer() -> None:
    clock = FakeClock()
    engine = SyntheticEngine(ttft_ms=50, itl_ms=10)
    engine._loop = clock  # type: ignore[assignment]
    for i in range(10):
        sink = Sink()
        sink.clock = clock
        engine.open(GenerationRequest(f"r{i}", "hi", "synthetic", max_tokens=3), sink)
    assert len(clock.timers) == 1


def test_a_paused_request_waits_for_resume_then_does_not_burst() -> None:
    _engine, clock, sink, generation = start()
    sink.room = False
    clock.advance(0.100)
    assert len(sink.tokens) == 1
    clock.advance(1.0)
    assert len(sink.tokens) == 1  # paused: nothing while the readers are behind
    sink.room = True
    generation.resume()  # type: ignore[attr-defined]
    clock.advance(0.0)
    assert len(sink.tokens) == 2
    clock.advance(0.0095)
    assert len(sink.tokens) == 2  # paced again from the resume, not caught up in a burst
    clock.advance(0.001)
    assert len(sink.tokens) == 3


def test_cancel_stops_before_the_next_step() -> None:
    engine, clock, sink, generation = start()
    clock.advance(0.125)
    n = len(sink.tokens)
    generation.cancel()  # type: ignore[attr-defined]
    clock.advance(1.0)
    assert len(sink.tokens) == n and sink.finished is None
    assert engine.tokens_generated == n


def test_a_long_ttft_waits_in_its_slot_and_is_on_time() -> None:
    clock = FakeClock()
    engine = SyntheticEngine(ttft_ms=120_000, itl_ms=10)
    engine._loop = clock  # type: ignore[assignment]
    sinks = []
    for i in range(50):  # opened over 5 ms: one slot, one timer
        sink = Sink()
        sink.clock = clock
        sinks.append(sink)
        engine.open(GenerationRequest(f"r{i}", "hi", "synthetic", max_tokens=3), sink)
        clock.advance(0.0001)
    assert len(clock.timers) == 1
    clock.advance(119.990)
    assert all(s.tokens == [] for s in sinks)
    clock.advance(0.010)
    assert all(len(s.tokens) == 1 for s in sinks)
    first = min(t for s in sinks for t, _ in s.tokens)
    assert 1120.0 - 0.001 <= first <= 1120.0 + 0.001


def test_a_run_cancelled_while_waiting_long_never_steps() -> None:
    engine, clock, sink, generation = start(ttft_ms=60_000)
    generation.cancel()  # type: ignore[attr-defined]
    clock.advance(61.0)
    assert sink.tokens == [] and sink.finished is None and engine.steps == 0


def test_fault_injection_fails_after_n_tokens() -> None:
    _, clock, sink, _ = start(fail_after=3, error_code="boom")
    clock.advance(1.0)
    assert len(sink.tokens) == 3
    assert sink.error is not None and sink.error.code == "boom"


def test_reasoning_then_a_tool_call_in_fragments() -> None:
    arguments = {"city": "Zürich", "days": [1, 2]}
    opts = SyntheticOptions(reasoning_tokens=5, tool_call={"name": "f", "arguments": arguments})
    request = GenerationRequest("r", "user: hi", "synthetic", seed=3)
    parts, finish = answer_parts(request, opts)
    assert finish == "tool_calls"
    assert all(isinstance(p, Delta) and p.reasoning for p in parts[:5])
    first = parts[5]
    assert isinstance(first, Delta) and first.tool_calls[0].name == "f"
    assert first.tool_calls[0].id and first.tool_calls[0].id.startswith("call_")
    pieces = [p.tool_calls[0].arguments for p in parts[6:]]  # type: ignore[union-attr]
    assert len(pieces) > 3 and all(1 <= len(x) <= 8 for x in pieces)
    assert json.loads("".join(pieces)) == arguments
    assert answer_parts(request, opts) == (parts, finish)  # deterministic


def test_max_tokens_counts_reasoning_too() -> None:
    opts = SyntheticOptions(reasoning_tokens=5)
    request = GenerationRequest("r", "user: hi", "synthetic", max_tokens=7)
    parts, finish = answer_parts(request, opts)
    assert finish == "length" and len(parts) == 7
    assert [type(p) for p in parts] == [Delta] * 5 + [str] * 2
