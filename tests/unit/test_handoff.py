"""The hand-off policy alone, on virtual time: when an answer gets one, the prefill asked of
the likely center, when the edge's part ends, the edge's fallback, the hand-off's meta and
count, the prefill's bill, and the pace of the edge's text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from firsttoken.generation import Delta, EngineError, GenerationRequest
from firsttoken.routing.config import Handoff, ModelRoute, TargetConfig
from firsttoken.routing.course import Course, Event, State, plan
from firsttoken.routing.handoff import Handoffs, Handover, paced, prefill_meta
from firsttoken.routing.seam import EdgePacer, Seam, prefill_id
from firsttoken.routing.splice import Transcript
from firsttoken.routing.target import Target
from tests.unit import virtual_loop
from tests.unit.scripted import Fail, Scripted, Step

REQUEST = GenerationRequest(
    request_id="s1",
    prompt="user: hi",
    model="chat",
    messages=({"role": "user", "content": "hi"},),
)
START = virtual_loop.START


class Said:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, level: int = 0, **fields: Any) -> None:
        self.events.append((event, fields))


class Tiers:
    """An edge and centers `a`, `b`; legs read straight from each target's engine."""

    def __init__(self, *, center: list[Step] | None = None, **handoff: Any) -> None:
        self.engines = {
            "edge": Scripted(),
            "a": Scripted(center or [0.4, Delta("x")]),
            "b": Scripted(),
        }
        self.targets = {
            n: Target(TargetConfig(name=n, kind="synthetic", continuation="native"), e)
            for n, e in self.engines.items()
        }
        self.route = ModelRoute(
            name="chat",
            targets=("a", "b"),
            handoff=Handoff(**{"source": "edge", "after_tokens": 4, **handoff}),
        )
        self.said = Said()
        self.policy = Handoffs(self.targets, {"chat": self.route}, self.said, self._leg)

    async def _leg(
        self, target: Target, request: GenerationRequest, route: ModelRoute
    ) -> AsyncGenerator[Delta, None]:
        async for delta in target.engine.generate(request):
            yield delta

    def course(self, request: GenerationRequest = REQUEST) -> Course:
        course, _ = plan(self.route, request, self.targets)
        self.policy.plan(course)
        return course


def on_loop(body: Any) -> Any:
    return virtual_loop.run(body())


# -- the plan --------------------------------------------------------------------------------


def test_an_answer_gets_its_edge_a_paced_seam_and_a_prefill_of_the_likely_center() -> None:
    tiers = Tiers(pace_ms=50)

    async def body() -> tuple[Handover | None, bool]:
        course = tiers.course()
        handover = course.handover
        assert handover is not None and handover.prefill is not None
        ready = await handover.prefill
        return handover, ready

    handover, ready = on_loop(body)
    assert handover is not None and ready
    assert handover.edge is tiers.targets["edge"] and handover.prefill_to == "a"
    assert handover.pacer is not None and handover.pacer.pace_s == 0.05
    assert handover.seam.prefill and handover.seam.ready_at == START + 0.4
    asked = tiers.engines["a"].requests[0]
    assert asked.request_id == prefill_id("s1") and asked.max_tokens == 1
    assert tiers.targets["a"].prefill_s == pytest.approx(0.4)


def test_no_hand_off_for_a_continuation_or_an_edge_that_cannot_take_it() -> None:
    tiers = Tiers()

    async def body() -> list[Handover | None]:
        handovers = [
            tiers.course(
                GenerationRequest(
                    request_id="s2", prompt="p", model="chat", options={"continuation": "x"}
                )
            ).handover
        ]
        tiers.targets["edge"].health.hold(START, 5.0)
        handovers.append(tiers.course().handover)
        return handovers

    assert on_loop(body) == [None, None]
    assert tiers.engines["a"].requests == []  # and no prefill asked


def test_without_prefill_the_seam_waits_the_centers_usual_first_token_and_no_pace() -> None:
    tiers = Tiers(prefill=False, pace_ms=0)
    tiers.targets["a"].first_token_s = 0.3

    async def body() -> Handover | None:
        return tiers.course().handover

    handover = on_loop(body)
    assert handover is not None and handover.prefill is None and handover.pacer is None
    assert not handover.seam.prefill and handover.seam.warm_s == 0.3


