from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest

from firsttoken.engines import EngineError, GenerationRequest, SyntheticEngine, synthetic_tokens
from firsttoken.engines.synthetic import (
    _ANSWERS,
    CACHE_BYTES,
    Faults,
    Part,
    SyntheticOptions,
    _Answers,
    answer_parts,
)
from firsttoken.engines.text import count_words
from firsttoken.generation import Delta
from tests.unit.clock import FakeClock


class Sink:
    def __init__(self, room: bool = True) -> None:
        self.tokens: list[tuple[float, str]] = []
        self.deltas: list[Delta] = []
        self.finished: str | None = None
        self.usage: Any = None
        self.error: EngineError | None = None
        self.room = room
        self.clock: FakeClock | None = None

    def push(self, text: str, finish: str | None = None) -> bool:
        assert self.clock is not None
        self.tokens.append((self.clock.now, text))
        if finish is not None:
            self.finished = finish
        return self.room

    def push_delta(self, delta: Delta) -> bool:
        if delta.text:
            return self.push(delta.text, delta.finish_reason)
        if delta.structured:
            self.deltas.append(delta)
        if delta.finish_reason is not None:
            self.finished = delta.finish_reason
            self.usage = delta.usage
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
        request_id="r1",
        prompt="hello",
        model="synthetic",
        max_tokens=20,
        options={"synthetic": synthetic},
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
        engine.open(
            GenerationRequest(request_id=f"r{i}", prompt="hi", model="synthetic", max_tokens=3),
            sink,
        )
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
        engine.open(
            GenerationRequest(request_id=f"r{i}", prompt="hi", model="synthetic", max_tokens=3),
            sink,
        )
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
    request = GenerationRequest(request_id="r", prompt="user: hi", model="synthetic", seed=3)
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
    request = GenerationRequest(request_id="r", prompt="user: hi", model="synthetic", max_tokens=7)
    parts, finish = answer_parts(request, opts)
    assert finish == "length" and len(parts) == 7
    assert [type(p) for p in parts] == [Delta] * 5 + [str] * 2


# ---- continuation: the rest of the answer, as vLLM's continue_final_message gives it ----------


def continued(
    prompt: str, prefix: str, max_tokens: int | None = None, seed: int = 5, **knobs: Any
) -> tuple[list[Part], str]:
    request = GenerationRequest(
        request_id="r",
        prompt=prompt,
        model="synthetic",
        max_tokens=max_tokens,
        seed=seed,
        options={"continuation": prefix},
    )
    return answer_parts(request, SyntheticOptions(**knobs))


def whole(prompt: str, max_tokens: int | None = None, seed: int = 5, **knobs: Any):
    request = GenerationRequest(
        request_id="r", prompt=prompt, model="synthetic", max_tokens=max_tokens, seed=seed
    )
    return answer_parts(request, SyntheticOptions(**knobs))


@pytest.mark.parametrize("style", ["prose", "markdown", "hostile"])
def test_a_prefix_at_every_token_boundary_continues_into_the_same_answer(style: str) -> None:
    full, finish = whole("user: go on", style=style, answer_tokens=120)
    assert finish == "stop" and all(isinstance(t, str) for t in full)
    for k in range(len(full) + 1):
        rest, rest_finish = continued(
            "user: go on", "".join(full[:k]), style=style, answer_tokens=120
        )  # type: ignore[arg-type]
        assert full[:k] + rest == full, k
        assert rest_finish == "stop"


def test_max_tokens_counts_what_remains() -> None:
    for k in (0, 1, 7, 40):
        for remaining in (1, 3, 25, 500):
            expected, finish = whole("user: limits", max_tokens=k + remaining)
            prefix = "".join(expected[:k])  # type: ignore[arg-type]
            rest, rest_finish = continued("user: limits", prefix, max_tokens=remaining)
            assert expected[:k] + rest == expected and rest_finish == finish, (k, remaining)


def test_reasoning_is_not_repeated_when_continuing() -> None:
    full, finish = whole("user: think", max_tokens=60, reasoning_tokens=10)
    text = full[10:]
    assert all(isinstance(p, Delta) and p.reasoning for p in full[:10])
    assert all(isinstance(p, str) for p in text)
    for k in range(len(text) + 1):
        # The prefix holds reasoning (10) and k text tokens; max_tokens counts the rest.
        rest, rest_finish = continued(
            "user: think",
            "".join(text[:k]),
            max_tokens=60 - 10 - k,
            reasoning_tokens=10,  # type: ignore[arg-type]
        )
        assert text[:k] + rest == text and rest_finish == finish == "length", k


