"""The router on virtual time, with scripted targets: failover before the first token, phase
deadlines that cancel the slow leg, the splice (no seam, one meta, usage over both legs), where
it must not splice, health as the router feeds it, balance and the slot queue."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from firsttoken.generation import (
    Delta,
    EmbeddingRequest,
    Embeddings,
    EngineError,
    GenerationRequest,
    ToolCallDelta,
)
from firsttoken.routing.config import Handoff, ModelRoute, RouteTable, ShortPrompts, TargetConfig
from firsttoken.routing.engine import MAX_CHARS_PER_TOKEN, RoutedEngine
from firsttoken.routing.health import TargetHealth
from firsttoken.routing.seam import prefill_id
from firsttoken.routing.target import Target
from tests.unit import virtual_loop
from tests.unit.scripted import ANSWER, PROMPT_TOKENS, Fail, Scripted, answer, cut, tokens

WHOLE = "".join(ANSWER)
USER = {"role": "user", "content": "Tell me a story."}
START = virtual_loop.START


def chat(request_id: str = "s1", max_tokens: int | None = None) -> GenerationRequest:
    body: dict[str, Any] = {"model": "chat", "messages": [USER], "stream": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return GenerationRequest(
        request_id=request_id,
        prompt="user: Tell me a story.",
        model="chat",
        max_tokens=max_tokens,
        messages=(USER,),
        body=body,
    )


def router(
    engines: dict[str, Scripted],
    *,
    max_splices: int = 1,
    balance: str = "order",
    hedge: bool = True,
    **configs: Any,
) -> RoutedEngine:
    """A route `chat` over `engines` in order; every target continues natively unless its
    entry in `configs` (keyed by target name) says otherwise."""
    table = RouteTable(
        targets={
            name: TargetConfig(
                name=name, kind="synthetic", **{"continuation": "native", **configs.get(name, {})}
            )
            for name in engines
        },
        routes={
            "chat": ModelRoute(
                name="chat",
                targets=tuple(engines),
                max_splices=max_splices,
                balance=balance,
                hedge=hedge,
            )
        },
    )
    return RoutedEngine(table, {n: Target(table.targets[n], e) for n, e in engines.items()})


@dataclass
class Outcome:
    deltas: list[Delta] = field(default_factory=list)
    error: EngineError | None = None
    took: float = 0.0

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def metas(self) -> list[Any]:
        """The seams' meta events (the prefill's bill: `prefills`)."""
        return [d.meta for d in self.deltas if d.meta is not None and "prefill" not in d.meta]

    @property
    def prefills(self) -> list[Any]:
        return [d.meta["prefill"] for d in self.deltas if d.meta and "prefill" in d.meta]

    @property
    def finish(self) -> Delta:
        assert self.deltas and self.deltas[-1].finish_reason is not None
        return self.deltas[-1]


async def play(engine: RoutedEngine, request: GenerationRequest | None = None) -> Outcome:
    loop = asyncio.get_running_loop()
    start = loop.time()
    out = Outcome()
    try:
        async for delta in engine.generate(request or chat()):
            out.deltas.append(delta)
    except EngineError as exc:
        out.error = exc
    out.took = loop.time() - start
    return out


def go(engine: RoutedEngine, request: GenerationRequest | None = None) -> Outcome:
    return virtual_loop.run(play(engine, request))


def health(engine: RoutedEngine, name: str) -> TargetHealth:
    return engine.targets[name].health


def failovers(engine: RoutedEngine) -> dict[str, int]:
    return {phase: n for (_, phase), n in engine.failovers.items() if n}


def no_splice_left(out: Outcome, code: str = "upstream_truncated") -> None:
    """A cut answer is never passed off as finished: the error, no finish reason."""
    assert out.error is not None and out.error.code == code
    assert all(d.finish_reason is None for d in out.deltas)


# -- before the first token: failover ------------------------------------------------------------


def test_an_answer_comes_from_the_first_target() -> None:
    a, b = Scripted(answer), Scripted(answer)
    engine = router({"a": a, "b": b}, a={"model": "Qwen/Qwen3-8B"})
    out = go(engine)
    assert out.error is None and out.text == WHOLE and out.metas == []
    assert out.finish.finish_reason == "stop"
    assert out.finish.usage == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": len(ANSWER),
        "total_tokens": PROMPT_TOKENS + len(ANSWER),
    }
    assert a.requests[0].model == "Qwen/Qwen3-8B"  # the name the target knows
    assert b.requests == []
    assert failovers(engine) == {}
    assert engine.targets["a"].outstanding == 0 and engine._current == {}


def test_a_refused_connection_fails_over_as_connect() -> None:
    a = Scripted([Fail("upstream_unavailable", status=503)])
    b = Scripted(answer)
    engine = router({"a": a, "b": b})
    out = go(engine)
    assert out.error is None and out.text == WHOLE
    assert out.metas == []  # a failover before any token is not news for the client
    assert failovers(engine) == {"connect": 1}
    assert health(engine, "a")._failures == 1
    assert b.requests[0].model == "chat" and "continuation" not in b.requests[0].options


def test_a_late_first_token_cancels_the_slow_leg_and_fails_over() -> None:
    a = Scripted([60.0, *tokens(10)])
    b = Scripted(answer)
    engine = router({"a": a, "b": b}, a={"first_token_timeout_s": 30})
    out = go(engine)
    assert out.error is None and out.text == WHOLE
    assert out.took == 30.0
    assert a.ended_early == ["CancelledError"]  # the slow request was stopped, not left
    assert a.tokens_generated == 0
    assert failovers(engine) == {"first_token": 1}
    assert engine.targets["a"].outstanding == 0


def test_every_target_failing_before_a_token_raises_the_last_error() -> None:
    a = Scripted([Fail("upstream_unavailable", status=503)])
    b = Scripted([Fail("upstream_502", status=502)])
    out = go(router({"a": a, "b": b}))
    assert out.deltas == []
    assert out.error is not None and out.error.code == "upstream_502"


def test_a_clients_fault_is_raised_without_failover_and_does_no_harm() -> None:
    a = Scripted([Fail("upstream_rejected", retryable=False, status=400, client_fault=True)])
    b = Scripted(answer)
    engine = router({"a": a, "b": b}, a={"eject_after": 1})

    async def body() -> list[Outcome]:
        return [await play(engine) for _ in range(3)]

    for out in virtual_loop.run(body()):
        assert out.error is not None and out.error.code == "upstream_rejected"
        assert out.error.status == 400
    assert b.requests == []  # another target would refuse the same request
    assert health(engine, "a").state == TargetHealth.UP and health(engine, "a")._failures == 0
    assert failovers(engine) == {}


def target_fault(status: int) -> Fail:
    """What both relay kinds make of an upstream 401/403/404: the target's set-up."""
    return Fail("upstream_rejected", retryable=True, status=status)


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_targets_own_set_up_fault_fails_over_and_counts_against_it(status: int) -> None:
    a, b = Scripted([target_fault(status)] * 3), Scripted(answer)
    engine = router({"a": a, "b": b}, a={"eject_after": 2})

    async def body() -> list[Outcome]:
        return [await play(engine, chat(f"s{i}")) for i in range(3)]

    outs = virtual_loop.run(body())
    assert [(o.error, o.text) for o in outs] == [(None, WHOLE)] * 3
    assert len(a.requests) == 2  # two failures ejected it: the third went to b at once
    assert health(engine, "a").state == TargetHealth.EJECTED
    assert failovers(engine) == {"connect": 2}


