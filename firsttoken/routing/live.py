"""The routes as the server holds them across reloads: one RoutedEngine at a time, swapped
whole.

A reload builds the next RoutedEngine beside the current one (`prepare`): a target whose
settings did not change is the same `Target` object in both (its health, queue, slots and
counts go on), a new or changed one is a new `Target` with its own engine, started before the
swap. `swap` then makes it the one new streams get, in one assignment. A running stream keeps
the RoutedEngine it started on, with the targets it had (its failovers and splices included),
because its deltas come from that engine's `generate`: nothing is edited under it. A target
the new routes no longer have (removed, or replaced by its changed self) takes no new streams
and is closed once it has had none for a whole sweep (`sweep`, each second).

Counters stay monotonic across swaps: the failover and hand-off counts are one dict shared by
every generation, and what a closed target generated stays in `tokens_generated`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterator

from prometheus_client.core import Metric

from firsttoken.generation import (
    BaseEngine,
    Delta,
    EmbeddingRequest,
    Embeddings,
    GenerationRequest,
)
from firsttoken.routing.config import ModelRoute, RouteTable, TargetConfig
from firsttoken.routing.engine import PHASES, RoutedEngine, RouteObserver
from firsttoken.routing.target import Target

__all__ = ["LiveRoutes"]


class LiveRoutes(BaseEngine):
    """An Engine whose routes and targets a reload can replace without cutting a stream."""

    def __init__(self, routed: RoutedEngine, make_target: Callable[[TargetConfig], Target]) -> None:
        self.current = routed
        self._make_target = make_target
        self._retiring: dict[Target, int] = {}  # target -> sweeps it has been idle for
        self._closed_tokens = 0  # what closed targets generated
        self._closed_counters: dict[str, int] = {}

    # -- reload ----------------------------------------------------------------------------

    async def prepare(self, table: RouteTable) -> RoutedEngine:
        """The RoutedEngine for `table`, beside the current one: unchanged targets carried
        over, new ones built and started. Raises (nothing started is left running) when a
        new target cannot start; the current routes are untouched either way."""
        old = self.current
        targets: dict[str, Target] = {}
        fresh: list[Target] = []
        try:
            for name, cfg in table.targets.items():
                same = old.targets.get(name)
                if same is not None and same.config == cfg:
                    targets[name] = same
                    continue
                target = self._make_target(cfg)
                fresh.append(target)
                await target.engine.start()
                targets[name] = target
        except Exception as exc:
            for target in fresh:
                await target.engine.close()
            raise RuntimeError(f"target {fresh[-1].name!r}: {exc}") from exc
        new = RoutedEngine(table, targets)
        # One set of books for every generation: a stream of the old one counts here too.
        new.failovers = old.failovers
        for route in table.routes:
            for phase in PHASES:
                new.failovers.setdefault((route, phase), 0)
        new.handoffs = old.handoffs
        for route in table.routes:
            new.handoffs.setdefault(route, 0)
        new._current = old._current  # an abort finds the leg whichever generation it is on
        new.observer = old.observer
        return new

    def swap(self, new: RoutedEngine) -> list[str]:
        """Make `new` (from `prepare`) the routes new streams get; returns the names of the
        targets retired (their streams run on; each is closed once idle)."""
        old = self.current
        self.current = new
        retired: list[str] = []
        for name, target in old.targets.items():
            if new.targets.get(name) is not target:
                self._retiring[target] = 0
                retired.append(name)
                check = old._checks.pop(name, None)
                if check is not None:
                    check.cancel()
        for name, target in new.targets.items():
            check = old._checks.pop(name, None)
            if check is not None:
                new._checks[name] = check  # carried over with its target
            else:
                new.watch(target)
        new._warn_of_unlisted_models()
        return retired

    async def sweep(self) -> None:
        """Close the retired targets that have had no stream for a whole sweep."""
        for target, idle in list(self._retiring.items()):
            if target.outstanding or target.queued:
                self._retiring[target] = 0
                continue
            if idle < 1:
                self._retiring[target] = idle + 1
                continue
            del self._retiring[target]
            self._closed_tokens += target.engine.tokens_generated
            for name, value in target.engine.counters().items():
                self._closed_counters[name] = self._closed_counters.get(name, 0) + value
            await target.engine.close()

    @property
    def retiring(self) -> list[str]:
        return [t.name for t in self._retiring]

    # -- the Engine protocol, for new streams on the current routes ------------------------

    @property
    def models(self) -> tuple[str, ...]:
        return self.current.models

    @property
    def observer(self) -> RouteObserver | None:
        return self.current.observer

    @observer.setter
    def observer(self, observer: RouteObserver | None) -> None:
        self.current.observer = observer

    @property
    def tokens_generated(self) -> int:
        retiring = sum(t.engine.tokens_generated for t in self._retiring)
        return self.current.tokens_generated + retiring + self._closed_tokens

    def counters(self) -> dict[str, int]:
        counts = dict(self.current.counters())
        for part in (*(t.engine.counters() for t in self._retiring), self._closed_counters):
            for name, value in part.items():
                if name != "failovers":  # one shared count, in the current's already
                    counts[name] = counts.get(name, 0) + value
        return counts

    def prompt_tokens(self, prompt: str) -> int:
        return self.current.prompt_tokens(prompt)

    def check(self, request: GenerationRequest) -> None:
        self.current.check(request)

    async def abort(self, request_id: str) -> None:
        await self.current.abort(request_id)

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        # The current generation's own generator, not a wrapper: nothing more per token.
        return self.current.generate(request)

    async def start(self) -> None:
        await self.current.start()

    async def close(self) -> None:
        for target in list(self._retiring):
            await target.engine.close()
        self._retiring.clear()
        await self.current.close()

    def collect(self) -> Iterator[Metric]:
        return self.current.collect()

    async def fetch_models(self) -> tuple[str, ...] | None:
        return await self.current.fetch_models()

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        return await self.current.embed(request)

    def serving(self, request_id: str) -> str | None:
        # Every generation shares one map of the legs in flight (`prepare`).
        return self.current.serving(request_id)

    def has_prompt(self, request_id: str) -> bool:
        return self.current.has_prompt(request_id)

    # -- what callers read of the current routes --------------------------------------------

    @property
    def targets(self) -> dict[str, Target]:
        return self.current.targets

    @property
    def routes(self) -> dict[str, ModelRoute]:
        return self.current.routes

    @property
    def table(self) -> RouteTable:
        return self.current.table