def test_the_likely_center_is_one_that_can_continue_and_is_up() -> None:
    tiers = Tiers()
    tiers.targets["a"].health.hold(START, 5.0)

    async def body() -> Target | None:
        course, _ = plan(tiers.route, REQUEST, tiers.targets)
        return tiers.policy.likely_center(course)

    assert on_loop(body) is tiers.targets["b"]


def test_a_prefill_the_center_refused_is_said_and_not_billed() -> None:
    tiers = Tiers(center=[Fail("bad_request", retryable=False, status=400, client_fault=True)])

    async def body() -> tuple[bool, Handover | None]:
        course = tiers.course()
        assert course.handover is not None and course.handover.prefill is not None
        return await course.handover.prefill, course.handover

    ready, handover = on_loop(body)
    assert not ready and handover is not None and prefill_meta(handover) is None
    assert [e for e, _ in tiers.said.events] == ["route.prefill_failed"]


def test_the_prefill_is_billed_once_before_the_last_delta() -> None:
    async def body() -> list[Delta | None]:
        loop = asyncio.get_running_loop()
        handover = Handover(
            Target(TargetConfig(name="e", kind="synthetic"), Scripted()), Seam(4), None
        )
        handover.prefill = loop.create_task(asyncio.sleep(0, result=True))
        handover.prefill_to = "a"
        await handover.prefill
        return [prefill_meta(handover), prefill_meta(handover)]

    first, again = on_loop(body)
    assert first is not None and first.meta == {"prefill": {"target": "a"}} and again is None


# -- during the answer -----------------------------------------------------------------------


def test_the_edge_goes_first_once() -> None:
    tiers = Tiers()

    async def body() -> list[Target | None]:
        course = tiers.course()
        return [tiers.policy.first_leg(course), tiers.policy.first_leg(course)]

    assert on_loop(body) == [tiers.targets["edge"], None]


def test_the_edges_part_ends_at_after_tokens_never_on_its_finish() -> None:
    async def body() -> list[bool]:
        policy = Tiers().policy
        edge = Target(TargetConfig(name="e", kind="synthetic"), Scripted())
        handover = Handover(edge, Seam(3), None)
        transcript = Transcript()
        ends = []
        for text in ("a", " b", " c"):
            delta = Delta(text)
            transcript.add(delta)
            ends.append(policy.hands_off(handover, transcript, delta))
        ends.append(policy.hands_off(handover, transcript, Delta(" d", "stop")))
        return ends

    assert on_loop(body) == [False, False, True, False]


def handed(tiers: Tiers) -> Course:
    """An answer whose edge's part is done: in HANDOFF, the center asked."""
    course = tiers.course()
    edge = tiers.policy.first_leg(course)
    assert edge is not None
    course.begin_leg(edge)
    course.to(Event.FIRST_DELTA)
    course.to(Event.HANDED)
    tiers.policy.handing_over(course)
    return course


def test_the_center_that_takes_over_is_counted_said_and_met_with_a_meta_event() -> None:
    tiers = Tiers(pace_ms=0)

    async def body() -> Delta:
        course = handed(tiers)
        course.to(Event.FIRST_DELTA)
        return tiers.policy.took(course, tiers.targets["a"], 4)

    meta = on_loop(body)
    assert meta.meta == {"handoff": {"from": "edge", "to": "a", "at_token": 4}}
    assert tiers.policy.counts == {"chat": 1}
    assert tiers.said.events[-1][0] == "route.handoff"


def test_with_no_center_the_edge_finishes_once_as_a_fallback_not_counted() -> None:
    tiers = Tiers(pace_ms=0)

    async def body() -> tuple[Target | None, Delta, str]:
        course = handed(tiers)
        back = tiers.policy.fallback(course)
        course.to(Event.FIRST_DELTA)
        meta = tiers.policy.took(course, tiers.targets["edge"], 4)
        course.to(Event.BROKE)
        course.cut = EngineError("upstream_truncated", "cut", retryable=True)
        with pytest.raises(EngineError):  # once: the fallback is spent
            course.state = State.HANDOFF
            tiers.policy.fallback(course)
        return back, meta, course.state.value

    back, meta, _ = on_loop(body)
    assert back is tiers.targets["edge"]
    assert meta.meta == {"handoff": {"from": "edge", "to": "edge", "at_token": 4, "fallback": True}}
    assert tiers.policy.counts == {"chat": 0}


def test_without_fallback_a_hand_off_nobody_takes_is_503() -> None:
    tiers = Tiers(fallback=False)

    async def body() -> None:
        course = handed(tiers)
        with pytest.raises(EngineError) as raised:
            tiers.policy.fallback(course)
        assert raised.value.code == "upstream_unavailable" and raised.value.status == 503

    on_loop(body)