def test_a_set_up_fault_with_no_target_left_is_the_gateways_502_not_the_clients_401() -> None:
    out = go(router({"a": Scripted([target_fault(401)])}))
    assert out.error is not None and out.error.code == "upstream_rejected"
    assert (out.error.status, out.error.type) == (502, "server_error")
    assert not out.error.client_fault


def test_a_passthrough_404_fails_over_without_harming_the_target() -> None:
    # The client's own model name: this upstream may simply not serve it.
    a = Scripted([target_fault(404)], models=("qwen",))
    b = Scripted(answer, models=("llama",))
    engine = passthrough({"a": a, "b": b})
    out = go(engine, replace(chat(), model="llama"))
    assert out.error is None and out.text == WHOLE
    assert health(engine, "a")._failures == 0


def test_an_error_that_is_not_retryable_is_raised_at_once() -> None:
    a = Scripted([Fail("engine_broken", retryable=False)])
    b = Scripted(answer)
    out = go(router({"a": a, "b": b}))
    assert out.error is not None and out.error.code == "engine_broken"
    assert b.requests == []


# -- deadlines once the answer began -------------------------------------------------------------


def test_silence_past_the_idle_deadline_is_a_cut_that_splices() -> None:
    a = Scripted([*tokens(3), 100.0, *tokens(7, 3)])
    b = Scripted(answer)
    engine = router({"a": a, "b": b}, a={"idle_timeout_s": 30})
    out = go(engine)
    assert out.error is None
    assert out.text == WHOLE
    assert out.took == 30.0
    assert a.ended_early == ["CancelledError"]
    assert out.metas == [{"failover": {"from": "a", "to": "b", "at_token": 3}}]
    assert failovers(engine) == {"mid_stream": 1}
    assert b.requests[0].options["continuation"] == "Once upon a"


def test_the_idle_deadline_starts_again_at_each_chunk() -> None:
    a = Scripted(tokens(10, every_s=29.0))
    out = go(router({"a": a}, a={"idle_timeout_s": 30}))
    assert out.error is None and out.text == WHOLE
    assert out.took == 290.0


def test_time_the_client_takes_to_read_is_not_silence() -> None:
    # A slow reader holds the router at its yield (backpressure): the upstream is not silent
    # then, and the idle deadline must not run out on it.
    a = Scripted(tokens(10, every_s=0.01))  # each read waits on the upstream a little
    engine = router({"a": a}, a={"idle_timeout_s": 30})

    async def slow_reader() -> Outcome:
        out = Outcome()
        async for delta in engine.generate(chat()):
            out.deltas.append(delta)
            await asyncio.sleep(100.0)  # the client reads one token every 100 s
        return out

    out = virtual_loop.run(slow_reader())
    assert out.error is None and out.text == WHOLE
    assert a.ended_early == [] and failovers(engine) == {}


def test_the_total_deadline_ends_a_slow_answer() -> None:
    a = Scripted(tokens(10, every_s=4.0))
    out = go(router({"a": a}, a={"total_timeout_s": 10, "idle_timeout_s": 30}))
    no_splice_left(out, "upstream_timeout")
    assert out.text == "Once upon"  # at 4 s and 8 s; the third was due at 12 s
    assert out.took == 10.0
    assert out.error is not None and "end within 10 s" in out.error.message
    assert a.ended_early == ["CancelledError"]


def test_the_total_deadline_can_come_before_the_first_token() -> None:
    a = Scripted([20.0, *tokens(10)])
    b = Scripted(answer)
    engine = router({"a": a, "b": b}, a={"total_timeout_s": 10, "first_token_timeout_s": 30})
    out = go(engine)
    assert out.text == WHOLE and out.took == 10.0
    assert failovers(engine) == {"first_token": 1}


def test_a_slow_answer_past_its_total_deadline_is_spliced() -> None:
    a = Scripted(tokens(10, every_s=4.0))
    b = Scripted(answer)
    out = go(router({"a": a, "b": b}, a={"total_timeout_s": 10}))
    assert out.error is None and out.text == WHOLE
    assert out.metas == [{"failover": {"from": "a", "to": "b", "at_token": 2}}]


# -- the splice ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", range(1, len(ANSWER)))
def test_a_cut_after_k_tokens_is_continued_with_no_seam(k: int) -> None:
    a = Scripted([*tokens(k), cut()])
    b = Scripted(answer)
    engine = router({"a": a, "b": b})
    out = go(engine)
    assert out.error is None
    texts = [d.text for d in out.deltas if d.text]
    assert texts == list(ANSWER)  # every token once, in order: no character twice or missing
    meta_at = next(i for i, d in enumerate(out.deltas) if d.meta is not None)
    assert meta_at == k  # the news comes just before the first token of the next leg
    assert out.metas == [{"failover": {"from": "a", "to": "b", "at_token": k}}]
    assert out.finish.finish_reason == "stop"
    # Usage as an uninterrupted answer's: the prompt once, every token delivered.
    assert out.finish.usage == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": len(ANSWER),
        "total_tokens": PROMPT_TOKENS + len(ANSWER),
    }
    follow = b.requests[0]
    assert follow.options["continuation"] == "".join(ANSWER[:k])
    assert follow.body is not None and follow.body["continue_final_message"] is True
    assert follow.body["messages"][-1] == {"role": "assistant", "content": "".join(ANSWER[:k])}
    assert failovers(engine) == {"mid_stream": 1}
    assert health(engine, "a")._failures == 1


def test_the_continuation_asks_only_for_what_is_left_of_max_tokens() -> None:
    a = Scripted([Delta(reasoning="Hmm."), *tokens(2), cut()])
    b = Scripted(answer)
    out = go(router({"a": a, "b": b}), chat(max_tokens=8))
    assert out.error is None
    assert out.text == "".join(ANSWER[:7])  # 1 reasoning + 2 + 5 = 8 tokens in all
    assert out.finish.finish_reason == "length"
    assert b.requests[0].max_tokens == 5
    assert b.requests[0].body is not None and b.requests[0].body["max_tokens"] == 5
    assert out.metas == [{"failover": {"from": "a", "to": "b", "at_token": 3}}]


def test_a_cut_at_max_tokens_is_a_complete_answer() -> None:
    a = Scripted([*tokens(3), cut()])
    b = Scripted(answer)
    out = go(router({"a": a, "b": b}), chat(max_tokens=3))
    assert out.error is None and out.text == "Once upon a"
    assert out.finish.finish_reason == "length"
    assert b.requests == []


def test_max_splices_0_raises_the_cut_after_the_partial_text() -> None:
    a = Scripted([*tokens(4), cut()])
    b = Scripted(answer)
    engine = router({"a": a, "b": b}, max_splices=0)
    out = go(engine)
    no_splice_left(out)
    assert out.text == "Once upon a time"
    assert b.requests == []
    assert failovers(engine) == {}


