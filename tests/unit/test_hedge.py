"""The hedged race on virtual time, alone: when the spare is asked, who wins, what the loser
hears, and what is raised when both fail."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from firsttoken.generation import Delta, EngineError, GenerationRequest
from firsttoken.routing.config import TargetConfig
from firsttoken.routing.hedge import Reader, race
from firsttoken.routing.target import Target
from tests.unit import virtual_loop
from tests.unit.scripted import Fail, Scripted, Step

REQUEST = GenerationRequest(request_id="s1", prompt="p", model="m")


class Racer:
    """A target and its engine, whose deltas are a script."""

    def __init__(self, name: str, *steps: Step) -> None:
        self.engine = Scripted(list(steps))
        self.target = Target(TargetConfig(name=name, kind="synthetic"), self.engine)

    def deltas(self) -> AsyncIterator[Delta]:
        return self.engine.generate(REQUEST)


class Spare:
    """The spare the race may ask for (None: no target left), and when it was asked."""

    def __init__(self, racer: Racer | None) -> None:
        self.racer = racer
        self.asked_at: float | None = None

    async def __call__(self) -> tuple[Target, AsyncIterator[Delta]] | None:
        self.asked_at = asyncio.get_running_loop().time()
        if self.racer is None:
            return None
        return self.racer.target, self.racer.deltas()


async def texts(deltas: AsyncIterator[Delta]) -> str:
    read = Reader(deltas).next
    out = ""
    while (delta := await read()) is not None:
        out += delta.text
    return out


def run_race(
    first: Racer, spare: Spare
) -> tuple[str, str, list[tuple[str, str]], float, EngineError | None]:
    """The winner's name and text, the losers `lost` heard of, the time to the winner's
    first delta, and the error when both failed."""
    lost: list[tuple[str, str]] = []

    async def body() -> tuple[str, str, list[tuple[str, str]], float, EngineError | None]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            who, deltas = await race(
                first.target, first.deltas(), spare, lambda t, e: lost.append((t.name, e.code))
            )
        except EngineError as exc:
            return "", "", lost, loop.time() - start, exc
        took = loop.time() - start
        return who.name, await texts(deltas), lost, took, None

    return virtual_loop.run(body())


def test_a_first_leg_that_answers_in_time_wins_and_no_spare_is_asked() -> None:
    spare = Spare(Racer("b", Delta("late")))
    who, text, lost, took, _ = run_race(Racer("a", 0.1, Delta("x"), Delta("y")), spare)
    assert (who, text, lost, took) == ("a", "xy", [], pytest.approx(0.1))
    assert spare.asked_at is None


def test_a_slow_first_leg_asks_the_spare_and_the_first_to_answer_wins() -> None:
    a = Racer("a", 100.0, Delta("a"))
    spare = Spare(Racer("b", 0.05, Delta("b"), Delta("!")))
    who, text, _, took, _ = run_race(a, spare)
    # 200 ms without history, then 50 ms for the spare's first delta.
    assert spare.asked_at == virtual_loop.START + 0.2
    assert (who, text, took) == ("b", "b!", pytest.approx(0.25))
    assert a.engine.ended_early == ["CancelledError"]  # the loser's read was cancelled


def test_the_spare_is_asked_after_three_times_the_targets_usual_first_token() -> None:
    a = Racer("a", 2.0, Delta("a"))
    a.target.first_token_s = 0.5
    spare = Spare(Racer("b", 10.0, Delta("b")))
    who, _, _, took, _ = run_race(a, spare)
    assert spare.asked_at == virtual_loop.START + 1.5
    assert (who, took) == ("a", pytest.approx(2.0))


def test_with_no_spare_left_the_first_leg_is_waited_for() -> None:
    spare = Spare(None)
    who, text, _, took, _ = run_race(Racer("a", 5.0, Delta("a")), spare)
    assert (who, text, took) == ("a", "a", pytest.approx(5.0)) and spare.asked_at is not None


def test_a_leg_that_fails_while_the_other_runs_is_lost_and_passed_over() -> None:
    a = Racer("a", 0.3, Fail("upstream_unavailable", status=503))
    spare = Spare(Racer("b", 0.5, Delta("b")))
    who, text, lost, took, _ = run_race(a, spare)
    assert (who, text, took) == ("b", "b", pytest.approx(0.7))
    assert lost == [("a", "upstream_unavailable")]


def test_when_both_fail_the_last_error_is_raised_naming_its_target() -> None:
    a = Racer("a", 0.3, Fail("upstream_unavailable", status=503))
    spare = Spare(Racer("b", 0.5, Fail("upstream_timeout")))
    _, _, lost, took, error = run_race(a, spare)
    assert error is not None and error.code == "upstream_timeout" and error.target == "b"
    assert lost == [("a", "upstream_unavailable")] and took == pytest.approx(0.7)


def test_a_leg_that_ends_at_once_wins_with_nothing_to_read() -> None:
    who, text, _, _, error = run_race(Racer("a"), Spare(None))
    assert (who, text, error) == ("a", "", None)
