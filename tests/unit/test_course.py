"""An answer's states and its one transition function, and the plan of its course: the
order of its targets, its session and whose its failures are."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from firsttoken.generation import GenerationRequest
from firsttoken.routing.config import ModelRoute, ShortPrompts, TargetConfig
from firsttoken.routing.course import (
    MAX_CHARS_PER_TOKEN,
    Course,
    Event,
    IllegalTransition,
    State,
    advance,
    passes_through,
    plan,
    session_key,
)
from firsttoken.routing.target import Target
from tests.unit.scripted import Scripted

USER = {"role": "user", "content": "Tell me a story."}
ASKING = (State.START, State.FAILOVER, State.SPLICE, State.HANDOFF)


def chat(**body: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id="s1",
        prompt="user: Tell me a story.",
        model="chat",
        messages=(USER,),
        body={"model": "chat", "messages": [USER], "stream": True, **body},
        tenant="k1",
    )


def walk(*events: Event) -> list[State]:
    state, seen = State.START, [State.START]
    for event in events:
        state = advance(state, event)
        seen.append(state)
    return seen


# -- the state machine ---------------------------------------------------------------------------


def test_an_answer_from_its_first_target_streams_then_is_done() -> None:
    assert walk(Event.FIRST_DELTA, Event.ENDED) == [State.START, State.STREAMING, State.DONE]


def test_a_refusal_before_the_first_delta_fails_over_and_stays_a_failover() -> None:
    states = walk(Event.REFUSED, Event.REFUSED, Event.FIRST_DELTA, Event.ENDED)
    assert states == [
        State.START,
        State.FAILOVER,
        State.FAILOVER,
        State.STREAMING,
        State.DONE,
    ]


def test_a_leg_that_breaks_off_is_spliced_and_a_refused_continuation_stays_a_splice() -> None:
    states = walk(Event.FIRST_DELTA, Event.BROKE, Event.REFUSED, Event.FIRST_DELTA)
    assert states[1:] == [State.STREAMING, State.SPLICE, State.SPLICE, State.STREAMING]


def test_the_edges_part_done_is_a_hand_off_until_a_center_takes_it() -> None:
    states = walk(Event.FIRST_DELTA, Event.HANDED, Event.REFUSED, Event.FIRST_DELTA)
    assert states[1:] == [State.STREAMING, State.HANDOFF, State.HANDOFF, State.STREAMING]


def test_a_center_that_breaks_after_taking_over_is_a_splice() -> None:
    states = walk(Event.FIRST_DELTA, Event.HANDED, Event.FIRST_DELTA, Event.BROKE)
    assert states[-1] is State.SPLICE


@pytest.mark.parametrize("state", [*ASKING, State.STREAMING])
def test_the_clients_answer_fails_any_live_state(state: State) -> None:
    assert advance(state, Event.FATAL) is State.FAILED


@pytest.mark.parametrize("state", ASKING)
def test_a_leg_that_ends_with_nothing_is_done(state: State) -> None:
    assert advance(state, Event.ENDED) is State.DONE


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (State.STREAMING, Event.FIRST_DELTA),  # one first delta a leg
        (State.STREAMING, Event.REFUSED),  # after its first delta a failure is a cut
        (State.START, Event.BROKE),
        (State.START, Event.HANDED),  # only a leg that streams hands off
        (State.DONE, Event.FIRST_DELTA),
        (State.FAILED, Event.REFUSED),
    ],
)
def test_an_event_with_no_arrow_is_a_bug_said_as_one(state: State, event: Event) -> None:
    with pytest.raises(IllegalTransition, match=f"{event.value} in state {state.value}"):
        advance(state, event)


def test_a_course_moves_by_to_and_says_where_it_was() -> None:
    course = Course(ModelRoute(name="chat", targets=("a",)), chat(), ("a",))
    assert course.state is State.START
    assert course.to(Event.FIRST_DELTA) is State.START and course.state is State.STREAMING


# -- the plan ------------------------------------------------------------------------------------


def targets(*names: str) -> dict[str, Target]:
    return {n: Target(TargetConfig(name=n, kind="synthetic"), Scripted()) for n in names}


def test_a_short_prompt_puts_the_small_target_first() -> None:
    route = ModelRoute(name="chat", targets=("a", "b"), short_prompts=ShortPrompts("b", 100))
    course, short = plan(route, chat(), targets("a", "b"))
    assert short and course.order == ("b", "a")
    long = replace(chat(), prompt="x" * (100 * MAX_CHARS_PER_TOKEN + 1))
    course, short = plan(route, long, targets("a", "b"))
    assert not short and course.order == ("a", "b")


def test_a_session_only_where_the_route_balances_by_session() -> None:
    ordered, _ = plan(ModelRoute(name="chat", targets=("a",)), chat(), targets("a"))
    by_session = ModelRoute(name="chat", targets=("a",), balance="session")
    sessioned, _ = plan(by_session, chat(), targets("a"))
    assert ordered.session is None and sessioned.session == session_key(chat())


def test_a_failure_is_the_keys_only_when_its_request_passes_fields_through() -> None:
    route = ModelRoute(name="chat", targets=("a",))
    assert plan(route, chat(), targets("a"))[0].owner is None
    assert passes_through(chat(top_k=5))
    assert plan(route, chat(top_k=5), targets("a"))[0].owner == "k1"


def test_a_conversation_keeps_its_session_from_the_first_turn_on() -> None:
    q = {"role": "user", "content": "What are tides?"}
    turn1 = replace(chat(), messages=(q,))
    turn2 = replace(
        chat(),
        messages=(q, {"role": "assistant", "content": "..."}, {"role": "user", "content": "Why?"}),
    )
    assert session_key(turn1) == session_key(turn2)
    system = {"role": "system", "content": "Be brief."}
    assert session_key(replace(turn1, messages=(system, q))) != session_key(turn1)