def test_stop_strings_hold_across_the_splice() -> None:
    full, _ = whole("user: stop here")
    stop = full[30]
    expected, finish = (
        whole("user: stop here", max_tokens=None)[0],
        "stop",
    )
    request = GenerationRequest(
        request_id="r", prompt="user: stop here", model="synthetic", seed=5, stop=(stop,)
    )
    cut, cut_finish = answer_parts(request, SyntheticOptions())
    assert len(cut) <= 31 and cut_finish == finish and "".join(expected).startswith("".join(cut))  # type: ignore[arg-type]
    request = GenerationRequest(
        request_id="r",
        prompt="user: stop here",
        model="synthetic",
        seed=5,
        stop=(stop,),
        options={"continuation": "".join(cut[:5])},  # type: ignore[arg-type]
    )
    rest, rest_finish = answer_parts(request, SyntheticOptions())
    assert cut[:5] + rest == cut and rest_finish == "stop"


def mid_token_prefixes(texts: list[str]) -> list[str]:
    """Texts that leave off inside a token: of the first, and of a later one."""
    later = next(i for i, t in enumerate(texts) if i >= 3 and len(t.strip()) >= 3)
    return [
        texts[0][:2],
        "".join(texts[:later]) + texts[later][:2],
    ]


def test_a_text_that_is_not_a_prefix_at_a_token_boundary_is_refused() -> None:
    full, _ = whole("user: refuse")
    texts = [t for t in full if isinstance(t, str)]
    assert len(texts[0]) > 2
    refused = [
        " Not the answer at all",
        *mid_token_prefixes(texts),
        "".join(texts) + " and then some",  # longer than the answer
        "".join(texts[:5]).upper(),
    ]
    for prefix in refused:
        with pytest.raises(EngineError) as info:
            continued("user: refuse", prefix)
        error = info.value
        assert error.code == "invalid_continuation" and error.status == 400, prefix
        assert error.client_fault and error.type == "invalid_request_error"


def test_a_tool_call_answer_continues_only_from_nothing() -> None:
    call = {"name": "f", "arguments": {"x": 1}}
    full, finish = whole("user: call", tool_call=call)
    rest, rest_finish = continued("user: call", "", tool_call=call)
    assert (rest, rest_finish) == (full, finish) == (full, "tool_calls")
    with pytest.raises(EngineError):
        continued("user: call", "Sure", tool_call=call)


def test_a_continuation_reports_usage_as_vllm_counts_it() -> None:
    clock = FakeClock()
    engine = SyntheticEngine(ttft_ms=1, itl_ms=1)
    engine._loop = clock  # type: ignore[assignment]
    full, _ = synthetic_tokens("user: usage", 2, 50)
    sink = Sink()
    sink.clock = clock
    request = GenerationRequest(
        request_id="r",
        prompt="user: usage",
        model="synthetic",
        max_tokens=30,
        seed=2,
        options={"continuation": "".join(full[:20])},
    )
    engine.open(request, sink)
    clock.advance(1.0)
    assert [t for _, t in sink.tokens] == full[20:50] and sink.finished == "length"
    prompt = engine.prompt_tokens("user: usage") + 20  # the prefix counts as prompt
    assert sink.usage == {
        "prompt_tokens": prompt,
        "completion_tokens": 30,
        "total_tokens": prompt + 30,
    }


def test_the_check_refuses_what_open_would_fail() -> None:
    engine = SyntheticEngine()
    good = GenerationRequest(
        request_id="r", prompt="p", model="synthetic", options={"continuation": ""}
    )
    engine.check(good)
    bad = GenerationRequest(
        request_id="r", prompt="p", model="synthetic", options={"continuation": "nope"}
    )
    with pytest.raises(EngineError):
        engine.check(bad)
    deep: Any = {}
    for _ in range(300):
        deep = {"a": deep}
    nested = GenerationRequest(
        request_id="r",
        prompt="p",
        model="synthetic",
        options={"synthetic": {"tool_call": {"name": "f", "arguments": deep}}},
    )
    with pytest.raises(EngineError) as info:
        engine.check(nested)
    assert info.value.status == 400 and info.value.client_fault


# ---- lazy answers, bounded in bytes -----------------------------------------------------------