def test_a_center_that_breaks_after_taking_over_leaves_the_edge_to_finish() -> None:
    tiers = Tiers()

    async def body() -> Target | None:
        course = handed(tiers)
        course.to(Event.FIRST_DELTA)
        course.handoffs = 1
        course.to(Event.BROKE)
        course.cut = EngineError("upstream_truncated", "cut", retryable=True)
        return tiers.policy.fallback(course)

    assert on_loop(body) is tiers.targets["edge"]


def test_a_plain_failover_has_no_fallback() -> None:
    tiers = Tiers()

    async def body() -> Target | None:
        course = tiers.course()
        course.to(Event.REFUSED)
        return tiers.policy.fallback(course)

    assert on_loop(body) is None


def test_the_center_learns_its_delay_from_its_readiness_to_its_first_token() -> None:
    tiers = Tiers(pace_ms=0)

    async def body() -> None:
        course = handed(tiers)
        assert course.handover is not None
        course.handover.seam.prefill = True
        course.handover.seam.ready_at = START - 1.0  # ready before it was asked
        await asyncio.sleep(0.25)
        course.to(Event.FIRST_DELTA)
        tiers.policy.took(course, tiers.targets["b"], 4)

    on_loop(body)
    assert tiers.targets["b"].handoff_s == pytest.approx(0.25)


# -- the pace --------------------------------------------------------------------------------


async def deltas(*steps: Step) -> AsyncIterator[Delta]:
    async for delta in Scripted(list(steps)).generate(REQUEST):
        yield delta


def test_the_edges_text_leaves_at_the_pace_while_it_is_read_as_fast_as_it_comes() -> None:
    async def body() -> list[tuple[float, str]]:
        loop = asyncio.get_running_loop()
        out = []
        answer = deltas(Delta("a"), Delta("b"), Delta("c"), 1.0, Delta("", "stop"))
        async for delta in paced(EdgePacer(0.1), answer):
            out.append((round(loop.time() - START, 6), delta.text))
        return out

    # All three were read at once; the answer's end (at 1.0) lets out whatever is held.
    assert on_loop(body) == [(0.0, "a"), (0.1, "b"), (0.2, "c"), (1.0, "")]


def test_once_released_the_deltas_go_straight_through() -> None:
    async def body() -> list[float]:
        loop = asyncio.get_running_loop()
        pacer = EdgePacer(0.1)
        pacer.release()
        return [loop.time() - START async for _ in paced(pacer, deltas(Delta("a"), Delta("b")))]

    assert on_loop(body) == [0.0, 0.0]


def test_what_the_edge_said_reaches_the_client_before_its_error() -> None:
    async def body() -> tuple[list[str], str]:
        out: list[str] = []
        try:
            async for delta in paced(EdgePacer(0.1), deltas(Delta("a"), Delta("b"), Fail())):
                out.append(delta.text)
        except EngineError as exc:
            return out, exc.code
        return out, ""

    assert on_loop(body) == (["a", "b"], "upstream_truncated")


def test_a_prefill_under_way_runs_on_past_a_complete_answer_and_is_cut_with_a_broken_one() -> None:
    tiers = Tiers(center=[10.0, Delta("x")], pace_ms=0)

    async def answer_of(course: Course) -> AsyncGenerator[Delta, None]:
        yield Delta("a", "stop")

    async def broken_of(course: Course) -> AsyncGenerator[Delta, None]:
        yield Delta("a")
        raise EngineError("upstream_truncated", "cut", retryable=True)

    async def body() -> tuple[list[Any], bool, bool]:
        courses: list[Course] = []

        def planned() -> Course:
            courses.append(tiers.course())
            return courses[-1]

        metas = [d.meta async for d in tiers.policy.answer(planned, answer_of)]
        with pytest.raises(EngineError):
            async for _ in tiers.policy.answer(planned, broken_of):
                pass
        await asyncio.sleep(0)
        tasks = [c.handover.prefill for c in courses if c.handover is not None]
        assert len(tasks) == 2 and tasks[0] is not None and tasks[1] is not None
        return metas, tasks[0].done(), tasks[1].cancelled()

    metas, first_done, second_cancelled = on_loop(body)
    assert metas == [{"prefill": {"target": "a"}}, None]  # billed just before the last delta
    assert not first_done and second_cancelled