def test_max_splices_caps_the_splices_of_one_stream() -> None:
    def cut_at_5(request: GenerationRequest) -> list[Any]:
        return [*answer(request)[:3], cut()]

    def legs() -> dict[str, Scripted]:
        return {"a": Scripted([*tokens(2), cut()]), "b": Scripted(cut_at_5), "c": Scripted()}

    capped = legs()
    out = go(router(capped, max_splices=1))
    no_splice_left(out)
    assert out.text == "".join(ANSWER[:5])
    assert capped["c"].requests == []

    two = legs()
    engine = router(two, max_splices=2)
    out = go(engine)
    assert out.error is None and out.text == WHOLE
    assert out.metas == [
        {"failover": {"from": "a", "to": "b", "at_token": 2}},
        {"failover": {"from": "b", "to": "c", "at_token": 5}},
    ]
    assert two["c"].requests[0].options["continuation"] == "".join(ANSWER[:5])
    assert out.finish.usage is not None
    assert out.finish.usage["completion_tokens"] == len(ANSWER)
    assert out.finish.usage["prompt_tokens"] == PROMPT_TOKENS
    assert failovers(engine) == {"mid_stream": 2}


TOOL_START = Delta(tool_calls=(ToolCallDelta(0, id="call_1", name="get_weather"),))
TOOL_ARGS = Delta(tool_calls=(ToolCallDelta(0, arguments='{"city": "Par'),))


@pytest.mark.parametrize(
    "script",
    [
        [TOOL_START, TOOL_ARGS, cut()],  # inside the arguments
        [*tokens(2), TOOL_START, cut()],  # text, then a tool call began
        [Delta(reasoning="Let me"), Delta(reasoning=" think"), cut()],  # open reasoning
        [Delta(refusal="I can't"), cut()],
    ],
    ids=["tool_arguments", "text_then_tool", "reasoning", "refusal"],
)
def test_never_a_splice_inside_a_tool_call_or_reasoning(script: list[Any]) -> None:
    b = Scripted(answer)
    engine = router({"a": Scripted(script), "b": b})
    out = go(engine)
    no_splice_left(out)
    assert len(out.deltas) == len(script) - 1
    assert b.requests == []
    assert out.metas == []


def test_after_reasoning_then_text_it_splices() -> None:
    a = Scripted([Delta(reasoning="Hmm."), *tokens(2), cut()])
    b = Scripted(answer)
    out = go(router({"a": a, "b": b}))
    assert out.error is None and out.text == WHOLE
    assert [d.reasoning for d in out.deltas if d.reasoning] == ["Hmm."]
    assert b.requests[0].options["continuation"] == "Once upon"


def test_a_continuation_refused_by_one_target_goes_to_the_next() -> None:
    a = Scripted([*tokens(3), cut()])
    b = Scripted([Fail("invalid_continuation", retryable=False, status=400, client_fault=True)])
    c = Scripted(answer)
    engine = router({"a": a, "b": b, "c": c}, b={"eject_after": 1})
    out = go(engine)
    assert out.error is None and out.text == WHOLE
    assert out.metas == [{"failover": {"from": "a", "to": "c", "at_token": 3}}]
    assert len(b.requests) == 1
    # A refused prefill says nothing about the target.
    assert health(engine, "b").state == TargetHealth.UP and health(engine, "b")._failures == 0


def test_a_continuation_that_stalls_moves_on_to_the_next() -> None:
    a = Scripted([*tokens(3), cut()])
    b = Scripted([100.0])
    c = Scripted(answer)
    engine = router({"a": a, "b": b, "c": c}, hedge=False, b={"first_token_timeout_s": 30})
    out = go(engine)
    assert out.error is None and out.text == WHOLE and out.took == 30.0
    assert b.ended_early == ["CancelledError"]
    assert out.metas == [{"failover": {"from": "a", "to": "c", "at_token": 3}}]


def test_a_slow_continuation_is_hedged_on_the_next_target() -> None:
    # b will not answer for 100 s: after the hedge delay (200 ms without history) c is asked
    # too, answers first and carries on; b's leg is closed.
    a = Scripted([*tokens(3), cut()])
    b = Scripted([100.0])
    c = Scripted(answer)
    engine = router({"a": a, "b": b, "c": c}, b={"first_token_timeout_s": 30})
    out = go(engine)
    assert out.error is None and out.text == WHOLE
    assert out.took == pytest.approx(0.2)
    assert b.ended_early == ["CancelledError"] and len(c.requests) == 1
    assert out.metas == [{"failover": {"from": "a", "to": "c", "at_token": 3}}]
    assert engine.targets["b"].outstanding == 0 and engine.targets["c"].outstanding == 0


def test_a_hedge_waits_three_times_the_targets_usual_first_token() -> None:
    a = Scripted([*tokens(3), cut()])
    b = Scripted([1.0, *tokens(7, 3), Delta("", "stop")])  # slower than usual, not stalled
    c = Scripted(answer)
    engine = router({"a": a, "b": b, "c": c})
    engine.targets["b"].first_token_s = 0.5  # b usually answers in 0.5 s: hedge at 1.5 s
    out = go(engine)
    assert out.text == WHOLE and c.requests == []
    assert out.metas == [{"failover": {"from": "a", "to": "b", "at_token": 3}}]


def test_when_both_hedged_legs_fail_the_cut_stands() -> None:
    a = Scripted([*tokens(3), cut()])
    b = Scripted([0.5, cut(code="upstream_unavailable", status=503)])
    c = Scripted([0.6, cut(code="upstream_unavailable", status=503)])
    out = go(router({"a": a, "b": b, "c": c}))
    assert out.text == "Once upon a"
    no_splice_left(out)


