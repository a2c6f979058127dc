"""One leg read by plain calls, on virtual time: its phase deadlines, what its watch hears,
and its slot given back however it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from firsttoken.generation import Delta, EngineError, GenerationRequest
from firsttoken.routing.config import TargetConfig
from firsttoken.routing.leg import Leg
from firsttoken.routing.target import Target
from tests.unit import virtual_loop
from tests.unit.scripted import Scripted, Step

REQUEST = GenerationRequest(request_id="s1", prompt="p", model="m")


class Watch:
    def __init__(self) -> None:
        self.chunks: list[float] = []
        self.ended: list[BaseException | None] = []

    def chunk(self, now: float) -> None:
        self.chunks.append(now)

    def end(self, failure: BaseException | None) -> None:
        self.ended.append(failure)


class Observer:
    def __init__(self) -> None:
        self.watch = Watch()

    def leg(self, request: GenerationRequest, *_: Any) -> tuple[GenerationRequest, Watch]:
        return request, self.watch

    def event(self, event: str, fields: Any) -> None:
        return None


def target(*steps: Step, **config: Any) -> Target:
    return Target(TargetConfig(name="t", kind="synthetic", **config), Scripted(list(steps)))


async def _read(target: Target, observer: Observer, *, away_s: float = 0.0) -> list[Delta]:
    current: dict[str, Target] = {}
    leg = Leg(target, REQUEST, current)
    await leg.open("m", observer)
    assert current == {"s1": target} and target.outstanding == 1
    deltas: list[Delta] = []
    failure: BaseException | None = None
    try:
        while (delta := await leg.next()) is not None:
            deltas.append(delta)
            await asyncio.sleep(away_s)  # the client reading slowly
    except BaseException as exc:
        failure = exc
        raise
    finally:
        await leg.close(failure)
        assert current == {} and target.outstanding == 0
    return deltas


def test_a_whole_leg_is_read_and_its_watch_hears_each_chunk_and_a_clean_end() -> None:
    observer = Observer()
    t = target(0.5, Delta("a"), 0.25, Delta("b", "stop"))
    deltas = virtual_loop.run(_read(t, observer))
    assert [d.text for d in deltas] == ["a", "b"]
    start = virtual_loop.START
    assert observer.watch.chunks == [start + 0.5, start + 0.75]
    assert observer.watch.ended == [None]
    assert t.first_token_s == 0.5 and t.last_chunk_at == start + 0.75


def test_no_first_token_in_time_is_a_timeout_that_the_watch_hears() -> None:
    observer = Observer()
    t = target(5.0, Delta("late"), first_token_timeout_s=2.0)
    with pytest.raises(EngineError, match="first token within 2 s") as caught:
        virtual_loop.run(_read(t, observer))
    assert caught.value.code == "upstream_timeout" and caught.value.retryable
    assert observer.watch.ended == [caught.value]


def test_silence_between_chunks_is_timed_but_not_the_clients_reading() -> None:
    slow_reader = target(Delta("a"), 1.0, Delta("b"), idle_timeout_s=2.0, total_timeout_s=3.0)
    # 10 s away after each chunk: neither the idle nor the total deadline counts it.
    deltas = virtual_loop.run(_read(slow_reader, Observer(), away_s=10.0))
    assert [d.text for d in deltas] == ["a", "b"]
    stalled = target(Delta("a"), 3.0, Delta("b"), idle_timeout_s=2.0)
    with pytest.raises(EngineError, match="chunk within 2 s"):
        virtual_loop.run(_read(stalled, Observer()))


def test_a_leg_closed_before_its_end_stops_its_target_and_the_watch_hears_the_close() -> None:
    observer = Observer()
    t = target(Delta("a"), Delta("b"))

    async def first_only() -> None:
        leg = Leg(t, REQUEST, {})
        await leg.open("m", observer)
        assert await leg.next() == Delta("a")
        await leg.close()
        await leg.close()  # once only: the slot is not given back twice

    virtual_loop.run(first_only())
    assert isinstance(observer.watch.ended[0], GeneratorExit) and len(observer.watch.ended) == 1
    assert t.outstanding == 0
    engine = t.engine
    assert isinstance(engine, Scripted) and engine.ended_early == ["GeneratorExit"]
