"""The routed engine: an engine made of engines.

A request names a model; its route lists targets in order. The router sends the request to
the first healthy one, watches each phase's deadline (connect, first token, silence between
chunks, total), fails over while nothing was sent, and, once the answer has begun, splices:
the next target that can continue gets the conversation plus the text already sent, and its
deltas carry on the same stream. The client sees one answer: the stream and its log are the
core's, and only deltas leave this module.

The answer's way through its legs is a state machine (routing/course.py); the policies that
move it are apart: failover (routing/failover.py: which target, what a failure means),
hedging (routing/hedge.py) and the hand-off (routing/handoff.py). This module runs the legs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AsyncExitStack, aclosing, suppress
from dataclasses import replace
from functools import partial
from types import TracebackType
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from firsttoken.generation import (
    BaseEngine,
    Delta,
    EmbeddingRequest,
    Embeddings,
    EngineError,
    GenerationRequest,
)
from firsttoken.routing.config import ModelRoute, RouteTable
from firsttoken.routing.course import (
    KNOWN_FIELDS,
    MAX_CHARS_PER_TOKEN,
    Course,
    Event,
    State,
    plan,
)
from firsttoken.routing.failover import PHASES, Failover, failover_meta, named
from firsttoken.routing.handoff import Handoffs
from firsttoken.routing.hedge import Reader, Spare, race
from firsttoken.routing.leg import Leg, LegWatch, RouteObserver
from firsttoken.routing.splice import continuation, spliced_usage
from firsttoken.routing.target import Target
from firsttoken.telemetry.log import log_event

__all__ = [
    "KNOWN_FIELDS",
    "MAX_CHARS_PER_TOKEN",
    "PHASES",
    "Course",
    "LegWatch",
    "RouteObserver",
    "RoutedEngine",
]


class RoutedEngine(BaseEngine):
    """`--routes FILE` (or the `--upstream` shorthand): model names → ordered targets."""

    def __init__(self, table: RouteTable, targets: Mapping[str, Target]) -> None:
        self.table = table
        self.targets = dict(targets)
        self.routes: dict[str, ModelRoute] = dict(table.routes)
        self.models: tuple[str, ...] = tuple(table.routes)
        self.observer: RouteObserver | None = None  # --otlp-endpoint: spans per leg, events
        self.failover = Failover(self.targets, table.routes, self._said)
        self.handoff = Handoffs(self.targets, table.routes, self._said, self._leg)
        self._current: dict[str, Target] = {}
        self._checks: dict[str, asyncio.Task[None]] = {}  # active health, by target

    @property
    def failovers(self) -> dict[tuple[str, str], int]:
        """Streams moved to another target, by route and phase (one set of books across a
        reload: routing/live.py hands the old engine's to the new)."""
        return self.failover.counts

    @failovers.setter
    def failovers(self, counts: dict[tuple[str, str], int]) -> None:
        self.failover.counts = counts

    @property
    def handoffs(self) -> dict[str, int]:
        """Answers handed off, by route (kept across a reload as `failovers` is)."""
        return self.handoff.counts

    @handoffs.setter
    def handoffs(self, counts: dict[str, int]) -> None:
        self.handoff.counts = counts

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        # One after another: an engine may keep a task group open past its start (llama.cpp
        # does), which a sibling task of ours must not be the one to open.
        for target in self.targets.values():
            await self._start_target(target)
        names: dict[str, None] = dict.fromkeys(self.table.routes)
        for route in self.table.routes.values():
            if not route.passthrough:
                continue
            # The shorthand serves whatever its upstreams list, under their own names.
            listed: dict[str, None] = {}
            for name in route.targets:
                listed.update(dict.fromkeys(self.targets[name].engine.models))
            if not listed:
                await self.close()
                urls = ", ".join(str(self.targets[n].config.url) for n in route.targets)
                raise RuntimeError(f"relay: no upstream answered GET /models ({urls})")
            for model in listed:
                self.routes.setdefault(model, route)
            names.pop(route.name, None)
            names.update(listed)
        self.models = tuple(names)
        self._warn_of_unlisted_models()
        for target in self.targets.values():
            self.watch(target)

    def watch(self, target: Target) -> None:
        """Start `target`'s active health checks, if it has them."""
        if target.config.health_check_interval_s > 0 and target.name not in self._checks:
            self._checks[target.name] = asyncio.create_task(self._watch(target))

    def _warn_of_unlisted_models(self) -> None:
        """A model name the target's upstream does not list (a typo, a model not loaded) gets
        a 404 on every request: said at start, once per target and name. Passthrough routes
        send the client's names, which the gateway checks against the lists itself."""
        said: set[tuple[str, str]] = set()
        for route in self.table.routes.values():
            if route.passthrough:
                continue
            names = list(route.targets)
            names += [route.handoff.source] if route.handoff else []
            names += [route.short_prompts.target] if route.short_prompts else []
            for name in names:
                target = self.targets[name]
                listed = target.engine.listed
                model = target.config.model or route.name
                if not listed or (name, model) in said or _serves(listed, model):
                    continue  # not a remote engine, its upstream did not answer, or it is there
                said.add((name, model))
                log_event(
                    "route.model_unlisted",
                    logging.WARNING,
                    target=name,
                    model=model,
                    listed=list(listed[:20]),
                    note="the target's upstream does not list this model: it will most "
                    "likely refuse each request (404), which fails over to the route's next "
                    "target and counts against this one's health; check the target's `model`",
                )

    async def _start_target(self, target: Target) -> None:
        try:
            await target.engine.start()
        except Exception as exc:
            raise RuntimeError(f"target {target.name!r}: {exc}") from exc

    async def close(self) -> None:
        self.handoff.close()
        for task in self._checks.values():
            task.cancel()
        for task in self._checks.values():
            with suppress(asyncio.CancelledError):
                await task
        self._checks.clear()
        for target in self.targets.values():
            await target.engine.close()

    # -- the Engine protocol ---------------------------------------------------------------

    @property
    def tokens_generated(self) -> int:
        return sum(t.engine.tokens_generated for t in self.targets.values())

    def prompt_tokens(self, prompt: str) -> int:
        return next(iter(self.targets.values())).engine.prompt_tokens(prompt)

    def counters(self) -> dict[str, int]:
        counts: dict[str, int] = {"failovers": sum(self.failovers.values())}
        for target in self.targets.values():
            for name, value in target.engine.counters().items():
                counts[name] = counts.get(name, 0) + value
        return counts

    def check(self, request: GenerationRequest) -> None:
        """What the route's first target would refuse before anything is sent (an
        in-process engine's bad continuation): the API answers it as a 4xx."""
        route = self.routes.get(request.model) or self.table.default
        target = self.targets[route.targets[0]]
        target.engine.check(request)

    def serving(self, request_id: str) -> str | None:
        """The target answering `request_id` now (its first leg, asked at its first token)."""
        target = self._current.get(request_id)
        return target.name if target is not None else None

    def has_prompt(self, request_id: str) -> bool:
        """A target has it once its slot is taken; a request still in a queue has none."""
        return request_id in self._current

    async def abort(self, request_id: str) -> None:
        target = self._current.pop(request_id, None)
        if target is not None:
            await target.engine.abort(request_id)

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        """The route's targets in order, as a stream's before its first token: the first
        that answers; one that fails in a way another might not (down, 5xx, timed out) gives
        its turn to the next, and counts against its health. A refusal of the request itself
        (a 4xx) is the client's answer."""
        route = self.routes.get(request.model) or self.table.default
        loop = asyncio.get_running_loop()
        tried: set[str] = set()
        failure: EngineError | None = None
        while (target := self.failover.pick(route, route.targets, tried, False)) is not None:
            tried.add(target.name)
            model = self._model(route, target, request.model)
            try:
                answer = await target.engine.embed(replace(request, model=model))
            except EngineError as exc:
                if not exc.retryable:
                    target.health.release()
                    raise named(exc, target) from None
                target.health.failure(loop.time())
                failure = named(exc, target)
                continue
            target.health.success()
            return replace(answer, target=target.name)
        raise failure if failure is not None else self.failover.unavailable(route)

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        route = self.routes.get(request.model) or self.table.default
        if route.handoff is None:
            # Nothing to pace and no prefill to end: the answer's own generator, not a
            # wrapper (nothing more per delta).
            return self._answer(self._course(request))
        return self.handoff.answer(partial(self._course, request), self._answer)

    def _course(self, request: GenerationRequest) -> Course:
        """The plan for one answer (`course.plan`), and its hand-off where one applies: not
        for a short prompt, which the small target answers whole."""
        route = self.routes.get(request.model) or self.table.default
        course, short = plan(route, request, self.targets)
        if route.handoff is not None and not short:
            self.handoff.plan(course)
        return course

    async def _answer(self, course: Course) -> AsyncGenerator[Delta, None]:
        """The answer over as many legs as it takes: each turn asks the next target (the
        hand-off's edge first, where one applies) and streams its deltas; a leg that breaks
        off is reported, and the next turn fails over or splices (`course.State`). Per delta
        the leg's work is plain calls (`Leg.next`, the transcript, the hand-off check): no
        generator of its own between the target's deltas and the stream."""
        transcript, handover = course.transcript, course.handover
        while True:
            course.splicing = transcript.tokens > 0
            try:
                leg_request = self._next_request(course)
                if leg_request is None:  # cut exactly at max_tokens: it is complete
                    course.to(Event.ENDED)
                    yield Delta("", "length")
                    return
                target, edge = self._next_target(course)
            except EngineError:
                course.to(Event.FATAL)
                raise
            course.begin_leg(target)
            before_tokens, before_text = transcript.tokens, transcript.text_tokens
            started = spliced = handed = False
            edging = handover if edge else None  # the edge's leg: its part ends by the seam
            try:
                # Closed here, not by the collector: a client that leaves frees the leg now.
                async with AsyncExitStack() as legs:
                    read = await self._begin_leg(course, target, leg_request, legs)
                    while (delta := await read()) is not None:
                        if not started:
                            started = True
                            seam = self._leg_began(course, before_tokens)
                            spliced = bool(course.splices or course.handoffs)
                            if seam is not None:
                                yield seam
                        transcript.add(delta)
                        if spliced and delta.finish_reason is not None:
                            delta.usage = spliced_usage(delta.usage, before_tokens, before_text)
                        yield delta
                        if edging is not None and self.handoff.hands_off(edging, transcript, delta):
                            handed = True
                            break  # the edge's part is done: closing the leg stops it
            except EngineError as exc:
                self.failover.leg_failed(course, exc, started)
                continue
            except BaseException:
                if not started:  # the client left (or a bug): a half-open probe goes back
                    course.target.health.release()
                raise
            if not handed:
                course.to(Event.ENDED)
                return
            course.to(Event.HANDED)
            self.handoff.handing_over(course)

    def _next_request(self, course: Course) -> GenerationRequest | None:
        """What the next leg is asked: the request itself, or once text was sent, its
        continuation (None: nothing is left of max_tokens). Raises the cut when the answer
        may not be continued."""
        transcript, route, request = course.transcript, course.route, course.request
        if not course.splicing:
            return course.leg_request
        why = transcript.why_not()
        if why is None and course.state is not State.HANDOFF:
            if course.splices >= route.max_splices:
                why = f"the route allows {route.max_splices} splice(s)"
        if why is not None:
            self._said(
                "route.no_splice",
                logging.WARNING,
                stream=request.request_id,
                route=route.name,
                reason=why,
            )
            assert course.cut is not None
            raise course.cut
        next_request = continuation(request, transcript)
        if next_request is not None:
            course.leg_request = next_request
        return next_request

    def _next_target(self, course: Course) -> tuple[Target, bool]:
        """The next leg's target, and whether it is the hand-off's edge (its part ends by
        `Handoffs.hands_off`); raises when no target is left."""
        if course.handover is not None:
            edge = self.handoff.first_leg(course)
            if edge is not None:
                return edge, True
        picked = self.failover.pick(
            course.route, course.order, course.tried, course.splicing, course.session, course.owner
        )
        if picked is None and course.handover is not None:
            picked = self.handoff.fallback(course)
        if picked is None:
            raise self.failover.none_left(course)
        return picked, False

    async def _begin_leg(
        self,
        course: Course,
        target: Target,
        leg_request: GenerationRequest,
        legs: AsyncExitStack,
    ) -> Callable[[], Awaitable[Delta | None]]:
        """Open one leg (closed with `legs`): its reader, a call per delta (None at its
        end). A failure is raised with `course.target` the target that failed (the last of
        a hedged pair)."""
        route = course.route
        course.tried.add(target.name)
        if course.failed is not None and not course.splicing:
            self.failover.count(course, target)
        if not (course.splicing and route.hedge):
            leg = await self._open_leg(target, leg_request, route)
            legs.push_async_exit(_closing(leg))
            return leg.next
        deltas: AsyncIterator[Delta] = await legs.enter_async_context(
            aclosing(self._leg(target, leg_request, route))
        )
        try:
            target, deltas = await race(
                target, deltas, self._spare(course, target, leg_request, legs), self._lost(course)
            )
        except EngineError as exc:
            failed_target = exc.target
            if failed_target is not None and failed_target in self.targets:
                course.target = self.targets[failed_target]
            raise
        course.target = target
        return Reader(deltas).next

    def _spare(
        self, course: Course, target: Target, leg_request: GenerationRequest, legs: AsyncExitStack
    ) -> Spare:
        """A hedged continuation's second leg: the next target's, opened with `legs`."""

        async def spare() -> tuple[Target, AsyncIterator[Delta]] | None:
            route = course.route
            picked = self.failover.pick(
                route, course.order, course.tried, True, course.session, course.owner
            )
            if picked is None:
                return None
            course.tried.add(picked.name)
            self._said(
                "route.hedge",
                stream=course.request.request_id,
                route=route.name,
                target=target.name,
                to=picked.name,
            )
            more = await legs.enter_async_context(aclosing(self._leg(picked, leg_request, route)))
            return picked, more

        return spare

    def _lost(self, course: Course) -> Callable[[Target, EngineError], None]:
        """A hedged leg that failed while the other ran: its target's health hears it."""

        def lost(target: Target, error: EngineError) -> None:
            self.failover.target_failed(
                course.route, course.request, target, error, 0, course.owner
            )

        return lost

    def _leg_began(self, course: Course, before_tokens: int) -> Delta | None:
        """The leg's first delta came: its target is well, and the seam's meta event (a
        hand-off taken, or a splice: counted when it takes, as a continuation that a target
        refused is no seam), if any, goes first."""
        target = course.target
        was = course.to(Event.FIRST_DELTA)
        target.health.success()
        handover = course.handover
        if handover is not None:
            now = asyncio.get_running_loop().time()
            self.handoff.began(handover, was is State.HANDOFF or course.splicing, now)
            if was is State.HANDOFF:
                return self.handoff.took(course, target, before_tokens)
        if not course.splicing:
            return None
        course.splices += 1
        self.failover.count(course, target)
        return failover_meta(course.cut, target, before_tokens)

    # -- one leg: one target, with its phase deadlines -------------------------------------

    async def _leg(
        self, target: Target, request: GenerationRequest, route: ModelRoute
    ) -> AsyncGenerator[Delta, None]:
        """One leg as a generator: for the hand-off's prefill and a hedged pair's race, which
        read it from tasks of their own (the answer's leg is read by plain calls)."""
        leg = await self._open_leg(target, request, route)
        failure: BaseException | None = None
        try:
            while (delta := await leg.next()) is not None:
                yield delta
        except BaseException as exc:
            failure = exc
            raise
        finally:
            await leg.close(failure)
            failure = None  # this frame is in its traceback: no cycle left for the collector

    async def _open_leg(self, target: Target, request: GenerationRequest, route: ModelRoute) -> Leg:
        leg = Leg(target, request, self._current)
        await leg.open(self._model(route, target, request.model), self.observer)
        return leg

    def _model(self, route: ModelRoute, target: Target, asked: str) -> str:
        """The name `target` knows the model the client `asked` for by."""
        if route.passthrough:
            if asked != route.name:
                return asked
            models = target.engine.models
            return models[0] if models else route.name
        return target.config.model or route.name

    # -- bookkeeping -----------------------------------------------------------------------

    def _said(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        """A route event: its log line and, with an observer, an event on the stream's span."""
        log_event(event, level, **fields)
        if self.observer is not None:
            self.observer.event(event, fields)

    async def _watch(self, target: Target) -> None:
        """Active health: GET /models every `health_check_interval_s`."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(target.config.health_check_interval_s)
            if await target.check():
                if target.health.state != target.health.UP:
                    target.health.success()
            else:
                target.health.failure(loop.time())

    def collect(self) -> Iterator[Metric]:
        failovers = CounterMetricFamily(
            "firsttoken_failovers",
            "Streams moved to another target, by route and phase.",
            labels=["route", "phase"],
        )
        for (route, phase), value in self.failovers.items():
            failovers.add_metric([route, phase], value)
        yield failovers
        handoffs = CounterMetricFamily(
            "firsttoken_handoffs",
            "Answers a route's hand-off target began and its targets continued.",
            labels=["route"],
        )
        for route, value in self.handoffs.items():
            handoffs.add_metric([route], value)
        yield handoffs
        up = GaugeMetricFamily(
            "firsttoken_target_up", "1 while a target is not ejected.", labels=["target"]
        )
        # target_up stays 0 past the cool-down until a request probes the target: this says
        # when that probe may go (0: not ejected, or its turn has come). The health's clock
        # is the loop's; a scrape from another thread reads the same monotonic clock.
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:
            now = time.monotonic()
        probe = GaugeMetricFamily(
            "firsttoken_target_probe_in_seconds",
            "Seconds until an ejected target's next request probes it.",
            labels=["target"],
        )
        queue = GaugeMetricFamily(
            "firsttoken_queue_length", "Streams waiting for a target's slot.", labels=["target"]
        )
        wait = HistogramMetricFamily(
            "firsttoken_queue_wait_seconds",
            "Time a stream waited for a target's slot.",
            labels=["target"],
        )
        for target in self.targets.values():
            up.add_metric([target.name], int(target.health.up))
            at = target.health.probe_at
            probe.add_metric([target.name], 0.0 if at is None else max(0.0, at - now))
            queue.add_metric([target.name], target.queued)
            hist = target.queue_wait
            wait.add_metric([target.name], buckets=hist.cumulative(), sum_value=hist.sum)
        yield up
        yield probe
        yield queue
        yield wait


def _serves(listed: tuple[str, ...], model: str) -> bool:
    """Whether an upstream listing `listed` knows `model`: by its id, or as the alias of a
    dated id (Anthropic lists `claude-sonnet-4-5-20250929` and answers `claude-sonnet-4-5`)."""
    return model in listed or any(m.startswith(model + "-") for m in listed)


def _closing(
    leg: Leg,
) -> Callable[
    [type[BaseException] | None, BaseException | None, TracebackType | None], Awaitable[bool]
]:
    """`leg.close` as an exit callback: it hears what ended the leg."""

    async def close(
        kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        await leg.close(exc)
        return False

    return close