def test_a_clients_own_prefill_is_kept_through_a_splice() -> None:
    prefill = {"role": "assistant", "content": "Once upon"}
    request = GenerationRequest(
        request_id="s1",
        prompt="user: Tell me a story.",
        model="chat",
        messages=(USER, prefill),
        body={
            "messages": [USER, prefill],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        options={"continuation": "Once upon"},
    )
    a = Scripted(lambda r: [*answer(r)[:2], cut()])
    b = Scripted(answer)
    out = go(router({"a": a, "b": b}), request)
    assert out.error is None
    assert out.text == "".join(ANSWER[2:])  # the answer after the client's own start
    follow = b.requests[0]
    assert follow.options["continuation"] == "Once upon a time"
    assert follow.messages is not None and follow.messages[-1]["content"] == "Once upon a time"
    assert len(follow.messages) == 2
    assert out.finish.usage is not None
    assert out.finish.usage["prompt_tokens"] == PROMPT_TOKENS + 2
    assert out.finish.usage["completion_tokens"] == len(ANSWER) - 2


def test_targets_that_cannot_continue_take_new_requests_but_no_splice() -> None:
    relay = {"continuation": "none"}
    a = Scripted([Fail("upstream_unavailable", status=503)])
    b = Scripted(answer)
    out = go(router({"a": a, "b": b}, b=relay))
    assert out.error is None and out.text == WHOLE  # a failover before any token: fine

    a = Scripted([*tokens(3), cut()])
    b, c = Scripted(answer), Scripted(answer)
    out = go(router({"a": a, "b": b, "c": c}, b=relay))
    assert out.error is None and out.text == WHOLE
    assert b.requests == []
    assert out.metas == [{"failover": {"from": "a", "to": "c", "at_token": 3}}]


def test_with_nobody_to_continue_the_cut_is_raised_after_the_partial_text() -> None:
    a = Scripted([*tokens(3), cut()])
    out = go(router({"a": a, "b": Scripted(answer)}, b={"continuation": "none"}))
    no_splice_left(out)
    assert out.text == "Once upon a"


# -- health as the router feeds it ---------------------------------------------------------------


def test_an_ejected_target_is_skipped_then_probed() -> None:
    a = Scripted([Fail("upstream_unavailable", status=503)], answer)
    b = Scripted(answer)
    engine = router({"a": a, "b": b}, a={"eject_after": 1, "eject_s": 10})

    async def body() -> None:
        assert (await play(engine)).text == WHOLE  # a fails, ejected: b answers
        assert health(engine, "a").state == TargetHealth.EJECTED
        await asyncio.sleep(9)
        assert (await play(engine)).text == WHOLE
        assert (len(a.requests), len(b.requests)) == (1, 2)  # a was skipped
        await asyncio.sleep(1)
        assert (await play(engine)).text == WHOLE  # the half-open probe, answered by a
        assert len(a.requests) == 2
        assert health(engine, "a").state == TargetHealth.UP

    virtual_loop.run(body())


def test_while_the_probe_is_out_other_requests_go_elsewhere() -> None:
    a = Scripted([Fail("upstream_unavailable", status=503)], [*tokens(10, every_s=1.0)])
    b = Scripted(answer)
    engine = router({"a": a, "b": b}, a={"eject_after": 1, "eject_s": 10})

    async def body() -> None:
        await play(engine)  # a ejected
        await asyncio.sleep(10)
        probe = asyncio.create_task(play(engine, chat("probe")))
        await asyncio.sleep(0.5)
        assert health(engine, "a").state == TargetHealth.HALF_OPEN
        other = await play(engine, chat("other"))
        assert other.text == WHOLE and b.requests[-1].request_id == "other"
        assert (await probe).text == WHOLE
        assert health(engine, "a").state == TargetHealth.UP

    virtual_loop.run(body())
    assert len(a.requests) == 2


def test_when_every_target_is_ejected_one_is_tried_anyway() -> None:
    a, b = Scripted(answer), Scripted(answer)
    engine = router({"a": a, "b": b})

    async def body() -> None:
        now = asyncio.get_running_loop().time()
        for name in ("a", "b"):
            for _ in range(3):
                health(engine, name).failure(now)
        assert (await play(engine)).text == WHOLE

    virtual_loop.run(body())
    assert len(a.requests) == 1 and b.requests == []
    assert health(engine, "a").state == TargetHealth.UP


def test_a_429_with_retry_after_holds_the_target_without_ejecting_it() -> None:
    a = Scripted([Fail("upstream_429", status=429, retry_after_s=5)], answer)
    b = Scripted(answer)
    engine = router({"a": a, "b": b}, a={"eject_after": 1})

    async def body() -> None:
        assert (await play(engine)).text == WHOLE
        assert failovers(engine) == {"connect": 1}
        assert health(engine, "a").state == TargetHealth.UP  # a pause asked for, not a fault
        await asyncio.sleep(4.9)
        await play(engine)
        assert (len(a.requests), len(b.requests)) == (1, 2)
        await asyncio.sleep(0.1)
        assert (await play(engine)).text == WHOLE
        assert len(a.requests) == 2

    virtual_loop.run(body())


def test_a_route_whose_targets_are_all_held_is_unavailable() -> None:
    a = Scripted([Fail("upstream_503", status=503, retry_after_s=7)])
    engine = router({"a": a})

    async def body() -> None:
        first = await play(engine)
        assert first.error is not None and first.error.code == "upstream_503"
        await asyncio.sleep(2)
        second = await play(engine)
        assert second.error is not None and second.error.code == "upstream_unavailable"
        assert (second.error.status, second.error.retry_after_s) == (503, 5.0)
        assert len(a.requests) == 1

    virtual_loop.run(body())


def test_a_client_leaving_before_the_first_token_gives_the_probe_back() -> None:
    a = Scripted([100.0])
    engine = router({"a": a}, a={"eject_after": 1, "eject_s": 10})

    async def body() -> None:
        loop = asyncio.get_running_loop()
        health(engine, "a").failure(loop.time())
        await asyncio.sleep(10)
        reader = asyncio.create_task(play(engine))  # the half-open probe
        await asyncio.sleep(5)
        assert health(engine, "a").state == TargetHealth.HALF_OPEN
        reader.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert a.ended_early == ["CancelledError"]
        assert engine.targets["a"].outstanding == 0
        assert health(engine, "a").available(loop.time())  # the next request may probe

    virtual_loop.run(body())


def test_a_client_leaving_mid_answer_closes_the_leg() -> None:
    a = Scripted(tokens(10, every_s=1.0))
    engine = router({"a": a})

    async def body() -> None:
        stream = engine.generate(chat())
        assert (await anext(stream)).text == "Once"
        await engine.abort("s1")
        await stream.aclose()

    virtual_loop.run(body())
    assert a.aborted == ["s1"]
    assert a.ended_early == ["GeneratorExit"]
    assert engine.targets["a"].outstanding == 0 and engine._current == {}


# -- choosing among targets ----------------------------------------------------------------------


def test_least_busy_goes_to_the_target_with_fewest_streams() -> None:
    a = Scripted(tokens(10, every_s=1.0))
    b = Scripted(tokens(10, every_s=1.0))
    engine = router({"a": a, "b": b}, balance="least_busy")

    async def body() -> None:
        together = await asyncio.gather(*(play(engine, chat(f"s{i}")) for i in range(4)))
        assert all(out.text == WHOLE for out in together)
        assert (len(a.requests), len(b.requests)) == (2, 2)
        for i in range(4):  # one at a time: in turns
            await play(engine, chat(f"t{i}"))
        assert (len(a.requests), len(b.requests)) == (4, 4)

    virtual_loop.run(body())


def test_order_sends_everything_to_the_first_target() -> None:
    a, b = Scripted(tokens(10, every_s=1.0)), Scripted(answer)
    engine = router({"a": a, "b": b})

    async def body() -> None:
        await asyncio.gather(*(play(engine, chat(f"s{i}")) for i in range(4)))

    virtual_loop.run(body())
    assert (len(a.requests), len(b.requests)) == (4, 0)


def test_a_full_target_queues_and_times_out_with_queue_timeout() -> None:
    a = Scripted([*tokens(1), 40.0, *tokens(9, 1)])
    engine = router({"a": a}, a={"max_concurrency": 1, "queue_timeout_s": 30, "idle_timeout_s": 60})

    async def body() -> None:
        first = asyncio.create_task(play(engine, chat("s1")))
        await asyncio.sleep(1)
        second = await play(engine, chat("s2"))  # waits in line from 1 s to 31 s
        assert second.took == 30.0 and second.deltas == []
        assert second.error is not None and second.error.code == "queue_timeout"
        assert second.error.status == 503
        # Our own full queue says nothing about the target: not a failure, not a hold.
        assert health(engine, "a")._failures == 0
        third = await play(engine, chat("s3"))  # from 31 s; the slot frees at 40 s
        assert third.error is None and third.text == WHOLE
        assert third.took == 9.0 + 40.0  # its wait, then its own answer's 40 s
        assert (await first).text == WHOLE
        assert engine.targets["a"].outstanding == 0

    virtual_loop.run(body())
    assert len(a.requests) == 2


def test_a_full_target_is_passed_over_for_one_with_room() -> None:
    a = Scripted([*tokens(1), 40.0, *tokens(9, 1)])
    b = Scripted(answer)
    engine = router({"a": a, "b": b}, a={"max_concurrency": 1, "idle_timeout_s": 60})

    async def body() -> None:
        first = asyncio.create_task(play(engine, chat("s1")))
        await asyncio.sleep(1)
        second = await play(engine, chat("s2"))
        assert second.took == 0.0 and second.text == WHOLE
        await first

    virtual_loop.run(body())
    assert (len(a.requests), len(b.requests)) == (1, 1)


# -- start: the shorthand serves what its upstreams list ------------------------------------------


def passthrough(engines: dict[str, Scripted]) -> RoutedEngine:
    table = RouteTable(
        targets={n: TargetConfig(name=n, kind="openai", url="http://h/v1") for n in engines},
        routes={"default": ModelRoute(name="default", targets=tuple(engines), passthrough=True)},
    )
    return RoutedEngine(table, {n: Target(table.targets[n], e) for n, e in engines.items()})


def test_the_shorthand_serves_the_models_its_upstreams_list() -> None:
    a = Scripted(answer, models=("qwen", "llama"))
    b = Scripted(answer, models=("llama", "phi"))
    engine = passthrough({"a": a, "b": b})

    async def body() -> None:
        await engine.start()
        assert engine.models == ("qwen", "llama", "phi")
        await play(engine, replace(chat(), model="llama"))
        await play(engine, replace(chat(), model="default"))
        await engine.close()

    virtual_loop.run(body())
    assert a.started and a.closed and b.started
    # As the client named it; the route's own name becomes the upstream's first model.
    assert [r.model for r in a.requests] == ["llama", "qwen"]


def test_the_shorthand_refuses_to_start_when_no_upstream_lists_a_model() -> None:
    a = Scripted(answer, models=())
    engine = passthrough({"a": a})
    with pytest.raises(RuntimeError, match=r"relay: no upstream answered GET /models"):
        virtual_loop.run(engine.start())
    assert a.closed


def test_active_checks_eject_a_silent_target_and_bring_it_back() -> None:
    class Remote(Scripted):
        answering = False

        async def fetch_models(self) -> tuple[str, ...] | None:
            return ("m",) if self.answering else None

    a = Remote(answer)
    table = RouteTable(
        targets={
            "a": TargetConfig(name="a", kind="openai", url="http://h/v1", health_check_interval_s=5)
        },
        routes={"chat": ModelRoute(name="chat", targets=("a",))},
    )
    engine = RoutedEngine(table, {"a": Target(table.targets["a"], a)})

    async def body() -> None:
        await engine.start()
        await asyncio.sleep(14)
        assert health(engine, "a").state == TargetHealth.UP  # two failed checks of three
        await asyncio.sleep(1)
        assert health(engine, "a").state == TargetHealth.EJECTED
        a.answering = True
        await asyncio.sleep(5)
        assert health(engine, "a").state == TargetHealth.UP
        await engine.close()

    virtual_loop.run(body())


# -- what the router tells /metrics --------------------------------------------------------------


def test_metrics_carry_failovers_target_state_and_queues() -> None:
    a = Scripted([*tokens(3), cut()])
    engine = router({"a": a, "b": Scripted(answer)}, a={"eject_after": 1})
    go(engine)
    families = {m.name: m for m in engine.collect()}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in families.values()
        for s in m.samples
    }
    mid = ("firsttoken_failovers_total", (("phase", "mid_stream"), ("route", "chat")))
    assert samples[mid] == 1
    assert samples[("firsttoken_target_up", (("target", "a"),))] == 0
    assert samples[("firsttoken_target_up", (("target", "b"),))] == 1
    assert samples[("firsttoken_queue_length", (("target", "a"),))] == 0
    assert engine.counters()["failovers"] == 1


