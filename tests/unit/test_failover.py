"""Failover alone, on virtual time: which target `pick` takes, what a leg's failure does to
the target's health and to the answer's state, and what the client gets when none is left."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from firsttoken.generation import EngineError, GenerationRequest
from firsttoken.routing.config import ModelRoute, TargetConfig
from firsttoken.routing.course import Course, State
from firsttoken.routing.failover import Failover, failover_meta, for_client
from firsttoken.routing.target import Target
from tests.unit import virtual_loop
from tests.unit.scripted import Scripted

REQUEST = GenerationRequest(request_id="s1", prompt="p", model="chat")
NOW = virtual_loop.START


class Said:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, level: int = 0, **fields: Any) -> None:
        self.events.append((event, fields))


def setup(*names: str, **route: Any) -> tuple[Failover, ModelRoute, dict[str, Target], Said]:
    configs = route.pop("configs", {})
    targets = {
        n: Target(
            TargetConfig(
                name=n, kind="synthetic", **{"continuation": "native", **configs.get(n, {})}
            ),
            Scripted(),
        )
        for n in names
    }
    said = Said()
    chat = ModelRoute(name="chat", targets=names, **route)
    return Failover(targets, {"chat": chat}, said), chat, targets, said


def on_loop(body: Callable[[], Any]) -> Any:
    async def run() -> Any:
        return body()

    return virtual_loop.run(run())


def error(code: str = "upstream_unavailable", **kw: Any) -> EngineError:
    return EngineError(code, f"scripted {code}", **{"retryable": True, **kw})


def course_on(route: ModelRoute, target: Target, state: State = State.START) -> Course:
    course = Course(route, REQUEST, route.targets)
    course.begin_leg(target)
    course.state = state
    return course


# -- pick ------------------------------------------------------------------------------------


def test_pick_takes_the_first_untried_target_in_order() -> None:
    failover, route, _, _ = setup("a", "b", "c")
    picked = on_loop(lambda: failover.pick(route, route.targets, {"a"}, False))
    assert picked.name == "b"


def test_a_splice_passes_over_targets_that_cannot_continue_and_those_failing_now() -> None:
    failover, route, targets, _ = setup("a", "b", "c", configs={"a": {"continuation": "none"}})
    targets["b"].health.failure(NOW)  # failing other streams, not yet ejected
    picked = on_loop(lambda: failover.pick(route, route.targets, set(), True))
    assert picked.name == "c"
    fresh = on_loop(lambda: failover.pick(route, route.targets, set(), False))
    assert fresh.name == "a"  # a new request does not need a continuation


def test_least_busy_takes_the_target_with_fewest_streams() -> None:
    failover, route, targets, _ = setup("a", "b", balance="least_busy")
    targets["a"].outstanding = 2
    assert on_loop(lambda: failover.pick(route, route.targets, set(), False)).name == "b"


def test_an_ejected_target_is_skipped_and_when_all_are_one_is_tried_anyway() -> None:
    failover, route, targets, _ = setup("a", "b", configs={"a": {"eject_after": 1}})
    targets["a"].health.failure(NOW)
    assert on_loop(lambda: failover.pick(route, route.targets, set(), False)).name == "b"
    assert on_loop(lambda: failover.pick(route, ("a",), set(), False)).name == "a"


def test_a_target_held_by_retry_after_is_not_picked() -> None:
    failover, route, targets, _ = setup("a")
    targets["a"].health.hold(NOW, 5.0)
    assert on_loop(lambda: failover.pick(route, route.targets, set(), False)) is None
    assert on_loop(lambda: failover.unavailable(route)).retry_after_s == 5.0


# -- a leg's failure -------------------------------------------------------------------------


def test_a_refused_connection_is_a_failover_in_phase_connect() -> None:
    failover, route, targets, said = setup("a", "b")
    course = course_on(route, targets["a"])
    on_loop(lambda: failover.leg_failed(course, error(status=503), streaming=False))
    assert course.state is State.FAILOVER and course.failed == (targets["a"], "connect")
    assert course.last is not None and targets["a"].health.failures == 1
    assert said.events[0][0] == "route.target_failed"
    on_loop(lambda: failover.count(course, targets["b"]))
    assert failover.counts[("chat", "connect")] == 1 and course.failed is None
    assert said.events[-1] == (
        "route.failover",
        {
            "stream": "s1",
            "route": "chat",
            "phase": "connect",
            "from": "a",
            "to": "b",
            "at_token": 0,
        },
    )


def test_silence_before_the_first_token_is_a_failover_in_phase_first_token() -> None:
    failover, route, targets, _ = setup("a")
    course = course_on(route, targets["a"], State.FAILOVER)
    on_loop(lambda: failover.leg_failed(course, error("upstream_timeout"), streaming=False))
    assert course.state is State.FAILOVER and course.failed == (targets["a"], "first_token")


def test_a_leg_that_breaks_off_mid_answer_is_a_cut_to_splice() -> None:
    failover, route, targets, _ = setup("a", "b")
    course = course_on(route, targets["a"], State.STREAMING)
    course.splicing = True
    on_loop(lambda: failover.leg_failed(course, error("upstream_truncated"), streaming=True))
    assert course.state is State.SPLICE and course.failed == (targets["a"], "mid_stream")
    assert course.cut is not None and course.cut.target == "a"
    assert failover_meta(course.cut, targets["b"], 3).meta == {
        "failover": {"from": "a", "to": "b", "at_token": 3}
    }


def test_a_refused_continuation_keeps_the_first_cut() -> None:
    failover, route, targets, _ = setup("a", "b")
    course = course_on(route, targets["b"], State.SPLICE)
    course.splicing = True
    cut = course.cut = error("upstream_truncated")
    course.failed = (targets["a"], "mid_stream")
    refusal = error("invalid_continuation", retryable=False, status=400, client_fault=True)
    on_loop(lambda: failover.leg_failed(course, refusal, streaming=False))
    assert course.state is State.SPLICE and course.cut is cut
    assert course.failed == (targets["a"], "mid_stream")
    assert targets["b"].health.failures == 0  # a refusal says nothing about the target


@pytest.mark.parametrize(
    "fault",
    [
        error("bad_request", retryable=False, status=400, client_fault=True),
        error("upstream_error", retryable=False),
    ],
)
def test_the_clients_fault_or_a_final_error_is_raised_and_fails_the_answer(
    fault: EngineError,
) -> None:
    failover, route, targets, _ = setup("a", "b")
    course = course_on(route, targets["a"])

    def fail() -> None:
        with pytest.raises(EngineError) as raised:
            failover.leg_failed(course, fault, streaming=False)
        assert raised.value is fault

    on_loop(fail)
    assert course.state is State.FAILED


def test_health_hears_only_what_says_something_about_the_target() -> None:
    failover, route, targets, _ = setup("a")
    a = targets["a"]

    def tell(e: EngineError) -> None:
        failover.target_failed(route, REQUEST, a, e, 0)

    on_loop(lambda: tell(error("queue_timeout")))
    assert a.health.failures == 0
    on_loop(lambda: tell(error("rate_limited", status=429, retry_after_s=7.0)))
    assert a.health.failures == 0 and a.health.held_until == NOW + 7.0
    on_loop(lambda: tell(error(status=502)))
    assert a.health.failures == 1


def test_a_passthrough_404_says_only_that_this_upstream_does_not_serve_the_model() -> None:
    failover, route, targets, _ = setup("a", passthrough=True)
    on_loop(lambda: failover.target_failed(route, REQUEST, targets["a"], error(status=404), 0))
    assert targets["a"].health.failures == 0


# -- none left -------------------------------------------------------------------------------


def test_with_none_left_the_cut_then_the_last_refusal_then_503() -> None:
    failover, route, targets, _ = setup("a")
    course = course_on(route, targets["a"])
    assert on_loop(lambda: failover.none_left(course)).status == 503
    course.last = error("unauthorized", status=401)
    assert on_loop(lambda: failover.none_left(course)).status == 502  # the target's set-up
    course.cut = error("upstream_truncated")
    assert on_loop(lambda: failover.none_left(course)) is course.cut


def test_a_clients_own_fault_reaches_it_as_it_is() -> None:
    fault = error("bad_request", status=400, client_fault=True)
    assert for_client(fault) is fault