def test_max_tokens_1_of_a_huge_answer_builds_one_sentence() -> None:
    tracemalloc.start()
    try:
        tokens, finish = synthetic_tokens("user: huge", 1, 1, answer_tokens=100_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(tokens) == 1 and finish == "length"
    # Building the whole answer took ~6 MB (60 MB at a million tokens); one sentence, ~20 KB.
    assert peak < 200_000


def test_a_long_answer_is_built_as_it_is_read() -> None:
    clock = FakeClock()
    engine = SyntheticEngine(ttft_ms=1, itl_ms=1)
    engine._loop = clock  # type: ignore[assignment]
    sink = Sink()
    sink.clock = clock
    request = GenerationRequest(
        request_id="r",
        prompt="user: long read",
        model="synthetic",
        options={"synthetic": {"answer_tokens": 50_000}},
    )
    engine.open(request, sink)
    clock.advance(0.1)
    read = len(sink.tokens)
    assert 90 <= read <= 101
    built = len(_ANSWERS.get("user: long read", 0, 50_000, "prose").tokens)
    assert built < 50_000 and built < read + 200  # a chunk and a sentence ahead, no more


def test_the_answer_cache_is_bounded_in_bytes() -> None:
    answers = _Answers(max_bytes=2_000_000)
    for i in range(40):
        answer = answers.get(f"prompt {i}", 0, 5_000, "prose")
        assert answers.token(answer, 4_999) is not None
        assert answers.held <= answers.max_bytes
    assert 2 < len(answers) < 40  # the oldest went
    assert sum(a.size for a in answers._entries.values()) == answers.held
    assert _ANSWERS.max_bytes == CACHE_BYTES


# ---- failures: the request's own, and the engine's ---------------------------------------------


def test_a_requested_failure_is_the_clients_fault() -> None:
    _, clock, sink, _ = start(fail_after=3, error_code="boom")
    clock.advance(1.0)
    assert sink.error is not None and sink.error.client_fault and len(sink.tokens) == 3


def test_the_fail_rate_fails_that_share_as_engine_faults() -> None:
    clock = FakeClock()
    engine = SyntheticEngine(ttft_ms=1, itl_ms=1, fail_rate=0.25)
    engine._loop = clock  # type: ignore[assignment]
    sinks = []
    for i in range(400):
        sink = Sink()
        sink.clock = clock
        sinks.append(sink)
        engine.open(
            GenerationRequest(request_id=f"r{i}", prompt="hi", model="synthetic", max_tokens=30),
            sink,
        )
    clock.advance(1.0)
    failed = [s for s in sinks if s.error is not None]
    assert 70 <= len(failed) <= 130
    assert all(s.error.code == "engine_error" and not s.error.client_fault for s in failed)  # type: ignore[union-attr]
    assert all(s.finished == "length" and len(s.tokens) == 30 for s in sinks if s.error is None)
    assert all(len(s.tokens) < 30 for s in failed)  # before the end: never a finished answer
    # Seeded: a fresh engine fed the same streams in the same order fails the same ones.
    again = Faults(0.25)
    assert [again.draw(SyntheticOptions()) is not None for _ in sinks] == [
        s.error is not None for s in sinks
    ]


def test_a_fail_rate_of_one_fails_even_a_short_answer() -> None:
    faults = Faults(1.0)
    for _ in range(20):
        failure = faults.draw(SyntheticOptions(fail_after=50))  # the earlier failure wins
        assert failure is not None and not failure.client_fault and failure.at < 20
    clock = FakeClock()
    engine = SyntheticEngine(ttft_ms=1, itl_ms=1, fail_rate=1.0)
    engine._loop = clock  # type: ignore[assignment]
    sink = Sink()
    sink.clock = clock
    engine.open(
        GenerationRequest(request_id="r", prompt="hi", model="synthetic", max_tokens=1), sink
    )
    clock.advance(1.0)
    assert sink.error is not None and sink.finished is None and not sink.error.client_fault


# ---- agent loops: a tool's result gets an answer, not the same call again ---------------------


def turn(messages: list[dict[str, Any]], call: dict[str, Any]) -> tuple[list[Part], str]:
    body = {"model": "synthetic", "messages": messages}
    request = GenerationRequest(
        request_id="r", prompt="user: weather", model="synthetic", seed=1, body=body
    )
    return answer_parts(request, SyntheticOptions(reasoning_tokens=3, tool_call=call))


def test_the_result_of_its_own_call_gets_an_answer_in_text() -> None:
    call = {"name": "get_weather", "arguments": {"city": "Bern"}}
    question = [{"role": "user", "content": "Weather in Bern?"}]
    first, finish = turn(question, call)
    assert finish == "tool_calls"
    made = first[3]
    assert isinstance(made, Delta) and made.tool_calls[0].name == "get_weather"
    asked = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": made.tool_calls[0].id, "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}},
        ],
    }  # fmt: skip
    result = {"role": "tool", "tool_call_id": made.tool_calls[0].id, "content": "sunny"}
    answer, finish = turn([*question, asked, result], call)
    assert finish == "stop" and all(isinstance(p, str) for p in answer[3:])
    assert len(answer) > 100 and all(isinstance(p, Delta) and p.reasoning for p in answer[:3])
    # Anything else still gets the call: another tool's result, or a new question after it.
    other = {**asked, "tool_calls": [{**asked["tool_calls"][0], "function": {"name": "other"}}]}
    assert turn([*question, other, result], call)[1] == "tool_calls"
    later = [*question, asked, result, {"role": "assistant", "content": "Sunny."}, *question]
    assert turn(later, call)[1] == "tool_calls"
    stray = {**result, "tool_call_id": "call_elsewhere"}
    assert turn([*question, asked, stray], call)[1] == "tool_calls"