def test_a_splice_prefers_a_target_that_is_not_failing_right_now() -> None:
    # b has just failed another stream (a silence, not yet enough to eject it): the splice
    # goes to c, whose first token comes at once, rather than wait out b's deadline.
    a = Scripted([*tokens(3), cut()])
    b = Scripted(answer)
    c = Scripted(answer)
    engine = router({"a": a, "b": b, "c": c})
    engine.targets["b"].health.failure(START)
    out = go(engine)
    assert out.error is None and out.text == WHOLE
    assert out.metas == [{"failover": {"from": "a", "to": "c", "at_token": 3}}]
    assert b.requests == []


# -- edge and center: the hand-off, short prompts, sessions ----------------------------------


# The hand-off by count alone: no prefill, no pace (the seam's timing has its own tests).
BY_COUNT: dict[str, Any] = {"prefill": False, "pace_ms": 0}


def tiers(
    edge: Scripted, center: Scripted, *, handoff: Handoff | None = None, **route: Any
) -> RoutedEngine:
    """Route `chat` over `center`, with `edge` as its hand-off or short-prompt target."""
    table = RouteTable(
        targets={
            n: TargetConfig(name=n, kind="synthetic", continuation="native")
            for n in ("edge", "center")
        },
        routes={"chat": ModelRoute(name="chat", targets=("center",), handoff=handoff, **route)},
    )
    engines = {"edge": edge, "center": center}
    return RoutedEngine(table, {n: Target(table.targets[n], e) for n, e in engines.items()})


def test_the_edge_starts_and_the_center_continues_after_n_tokens() -> None:
    edge, center = Scripted(answer), Scripted(answer)
    engine = tiers(edge, center, handoff=Handoff("edge", after_tokens=3, **BY_COUNT))
    out = go(engine)
    assert out.error is None and out.text == WHOLE
    assert out.metas == [{"handoff": {"from": "edge", "to": "center", "at_token": 3}}]
    assert edge.ended_early == ["GeneratorExit"]  # the edge's leg was closed at the hand-off
    assert center.requests[0].options["continuation"] == "Once upon a"
    assert engine.handoffs == {"chat": 1} and failovers(engine) == {}
    # Usage is the whole answer's, as from one engine.
    assert out.finish.usage == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": len(ANSWER),
        "total_tokens": PROMPT_TOKENS + len(ANSWER),
    }


