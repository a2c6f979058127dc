"""Routes swapped under running streams (routes/live.py), on virtual time with scripted
targets: a stream keeps the targets it started on, new streams get the new routes, unchanged
targets carry their health and counts over, retired ones close once idle."""

from __future__ import annotations

import asyncio

from firsttoken.generation import GenerationRequest
from firsttoken.routing.config import ModelRoute, RouteTable, TargetConfig
from firsttoken.routing.engine import RoutedEngine
from firsttoken.routing.live import LiveRoutes
from firsttoken.routing.target import Target
from tests.unit import virtual_loop
from tests.unit.scripted import ANSWER, Scripted, answer, tokens

WHOLE = "".join(ANSWER)


def table(routes: dict[str, tuple[str, ...]], **configs: dict[str, object]) -> RouteTable:
    names = dict.fromkeys(n for targets in routes.values() for n in targets)
    return RouteTable(
        targets={
            n: TargetConfig(name=n, kind="synthetic", continuation="native", **configs.get(n, {}))  # type: ignore[arg-type]
            for n in names
        },
        routes={r: ModelRoute(name=r, targets=t) for r, t in routes.items()},
    )


class Built:
    """The engines `make_target` built, by target name (the last one of each name)."""

    def __init__(self) -> None:
        self.engines: dict[str, Scripted] = {}

    def __call__(self, cfg: TargetConfig) -> Target:
        engine = Scripted(tokens(len(ANSWER), every_s=0.1))
        self.engines[cfg.name] = engine
        return Target(cfg, engine)


def live(first: RouteTable, built: Built) -> LiveRoutes:
    return LiveRoutes(RoutedEngine(first, {n: built(c) for n, c in first.targets.items()}), built)


def request(model: str, rid: str) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt="hi", model=model)


async def text(engine: LiveRoutes, model: str, rid: str) -> str:
    return "".join([d.text async for d in engine.generate(request(model, rid))])


def test_a_running_stream_keeps_its_targets_and_new_streams_get_the_new_routes() -> None:
    async def body() -> None:
        built = Built()
        routes = live(table({"chat": ("a",)}), built)
        first_a = built.engines["a"]
        running = asyncio.create_task(text(routes, "chat", "s1"))
        await asyncio.sleep(0.35)  # three tokens in
        new = await routes.prepare(table({"chat": ("b",), "edge": ("b",)}))
        assert routes.models == ("chat",)  # prepared beside, not yet in use
        assert routes.swap(new) == ["a"]
        assert routes.models == ("chat", "edge")
        assert await text(routes, "chat", "s2") == WHOLE
        assert built.engines["b"].requests[-1].request_id == "s2"
        assert await running == WHOLE  # uncut, all on the target it started on
        assert [r.request_id for r in first_a.requests] == ["s1"]
        assert not first_a.closed
        await routes.sweep()
        assert not first_a.closed  # idle for one sweep only
        await routes.sweep()
        assert first_a.closed and routes.retiring == []
        assert routes.tokens_generated == 2 * len(ANSWER)  # a closed target's tokens stay

    virtual_loop.run(body())


def test_an_unchanged_target_is_the_same_object_with_its_health_and_counts() -> None:
    async def body() -> None:
        built = Built()
        routes = live(table({"chat": ("a", "b")}), built)
        a = routes.current.targets["a"]
        a.health.failure(0.0)
        routes.current.failovers[("chat", "connect")] = 3
        new = await routes.prepare(
            table({"chat": ("a", "b"), "more": ("a",)}, b={"max_concurrency": 2})
        )
        assert new.targets["a"] is a and a.health.failures == 1
        changed = new.targets["b"]
        assert changed is not routes.current.targets["b"]  # new settings: a new target
        assert changed.config.max_concurrency == 2 and built.engines["b"].started
        assert routes.swap(new) == ["b"]
        assert routes.current.failovers[("chat", "connect")] == 3  # one set of books
        assert routes.current.failovers[("more", "mid_stream")] == 0
        assert routes.current.handoffs == {"chat": 0, "more": 0}

    virtual_loop.run(body())


def test_a_target_that_cannot_start_leaves_the_routes_as_they_were() -> None:
    class Broken(Scripted):
        async def start(self) -> None:
            raise OSError("no such model")

    async def body() -> None:
        built = Built()
        routes = live(table({"chat": ("a",)}), built)
        before = routes.current
        started: list[Scripted] = []

        def make(cfg: TargetConfig) -> Target:
            engine = Broken(answer) if cfg.name == "c" else Scripted(answer)
            started.append(engine)
            return Target(cfg, engine)

        routes._make_target = make
        try:
            await routes.prepare(table({"chat": ("b", "c")}))
        except RuntimeError as exc:
            assert str(exc) == "target 'c': no such model"
        else:
            raise AssertionError("prepare should have failed")
        assert routes.current is before
        assert all(e.closed for e in started)  # what it started is closed again

    virtual_loop.run(body())