@pytest.mark.parametrize("style", ["prose", "markdown", "hostile"])
@pytest.mark.parametrize("n", [1, 20, 40, 333])
def test_answer_tokens_is_the_answers_length_in_tokens(style: str, n: int) -> None:
    # It was a minimum in prose (whole sentences: 40 gave 47); the default length still is.
    for i in range(10):
        tokens, finish = synthetic_tokens(f"user: question {i}", answer_tokens=n, style=style)
        assert (len(tokens), finish) == (n, "stop")
        if style == "prose":  # the default answer's start, as before
            default, _ = synthetic_tokens(f"user: question {i}", style=style)
            assert tokens[: len(default)] == default[:n]


def test_with_continue_any_another_models_text_gets_the_rest_after_as_many_tokens() -> None:
    full, finish = whole("user: any", answer_tokens=60)
    texts = [t for t in full if isinstance(t, str)]
    foreign = "Tides rise and fall twice a day."  # 8 words and a mark, counted as prompts are
    k = count_words(foreign)
    assert k == 8 or k == 9
    rest, rest_finish = continued("user: any", foreign, answer_tokens=60, continue_any=True)
    assert rest == texts[k:] and rest_finish == finish
    # Its own prefix still continues exactly where it ends; max_tokens counts what remains.
    own = "".join(texts[:12])
    assert continued("user: any", own, continue_any=True, answer_tokens=60)[0] == texts[12:]
    short, short_finish = continued(
        "user: any", foreign, max_tokens=5, answer_tokens=60, continue_any=True
    )
    assert short == texts[k : k + 5] and short_finish == "length"
    # Longer than the whole answer: nothing is left.
    assert continued("user: any", "word " * 100, answer_tokens=60, continue_any=True)[0] == []
    with pytest.raises(EngineError):  # and without the knob, a refusal as before
        continued("user: any", foreign, answer_tokens=60)


def test_with_prefix_cache_a_continuation_waits_only_for_its_conversations_prefill() -> None:
    clock = FakeClock()
    engine = SyntheticEngine(ttft_ms=900, itl_ms=20)
    engine._loop = clock  # type: ignore[assignment]
    knobs = {"prefix_cache": True, "continue_any": True}

    def ask(prompt: str, prefix: str | None) -> Sink:
        sink = Sink()
        sink.clock = clock
        options: dict[str, Any] = {"synthetic": knobs}
        if prefix is not None:
            options["continuation"] = prefix
        request = GenerationRequest(
            request_id="r", prompt=prompt, model="synthetic", max_tokens=3, options=options
        )
        engine.open(request, sink)
        return sink

    start = clock.now
    ask("user: tides", None)  # the prefill: done at +0.9 s
    clock.advance(0.3)
    early = ask("user: tides", "Some words here")  # asked before the prefill is done
    clock.advance(2.0)
    assert early.tokens[0][0] == pytest.approx(start + 0.9 + 0.02)
    warm = ask("user: tides", "Some words here")
    cold = ask("user: other", "Some words here")  # a conversation never prefilled
    clock.advance(2.0)
    assert warm.tokens[0][0] == pytest.approx(start + 2.3 + 0.02)
    assert cold.tokens[0][0] == pytest.approx(start + 2.3 + 0.9)