def test_a_hand_off_at_a_sentence_end_waits_for_one() -> None:
    edge, center = Scripted(answer), Scripted(answer)
    handoff = Handoff("edge", after_tokens=2, at="sentence", **BY_COUNT)
    engine = tiers(edge, center, handoff=handoff)
    out = go(engine)
    assert out.text == WHOLE
    # "Once upon a time," ends no sentence: the edge goes on past its 2 tokens to the first
    # sentence end (here the answer's last token), and the center only closes the answer.
    assert out.metas == [{"handoff": {"from": "edge", "to": "center", "at_token": 10}}]


def test_a_center_that_cannot_take_it_leaves_the_edge_to_finish() -> None:
    edge = Scripted(answer)
    center = Scripted([Fail("upstream_unavailable", status=503)])
    engine = tiers(edge, center, handoff=Handoff("edge", after_tokens=3, **BY_COUNT))
    out = go(engine)
    assert out.error is None and out.text == WHOLE
    assert out.metas == [
        {"handoff": {"from": "edge", "to": "edge", "at_token": 3, "fallback": True}}
    ]
    assert engine.handoffs == {"chat": 0}


def test_without_fallback_a_center_that_cannot_take_it_is_an_honest_error() -> None:
    edge = Scripted(answer)
    center = Scripted([Fail("upstream_unavailable", status=503)])
    handoff = Handoff("edge", after_tokens=3, fallback=False, **BY_COUNT)
    engine = tiers(edge, center, handoff=handoff)
    out = go(engine)
    assert out.text == "Once upon a"
    no_splice_left(out, "upstream_unavailable")


def test_a_short_answer_at_the_edge_is_never_handed_off() -> None:
    edge, center = Scripted(answer), Scripted(answer)
    engine = tiers(edge, center, handoff=Handoff("edge", after_tokens=50, **BY_COUNT))
    out = go(engine)
    assert out.text == WHOLE and out.metas == [] and center.requests == []


def test_short_prompts_go_to_the_small_target_first() -> None:
    edge, center = Scripted(answer), Scripted(answer)
    rule = ShortPrompts("edge", max_prompt_tokens=PROMPT_TOKENS)
    assert go(tiers(edge, center, short_prompts=rule)).text == WHOLE
    assert len(edge.requests) == 1 and center.requests == []
    long = ShortPrompts("edge", max_prompt_tokens=PROMPT_TOKENS - 1)
    assert go(tiers(edge, center, short_prompts=long)).text == WHOLE
    assert len(edge.requests) == 1 and len(center.requests) == 1


def test_a_prompt_too_long_to_be_short_is_not_tokenized() -> None:
    # Issue 37.5: the edge's tokenizer ran on every prompt, 878 KiB ones included, on the
    # event loop; past 16 characters a token allowed, no tokenizer finds it short.
    edge, center = Scripted(answer), Scripted(answer)
    rule = ShortPrompts("edge", max_prompt_tokens=64)
    engine = tiers(edge, center, short_prompts=rule)
    assert go(engine, replace(chat(), prompt="a " * 450_000)).text == WHOLE
    assert edge.counted == [] and edge.requests == [] and len(center.requests) == 1
    assert go(engine, replace(chat(), prompt="x" * 64 * MAX_CHARS_PER_TOKEN)).text == WHOLE
    assert edge.counted == [64 * MAX_CHARS_PER_TOKEN] and len(edge.requests) == 1


def test_session_balance_keeps_a_conversation_on_one_target() -> None:
    engines = {n: Scripted(answer) for n in ("a", "b", "c")}
    engine = router(engines, balance="session")

    def ask(user: str) -> str:
        body_user = {"role": "user", "content": user}
        request = replace(chat(user), messages=(body_user,), prompt=f"user: {user}")
        go(engine, request)
        return next(
            n
            for n, e in engines.items()
            if e.requests and e.requests[-1] is not None and e.requests[-1].request_id == user
        )

    homes = {user: ask(user) for user in (f"conversation {i}" for i in range(12))}
    assert len(set(homes.values())) > 1  # sessions spread over the targets
    assert all(ask(user) == home for user, home in homes.items())  # and stay put


def test_a_splice_passes_over_a_target_silent_on_all_its_streams() -> None:
    # b has a stream running that has had no chunk for a second (a stall its deadlines have
    # not caught yet): the continuation goes to c.
    a = Scripted([*tokens(3), cut()])
    b, c = Scripted(answer), Scripted(answer)
    engine = router({"a": a, "b": b, "c": c})

    async def body() -> Outcome:
        loop = asyncio.get_running_loop()
        engine.targets["b"].outstanding = 1  # someone else's stream, quiet since START
        engine.targets["b"].last_chunk_at = loop.time()
        await asyncio.sleep(1.0)
        return await play(engine)

    out = virtual_loop.run(body())
    assert out.text == WHOLE
    assert out.metas == [{"failover": {"from": "a", "to": "c", "at_token": 3}}]
    assert b.requests == []


def test_a_short_prompt_is_answered_whole_by_the_small_target_even_with_a_handoff() -> None:
    edge, center = Scripted(answer), Scripted(answer)
    rule = ShortPrompts("edge", max_prompt_tokens=PROMPT_TOKENS)
    handoff = Handoff("edge", after_tokens=3, **BY_COUNT)
    engine = tiers(edge, center, handoff=handoff, short_prompts=rule)
    out = go(engine)
    assert out.text == WHOLE and out.metas == [] and center.requests == []


# -- the seam: a prefill at the start, the edge's text paced, the hand-off by time -------------


class Words:
    """A model that answers " w0 w1 …" (`n` words): `ttft_s` to its first token (a prefill
    included), then one every `itl_s`; a continuation of the first k words, once a prefill
    of the conversation was asked, `warm_s` after that prefill is done (its prefix is
    cached), else `ttft_s`."""

    def __init__(self, n: int, *, ttft_s: float, itl_s: float, warm_s: float = 0.0) -> None:
        self.words = [f" w{i}" for i in range(n)]
        self.ttft_s, self.itl_s, self.warm_s = ttft_s, itl_s, warm_s
        self.ready_at: float | None = None  # when the prefill of the conversation is done

    def __call__(self, request: GenerationRequest) -> list[Any]:
        prefix = request.options.get("continuation", "")
        starts = ["".join(self.words[:k]) for k in range(len(self.words) + 1)]
        if prefix not in starts:
            return [Fail("invalid_continuation", retryable=False, status=400, client_fault=True)]
        k = starts.index(prefix)
        now = asyncio.get_running_loop().time()
        first = self.ttft_s
        if k and self.ready_at is not None:
            first = max(self.ready_at, now) - now + self.warm_s
        if not k and request.max_tokens == 1:  # a prefill (the tests' answers ask no limit)
            self.ready_at = now + self.ttft_s
        rest = self.words[k:]
        if request.max_tokens is not None:
            rest = rest[: request.max_tokens]
        steps: list[Any] = []
        for i, word in enumerate(rest):
            steps += [first if i == 0 else self.itl_s, Delta(word)]
        return [*steps, Delta("", finish_reason="stop")]


@dataclass
class Timed:
    deltas: list[tuple[float, Delta]] = field(default_factory=list)
    error: EngineError | None = None

    @property
    def text(self) -> str:
        return "".join(d.text for _, d in self.deltas)

    @property
    def texts(self) -> list[float]:
        return [t for t, d in self.deltas if d.text]

    def longest_gap(self) -> float:
        times = self.texts
        return max(b - a for a, b in itertools.pairwise(times))

    @property
    def metas(self) -> list[Any]:
        """The seams' meta events (the prefill's bill: `prefills`)."""
        return [d.meta for _, d in self.deltas if d.meta is not None and "prefill" not in d.meta]

    @property
    def prefills(self) -> list[Any]:
        return [d.meta["prefill"] for _, d in self.deltas if d.meta and "prefill" in d.meta]


def timed(engine: RoutedEngine, request: GenerationRequest | None = None) -> Timed:
    async def body() -> Timed:
        loop = asyncio.get_running_loop()
        start = loop.time()
        out = Timed()
        try:
            async for delta in engine.generate(request or chat()):
                out.deltas.append((loop.time() - start, delta))
        except EngineError as exc:
            out.error = exc
        return out

    return virtual_loop.run(body())


def seam_tiers(*centers: Scripted, edge: Scripted, **handoff: Any) -> RoutedEngine:
    names = [f"center{i}" for i in range(len(centers))]
    table = RouteTable(
        targets={
            n: TargetConfig(name=n, kind="synthetic", continuation="native")
            for n in ("edge", *names)
        },
        routes={
            "chat": ModelRoute(
                name="chat",
                targets=tuple(names),
                handoff=Handoff("edge", **{"after_tokens": 40, **handoff}),
            )
        },
    )
    engines = {"edge": edge, **dict(zip(names, centers, strict=True))}
    return RoutedEngine(table, {n: Target(table.targets[n], e) for n, e in engines.items()})


def whole_words(n: int) -> str:
    return "".join(f" w{i}" for i in range(n))


def test_a_slow_center_takes_over_without_a_pause_when_prefilled_and_paced() -> None:
    # The edge: 0.1 s to its first token, then 15 ms a token. The center: 0.9 s to a first
    # token (its prefill), 0.1 s on a warm continuation, then 20 ms a token.
    edge = Scripted(Words(60, ttft_s=0.1, itl_s=0.015))
    center = Scripted(Words(60, ttft_s=0.9, itl_s=0.02, warm_s=0.1))
    engine = seam_tiers(center, edge=edge, pace_ms=50)
    engine.targets["center0"].prefill_s = 0.9  # learned from earlier answers
    engine.targets["center0"].handoff_s = 0.1
    out = timed(engine)
    assert out.error is None and out.text == whole_words(60)
    assert out.texts[0] == pytest.approx(0.1)  # the first token is the edge's
    assert out.longest_gap() <= 0.05 + 1e-9  # never a pause longer than the pace
    [meta] = out.metas
    at = meta["handoff"]["at_token"]
    assert 1 < at < 40  # by time, before the bound
    # The center's continuation is of exactly the text the client read before the seam.
    continued = [r for r in center.requests if "continuation" in r.options]
    assert [r.options["continuation"] for r in continued] == [whole_words(at)]
    assert center.requests[0].request_id == prefill_id("s1")
    # The prefill is billed: its meta event comes just before the answer's last delta.
    assert out.prefills == [{"target": "center0"}]
    assert out.deltas[-2][1].meta == {"prefill": {"target": "center0"}}
    assert out.deltas[-1][1].finish_reason is not None
    # Not much later than the center alone (0.9 + 59 x 20 ms = 2.08 s).
    assert out.texts[-1] < 2.08 * 1.1


def test_a_center_faster_than_the_edge_takes_over_at_the_first_boundary_once_ready() -> None:
    edge = Scripted(Words(30, ttft_s=0.3, itl_s=0.05))
    center = Scripted(Words(30, ttft_s=0.05, itl_s=0.01, warm_s=0.01))
    out = timed(seam_tiers(center, edge=edge, pace_ms=50))
    assert out.text == whole_words(30)
    # Ready at 0.05 s, before the edge's first token (0.3 s): the edge says one token.
    assert out.metas == [{"handoff": {"from": "edge", "to": "center0", "at_token": 1}}]


def test_a_prefill_the_center_refused_is_not_billed() -> None:
    words = Words(30, ttft_s=0.05, itl_s=0.01)

    def refuses_prefills(request: GenerationRequest) -> list[Any]:
        if request.max_tokens == 1:
            return [Fail("upstream_overloaded", retryable=True, status=503)]
        return words(request)

    edge = Scripted(Words(30, ttft_s=0.1, itl_s=0.015))
    out = timed(seam_tiers(Scripted(refuses_prefills), edge=edge, after_tokens=8, pace_ms=0))
    assert out.error is None and out.text == whole_words(30)
    assert [m["handoff"]["at_token"] for m in out.metas] == [8]  # by count, as no prefill
    assert out.prefills == []


def test_without_prefill_and_pace_the_hand_off_is_after_exactly_n_tokens() -> None:
    edge = Scripted(Words(30, ttft_s=0.1, itl_s=0.015))
    center = Scripted(Words(30, ttft_s=0.9, itl_s=0.02, warm_s=0.1))
    out = timed(seam_tiers(center, edge=edge, after_tokens=8, prefill=False, pace_ms=0))
    assert out.text == whole_words(30)
    assert out.metas == [{"handoff": {"from": "edge", "to": "center0", "at_token": 8}}]
    assert out.longest_gap() == pytest.approx(0.9)  # the seam: the center's whole delay
    assert [r.request_id for r in center.requests] == ["s1"]
    assert out.prefills == []  # none asked: none billed


def test_the_center_learns_its_delay_and_the_next_answer_hands_off_by_it() -> None:
    edge = Scripted(Words(60, ttft_s=0.1, itl_s=0.015))
    center = Scripted(Words(60, ttft_s=0.6, itl_s=0.02, warm_s=0.2))
    engine = seam_tiers(center, edge=edge, pace_ms=50)
    first = timed(engine, chat("s1"))
    target = engine.targets["center0"]
    assert target.prefill_s == pytest.approx(0.6) and target.handoff_s is not None
    center.scripts = (Words(60, ttft_s=0.6, itl_s=0.02, warm_s=0.2),)  # a fresh cache
    second = timed(engine, chat("s2"))
    assert first.text == second.text == whole_words(60)
    assert second.longest_gap() <= 0.05 + 1e-9


def test_a_center_that_breaks_after_the_hand_off_is_spliced_onto_the_next() -> None:
    edge = Scripted(Words(60, ttft_s=0.1, itl_s=0.015))
    words = Words(60, ttft_s=0.3, itl_s=0.02, warm_s=0.05)

    def breaks(request: GenerationRequest) -> list[Any]:
        steps = words(request)
        if "continuation" in request.options:
            return [*steps[:10], cut()]  # five tokens, then the connection drops
        return steps

    broken = Scripted(breaks)
    spare = Scripted(Words(60, ttft_s=0.3, itl_s=0.02, warm_s=0.05))
    out = timed(seam_tiers(broken, spare, edge=edge, pace_ms=50))
    assert out.error is None and out.text == whole_words(60)
    handoff, failover = out.metas
    assert handoff["handoff"]["to"] == "center0"
    assert failover["failover"]["from"] == "center0"
    assert failover["failover"]["to"] == "center1"
    # The seam of the splice is the spare's whole first-token time, well inside the route's
    # idle deadline (30 s): no pause above twice it.
    assert out.longest_gap() <= 0.3 + 0.05


def test_a_center_that_refuses_the_hand_off_leaves_the_edge_to_finish_it_paced() -> None:
    edge = Scripted(Words(60, ttft_s=0.1, itl_s=0.015))

    def refuses(request: GenerationRequest) -> list[Any]:
        if "continuation" in request.options:
            return [0.05, Fail("upstream_unavailable", status=503)]
        return Words(60, ttft_s=0.2, itl_s=0.02)(request)

    out = timed(seam_tiers(Scripted(refuses), edge=edge, pace_ms=50))
    assert out.error is None and out.text == whole_words(60)
    assert [m["handoff"]["to"] for m in out.metas] == ["edge"]
    assert out.longest_gap() <= 0.05 + 0.1  # the held text covers the refusal's time


def test_a_client_leaving_mid_hand_off_closes_the_prefill_and_every_leg() -> None:
    edge = Scripted(Words(60, ttft_s=0.1, itl_s=0.015))
    center = Scripted(Words(60, ttft_s=5.0, itl_s=0.02))
    engine = seam_tiers(center, edge=edge, pace_ms=50)

    async def body() -> None:
        stream = engine.generate(chat())
        for _ in range(3):
            await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    virtual_loop.run(body())
    assert edge.ended_early and center.ended_early  # the edge's leg and the prefill
    assert all(t.outstanding == 0 for t in engine.targets.values())


def test_a_center_that_breaks_after_the_hand_off_alone_leaves_the_edge_to_finish() -> None:
    edge = Scripted(Words(60, ttft_s=0.1, itl_s=0.015))
    words = Words(60, ttft_s=0.3, itl_s=0.02, warm_s=0.05)

    def breaks(request: GenerationRequest) -> list[Any]:
        steps = words(request)
        return [*steps[:10], cut()] if "continuation" in request.options else steps

    out = timed(seam_tiers(Scripted(breaks), edge=edge, pace_ms=50))
    assert out.error is None and out.text == whole_words(60)
    handoff, failover = out.metas
    assert handoff["handoff"]["to"] == "center0"
    assert failover["failover"] == {
        "from": "center0",
        "to": "edge",
        "at_token": handoff["handoff"]["at_token"] + 5,
    }
    # The edge's own first token after the cut (0.1 s): no pause of a deadline's size.
    assert out.longest_gap() <= 0.1 + 0.02
    without = timed(seam_tiers(Scripted(breaks), edge=edge, pace_ms=50, fallback=False))
    assert without.error is not None and without.error.code == "upstream_truncated"
    assert all(d.finish_reason is None for _, d in without.deltas)  # never passed off whole


def test_an_edge_slower_than_the_pace_hands_off_once_the_center_is_ready() -> None:
    # Nothing can be held back (80 ms a token against a 50 ms pace): waiting for the bound
    # would only make the center read more of the edge's text.
    edge = Scripted(Words(60, ttft_s=0.1, itl_s=0.08))
    center = Scripted(Words(60, ttft_s=0.5, itl_s=0.02, warm_s=0.2))
    engine = seam_tiers(center, edge=edge, pace_ms=50)
    engine.targets["center0"].handoff_s = 0.2  # its warm delay is known
    out = timed(engine)
    assert out.text == whole_words(60)
    [meta] = out.metas
    # Ready at 0.5 s; the edge's tokens come at 0.1, 0.18, ... 0.42, 0.5: the boundary at
    # 0.5 s, its 6th token (not the bound, 40).
    assert meta["handoff"]["at_token"] == 6


# -- embeddings: the route's targets in order, before the answer ---------------------------------


class Embedder(Scripted):
    """A target whose n-th embeddings request fails with the n-th error (None: answers)."""

    def __init__(self, *failures: EngineError | None) -> None:
        super().__init__()
        self.failures = list(failures)
        self.embedded: list[EmbeddingRequest] = []

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        self.embedded.append(request)
        failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            raise failure
        return Embeddings({"object": "list", "data": [], "model": request.model}, 3)


def embedding(model: str = "chat") -> EmbeddingRequest:
    return EmbeddingRequest("e1", model, ("hello",), {"model": model, "input": "hello"})


def test_embeddings_come_from_the_first_target_under_its_own_model_name() -> None:
    a, b = Embedder(None), Embedder(None)
    engine = router({"a": a, "b": b}, a={"model": "BAAI/bge-m3"})
    answer = virtual_loop.run(engine.embed(embedding()))
    assert answer.target == "a" and answer.prompt_tokens == 3
    assert [r.model for r in a.embedded] == ["BAAI/bge-m3"] and b.embedded == []


def test_a_target_down_for_embeddings_hands_them_to_the_next() -> None:
    a = Embedder(EngineError("upstream_unavailable", "refused", retryable=True, status=503))
    b = Embedder(None)
    engine = router({"a": a, "b": b})
    answer = virtual_loop.run(engine.embed(embedding()))
    assert answer.target == "b" and len(a.embedded) == len(b.embedded) == 1
    assert health(engine, "a")._failures == 1


def test_a_refused_embeddings_request_is_the_clients_answer_not_a_failover() -> None:
    refused = EngineError("upstream_rejected", "bad input", status=400, client_fault=True)
    a, b = Embedder(refused), Embedder(None)
    engine = router({"a": a, "b": b})

    async def ask() -> EngineError | None:
        try:
            await engine.embed(embedding())
        except EngineError as exc:
            return exc
        return None

    error = virtual_loop.run(ask())
    assert error is not None and error.code == "upstream_rejected" and error.target == "a"
    assert b.embedded == [] and health(engine, "a")._failures == 0


def test_a_target_without_embeddings_says_so_as_a_404() -> None:
    engine = router({"a": Scripted(answer)})

    async def ask() -> EngineError | None:
        try:
            await engine.embed(embedding())
        except EngineError as exc:
            return exc
        return None

    error = virtual_loop.run(ask())
    assert error is not None and error.code == "embeddings_not_served" and error.status == 404


def test_a_request_has_its_prompt_read_once_it_holds_its_targets_slot() -> None:
    a = Scripted([5.0, *tokens(10, 1)])  # 5 s to its first token
    engine = router({"a": a}, a={"max_concurrency": 1, "queue_timeout_s": 30, "idle_timeout_s": 60})

    async def body() -> None:
        first = asyncio.create_task(play(engine, chat("s1")))
        second = asyncio.create_task(play(engine, chat("s2")))
        await asyncio.sleep(1)
        # s1 is in its prefill at the target; s2 waits in line: a client leaving now would
        # owe s1's prompt, not s2's (no engine has read it).
        assert engine.has_prompt("s1") and not engine.has_prompt("s2")
        await first
        await asyncio.sleep(1)
        assert engine.has_prompt("s2")
        await second

    virtual_loop.run(body())
