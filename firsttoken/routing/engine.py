"""The routed engine: an engine made of engines.

A request names a model; its route lists targets in order. The router sends the request to
the first healthy one, watches each phase's deadline (connect, first token, silence between
chunks, total), fails over while nothing was sent, and, once the answer has begun, splices:
the next target that can continue gets the conversation plus the text already sent, and its
deltas carry on the same stream. The client sees one answer: the stream and its log are the
core's, and only deltas leave this module.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AsyncExitStack, aclosing, suppress
from dataclasses import replace
from types import TracebackType
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from firsttoken.generation import (
    TARGET_FAULTS,
    BaseEngine,
    Delta,
    EmbeddingRequest,
    Embeddings,
    EngineError,
    GenerationRequest,
)
from firsttoken.routing.config import Handoff, ModelRoute, RouteTable
from firsttoken.routing.leg import Leg, LegWatch, RouteObserver
from firsttoken.routing.seam import Pacer, Seam, prefill_request
from firsttoken.routing.splice import Transcript, continuation, spliced_usage
from firsttoken.routing.target import Target
from firsttoken.telemetry.metrics import log_event

__all__ = [
    "KNOWN_FIELDS",
    "MAX_CHARS_PER_TOKEN",
    "PHASES",
    "Course",
    "LegWatch",
    "RouteObserver",
    "RoutedEngine",
]

PHASES = ("connect", "first_token", "mid_stream")
# Request fields of Chat Completions and Completions (and the router's own continuation's):
# a body with any other field (vLLM's and SGLang's extras, the `synthetic` knobs) hands the
# upstream something the gateway passes on unread, and a failure there may be that field's.
KNOWN_FIELDS = frozenset(
    """model messages prompt stream stream_options max_tokens max_completion_tokens temperature
    top_p n stop seed presence_penalty frequency_penalty logit_bias logprobs top_logprobs user
    tools tool_choice parallel_tool_calls response_format functions function_call metadata
    store service_tier reasoning_effort modalities audio prediction web_search_options
    verbosity suffix echo continue_final_message add_generation_prompt""".split()
)
# More characters per token than any tokenizer averages over a prompt (BPE vocabularies run
# 3-5 for prose; runs of spaces or repeated words can merge further, hence the margin).
MAX_CHARS_PER_TOKEN = 16


class Course:
    """One answer's way through its route: what was sent, which targets were tried, and
    where the answer stands between legs (a failover, a splice, a hand-off under way)."""

    __slots__ = (
        "asked_at",
        "cut",
        "edge",
        "failed",
        "fell_back",
        "handed",
        "handing",
        "handoffs",
        "last",
        "leg_began_at",
        "leg_request",
        "order",
        "owner",
        "pacer",
        "prefill",
        "prefill_to",
        "request",
        "route",
        "seam",
        "session",
        "splices",
        "splicing",
        "started",
        "target",
        "transcript",
        "tried",
    )

    def __init__(
        self, route: ModelRoute, request: GenerationRequest, order: tuple[str, ...]
    ) -> None:
        self.route = route
        self.request = request
        self.order = order  # the route's targets, in the order they are tried
        self.session: bytes | None = None  # balance = "session": the conversation's key
        self.owner: str | None = None  # whose failure a failure is (a key's, or the target's)
        self.transcript = Transcript()
        self.tried: set[str] = set()
        self.leg_request = request  # what the current leg asks (a continuation once spliced)
        self.splices = 0
        self.handoffs = 0
        self.cut: EngineError | None = None  # what broke the answer off, once it had begun
        self.last: EngineError | None = None  # the last refusal before any token
        self.failed: tuple[Target, str] | None = None  # the leg that failed, and its phase
        self.edge: Target | None = None  # the hand-off's first target, until its leg starts
        self.handing: Target | None = None  # set while the answer goes from the edge on
        self.fell_back = False  # the edge was asked to finish what the center could not take
        self.seam: Seam | None = None  # a hand-off's timing
        self.pacer: Pacer | None = None  # a hand-off's pace: the edge's text held back
        self.prefill: asyncio.Task[bool] | None = None  # the center's prefill, under way
        self.prefill_to = ""  # the center asked for the prefill
        self.asked_at: float | None = None  # when the center was asked to take over
        # this turn's
        self.splicing = False  # text was sent before this leg: it continues the answer
        self.target: Target  # set by begin_leg
        self.started = False  # the leg gave a delta
        self.leg_began_at: float | None = None  # when it did
        self.handed = False  # the leg was the edge's, and its part is done

    def begin_leg(self, target: Target) -> None:
        self.target = target
        self.started = False
        self.leg_began_at = None
        self.handed = False


class RoutedEngine(BaseEngine):
    """`--routes FILE` (or the `--upstream` shorthand): model names → ordered targets."""

    def __init__(self, table: RouteTable, targets: Mapping[str, Target]) -> None:
        self.table = table
        self.targets = dict(targets)
        self.routes: dict[str, ModelRoute] = dict(table.routes)
        self.models: tuple[str, ...] = tuple(table.routes)
        self.failovers: dict[tuple[str, str], int] = {
            (route, phase): 0 for route in table.routes for phase in PHASES
        }
        self.handoffs: dict[str, int] = dict.fromkeys(table.routes, 0)
        self.observer: RouteObserver | None = None  # --otlp-endpoint: spans per leg, events
        self._current: dict[str, Target] = {}
        self._turn = 0
        self._checks: dict[str, asyncio.Task[None]] = {}  # active health, by target
        self._prefills: set[asyncio.Task[bool]] = set()  # running on past their answers

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
        for task in (*self._checks.values(), *self._prefills):
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
        while (target := self._pick(route, route.targets, tried, splicing=False)) is not None:
            tried.add(target.name)
            model = self._model(route, target, request.model)
            try:
                answer = await target.engine.embed(replace(request, model=model))
            except EngineError as exc:
                if not exc.retryable:
                    target.health.release()
                    raise _named(exc, target) from None
                target.health.failure(loop.time())
                failure = _named(exc, target)
                continue
            target.health.success()
            return replace(answer, target=target.name)
        raise failure if failure is not None else self._unavailable(route)

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        route = self.routes.get(request.model) or self.table.default
        if route.handoff is None:
            # Nothing to pace and no prefill to end: the answer's own generator, not a
            # wrapper (nothing more per delta).
            return self._answer(self._course(request))
        return self._handed(request)

    async def _handed(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        """The answer of a route that hands off: paced, and its prefill ended with it."""
        course = self._course(request)
        complete = False
        try:
            async with aclosing(self._answer(course)) as answer:
                if course.pacer is None:
                    async for delta in answer:
                        if delta.finish_reason is not None and course.prefill_to:
                            if (billed := _prefill_meta(course)) is not None:
                                yield billed
                        yield delta
                else:
                    # Closed first: its read of `answer` ends before `answer` is closed.
                    async with aclosing(_paced(course.pacer, answer)) as paced:
                        async for delta in paced:
                            if delta.finish_reason is not None and course.prefill_to:
                                if (billed := _prefill_meta(course)) is not None:
                                    yield billed
                            yield delta
            complete = True
        finally:
            self._end_prefill(course, complete)

    def _end_prefill(self, course: Course, complete: bool) -> None:
        """A prefill still under way when the answer is complete runs to its answer (the
        center's time to be ready is learned from it); otherwise it is cancelled."""
        task = course.prefill
        if task is None or task.done():
            return
        if not complete:
            task.cancel()  # its leg closes as the task ends
            return
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)

    async def _answer(self, course: Course) -> AsyncGenerator[Delta, None]:
        """The answer over as many legs as it takes: each turn asks the next target (the
        hand-off's edge first, where one applies) and streams its deltas; a leg that breaks
        off is reported, and the next turn fails over or splices. Per delta the leg's work
        is plain calls (`Leg.next`, the transcript, the hand-off check): no generator of
        its own between the target's deltas and the stream."""
        transcript = course.transcript
        while True:
            course.splicing = transcript.tokens > 0
            leg_request = self._next_request(course)
            if leg_request is None:  # cut exactly at max_tokens: it is complete
                yield Delta("", "length")
                return
            target, limit = self._next_target(course)
            course.begin_leg(target)
            before_tokens, before_text = transcript.tokens, transcript.text_tokens
            spliced = False
            try:
                # Closed here, not by the collector: a client that leaves frees the leg now.
                async with AsyncExitStack() as legs:
                    read = await self._begin_leg(course, target, leg_request, legs)
                    while (delta := await read()) is not None:
                        if not course.started:
                            seam = self._leg_began(course, before_tokens)
                            spliced = bool(course.splices or course.handoffs)
                            if seam is not None:
                                yield seam
                        transcript.add(delta)
                        if spliced and delta.finish_reason is not None:
                            delta.usage = spliced_usage(delta.usage, before_tokens, before_text)
                        yield delta
                        if limit is not None and self._hands_off(course, delta, limit):
                            course.handed = True
                            break  # the edge's part is done: closing the leg stops it
            except EngineError as exc:
                self._leg_failed(course, exc)
                continue
            except BaseException:
                if not course.started:  # the client left (or a bug): a half-open probe goes back
                    course.target.health.release()
                raise
            if not course.handed:
                return
            course.handing = course.target
            self._handing_over(course)

    def _course(self, request: GenerationRequest) -> Course:
        """The plan for one answer: its route, the order of its targets, and the edge that
        starts it when the route hands off."""
        route = self.routes.get(request.model) or self.table.default
        short = self._short(route, request)
        order = (
            (
                route.short_prompts.target,
                *(n for n in route.targets if n != route.short_prompts.target),
            )
            if short and route.short_prompts is not None
            else route.targets
        )
        course = Course(route, request, order)
        course.session = _session_key(request) if route.balance == "session" else None
        # Whose a failure is: the key's, when its request hands the upstream fields the
        # gateway does not read (TargetHealth counts those per key first); else the target's.
        course.owner = request.tenant if _passes_through(request) else None
        # The hand-off's first target, when it applies: not for a short prompt, which the
        # small target answers whole.
        course.edge = None if short else self._edge(route, request)
        if course.edge is not None and route.handoff is not None:
            self._plan_seam(course, route.handoff)
        return course

    def _plan_seam(self, course: Course, handoff: Handoff) -> None:
        """The hand-off's timing: the center that will likely take over is asked for the
        prefill now, and the edge's text is paced (routes/seam.py)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        center = self._likely_center(course)
        seam = Seam(handoff.after_tokens, sentence=handoff.at == "sentence", prefill=False)
        if center is not None:
            # Without a prefill a continuation costs the center's usual first-token time.
            seam.warm_s = center.first_token_s
            if handoff.prefill:
                seam.prefill = True
                seam.warm_s = center.handoff_s
                if center.prefill_s is not None:
                    seam.expect_ready_at = now + center.prefill_s
                course.prefill = loop.create_task(self._prefill(course, center, seam))
                course.prefill_to = center.name
        course.seam = seam
        if handoff.pace_ms > 0:
            course.pacer = Pacer(handoff.pace_ms / 1000)

    def _likely_center(self, course: Course) -> Target | None:
        """The target a hand-off would go to now, as `_pick` would rank them (without
        taking it: the continuation takes its own turn)."""
        now = asyncio.get_running_loop().time()
        names = list(course.order)
        if course.session is not None:
            names.sort(key=lambda n: _rendezvous(course.session or b"", n), reverse=True)
        for name in names:
            target = self.targets[name]
            if target.continues and target.has_room() and target.health.available(now):
                return target
        return None

    async def _prefill(self, course: Course, center: Target, seam: Seam) -> bool:
        """Ask `center` for the conversation alone, one token, thrown away: its prefix cache
        warms while the edge writes, and its answer says the center is ready. False: the
        center refused it (nothing to bill)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        request = course.request
        if center.config.continuation == "completions":
            # The gateway renders this center's chat itself: the prefill is rendered the same
            # way (the continuation of nothing), or its cache would hold another prompt.
            request = continuation(request, Transcript()) or request
        request = prefill_request(request)
        try:
            async with aclosing(self._leg(center, request, course.route)) as deltas:
                async for _ in deltas:
                    break
        except EngineError as exc:
            self._said(
                "route.prefill_failed",
                logging.WARNING,
                stream=course.request.request_id,
                route=course.route.name,
                target=center.name,
                code=exc.code,
                error=exc.message[:200],
            )
            return False
        now = loop.time()
        seam.ready(now)
        center.prefilled(now - began)
        return True

    def _next_request(self, course: Course) -> GenerationRequest | None:
        """What the next leg is asked: the request itself, or once text was sent, its
        continuation (None: nothing is left of max_tokens). Raises the cut when the answer
        may not be continued."""
        transcript, route, request = course.transcript, course.route, course.request
        if not course.splicing:
            return course.leg_request
        why = transcript.why_not()
        if why is None and course.handing is None and course.splices >= route.max_splices:
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

    def _next_target(self, course: Course) -> tuple[Target, int | None]:
        """The next leg's target, and the tokens after which it hands off (None: it does
        not); raises when no target is left."""
        route, handoff, handing = course.route, course.route.handoff, course.handing
        if course.edge is not None:
            target, course.edge = course.edge, None
            assert handoff is not None
            return target, handoff.after_tokens
        picked = self._pick(
            route, course.order, course.tried, course.splicing, course.session, course.owner
        )
        if picked is None and handing is not None and handoff is not None:
            # The center cannot take it: the edge finishes the answer, where allowed.
            if handoff.fallback and handing.continues and not course.fell_back:
                course.fell_back = True
                return handing, None
            raise EngineError(
                "upstream_unavailable",
                f"no target of the route {route.name!r} could take the hand-off",
                retryable=True,
                status=503,
            )
        if picked is None and course.cut is not None and course.handoffs and handoff is not None:
            # The center broke off after it took over, and no other can continue: the edge
            # finishes the answer, where allowed (a splice onto it).
            edge = self.targets[handoff.source]
            if handoff.fallback and edge.continues and not course.fell_back:
                course.fell_back = True
                return edge, None
        if picked is None:
            if course.cut is not None:
                raise course.cut
            if course.last is not None:
                raise _for_client(course.last)
            raise self._unavailable(route)
        return picked, None

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
        route, request = course.route, course.request
        course.tried.add(target.name)
        if course.failed is not None and not course.splicing:
            self._count_failover(route, request, course.failed, target, course.transcript)
            course.failed = None
        if not (course.splicing and route.hedge):
            leg = await self._open_leg(target, leg_request, route)
            legs.push_async_exit(_closing(leg))
            return leg.next
        # A slow continuation is also asked of the next target; the first to answer carries
        # on (the seam is what the user waits through).
        deltas: AsyncIterator[Delta] = await legs.enter_async_context(
            aclosing(self._leg(target, leg_request, route))
        )
        try:
            target, deltas = await self._hedged(
                route,
                request,
                course.order,
                course.tried,
                course.session,
                target,
                deltas,
                leg_request,
                legs,
            )
        except EngineError as exc:
            failed_target = exc.target
            if failed_target is not None and failed_target in self.targets:
                course.target = self.targets[failed_target]
            raise
        course.target = target
        return _Reader(deltas).next

    def _leg_began(self, course: Course, before_tokens: int) -> Delta | None:
        """The leg's first delta came: its target is well, and the seam's meta event, if
        any, goes first."""
        course.started = True
        course.leg_began_at = asyncio.get_running_loop().time()
        course.target.health.success()
        return self._seam(course, course.target, before_tokens)

    def _seam(self, course: Course, target: Target, before_tokens: int) -> Delta | None:
        """The meta event of a leg's first delta: a hand-off taken, or a splice (counted
        when it takes: a continuation that a target refused is no seam)."""
        route, request = course.route, course.request
        if course.pacer is not None and (course.handing is not None or course.splicing):
            course.pacer.release()  # the next leg's text flows: what is held leaves now
        if course.handing is not None:
            if course.handing is not target and course.asked_at is not None:
                self._learn_handoff(course, target)
            course.handoffs += 1
            meta = self._handed_off(route, request, course.handing, target, before_tokens)
            course.handing = None
            return meta
        if not course.splicing:
            return None
        course.splices += 1
        if course.failed is not None:
            self._count_failover(route, request, course.failed, target, course.transcript)
            course.failed = None
        return _failover_meta(failed_from(course.cut), target, before_tokens)

    def _learn_handoff(self, course: Course, target: Target) -> None:
        """The center's delay on this hand-off, from the later of its asking and its
        readiness (a prefill's answer) to its first token."""
        now = asyncio.get_running_loop().time()
        since = course.asked_at or now
        seam = course.seam
        if seam is None or not seam.prefill or seam.ready_at is None:
            return  # no prefill (or none answered): this delay says nothing about a warm one
        target.took_over(max(0.0, now - max(since, seam.ready_at)))

    def _hands_off(self, course: Course, delta: Delta, limit: int) -> bool:
        """Whether the edge's part ends after `delta`: by time (routes/seam.py), bounded by
        the route's `after_tokens`."""
        transcript, seam = course.transcript, course.seam
        if delta.finish_reason is not None or not delta.text or transcript.why_not() is not None:
            return False
        if seam is None:
            return transcript.text_tokens >= limit
        now = asyncio.get_running_loop().time()
        pacer, tokens = course.pacer, transcript.text_tokens
        in_hand = pacer.in_hand(now) if pacer is not None else 0.0
        began = course.leg_began_at
        edge_itl = (now - began) / (tokens - 1) if began is not None and tokens > 1 else None
        return seam.hands_off(
            now,
            tokens,
            in_hand,
            _sentence_end(delta.text),
            edge_itl=edge_itl,
            pace_s=pacer.pace_s if pacer is not None else 0.0,
        )

    def _handing_over(self, course: Course) -> None:
        """The edge's leg is closed: the center is asked now, and the held text is spread
        over its expected delay."""
        now = asyncio.get_running_loop().time()
        course.asked_at = now
        if course.pacer is not None and course.seam is not None:
            course.pacer.handed_off(course.seam.expected_first(now))

    def _leg_failed(self, course: Course, error: EngineError) -> None:
        """A leg failed: tell its target's health, then raise what the client gets, or
        note how the next turn goes on (failover before the first token, else a splice)."""
        target = course.target
        self._target_failed(
            course.route, course.request, target, error, course.transcript.tokens, course.owner
        )
        splicing = course.splicing
        if error.client_fault and not splicing:
            raise error  # another target would refuse the same request
        if not (error.retryable or error.client_fault):
            raise error
        if course.started:
            course.cut = _named(error, target)
            course.failed = (target, "mid_stream")
            course.handing = None  # a leg that began and broke is a cut, whatever it followed
        elif splicing:
            pass  # a continuation refused or failed: the seam is still the first cut
        else:
            course.failed = (target, "connect" if error.status is not None else "first_token")
            course.last = error

    async def _hedged(
        self,
        route: ModelRoute,
        request: GenerationRequest,
        order: tuple[str, ...],
        tried: set[str],
        session: bytes | None,
        target: Target,
        deltas: AsyncIterator[Delta],
        leg_request: GenerationRequest,
        legs: AsyncExitStack,
    ) -> tuple[Target, AsyncIterator[Delta]]:
        """The first delta of `target`'s leg; if it is slower than `target.hedge_after()`,
        the next target's leg starts too, and the first to answer wins (the other is
        closed). Returns the winner and its deltas, the first one included. A leg that fails
        while the other runs is reported and passed over; when both fail, the last error is
        raised with `.target` set."""
        owner = request.tenant if _passes_through(request) else None
        racers: dict[asyncio.Future[Delta], tuple[Target, AsyncIterator[Delta]]] = {}
        racers[asyncio.ensure_future(anext(deltas))] = (target, deltas)
        spare_at: float | None = asyncio.get_running_loop().time() + target.hedge_after()
        error: BaseException | None = None
        try:
            while racers:
                timeout = None
                if spare_at is not None:
                    timeout = max(0.0, spare_at - asyncio.get_running_loop().time())
                done, _ = await asyncio.wait(
                    racers, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:  # slow: ask the next target as well
                    spare_at = None
                    spare = self._pick(route, order, tried, True, session, owner)
                    if spare is None:
                        continue
                    tried.add(spare.name)
                    self._said(
                        "route.hedge",
                        stream=request.request_id,
                        route=route.name,
                        target=target.name,
                        to=spare.name,
                    )
                    more = await legs.enter_async_context(
                        aclosing(self._leg(spare, leg_request, route))
                    )
                    racers[asyncio.ensure_future(anext(more))] = (spare, more)
                    continue
                for future in done:
                    who, its = racers.pop(future)
                    failure = future.exception()
                    if failure is None:
                        return who, _chain(future.result(), its)
                    if isinstance(failure, StopAsyncIteration):
                        return who, _chain(None, its)  # ended at once: nothing more to read
                    error = failure
                    if racers:  # the other still runs: this one is reported here
                        if isinstance(failure, EngineError):
                            self._target_failed(route, request, who, failure, 0, owner)
                        else:
                            raise failure
                    elif isinstance(failure, EngineError):
                        failure.target = who.name
            assert error is not None
            raise error
        finally:
            for future in racers:
                future.cancel()  # the loser (its leg is closed by `legs`)
            if racers:
                # Let the cancelled reads end before anyone closes their legs.
                await asyncio.wait(racers)

    def _target_failed(
        self,
        route: ModelRoute,
        request: GenerationRequest,
        target: Target,
        error: EngineError,
        at_token: int,
        owner: str | None = None,
    ) -> None:
        """Tell the target's health, and the log. Health hears only what says something
        about the target: not a full queue, not the request's own fault, not a continuation
        it refused (prefill); an upstream's Retry-After is a pause it asked for. A failure
        with an `owner` (a key's request with fields passed through unread) is that key's
        until another key's fail too (`TargetHealth.failure`)."""
        now = asyncio.get_running_loop().time()
        # A passthrough route sends the client's own model name: a 404 may only say that this
        # upstream does not serve it (another of the route's may), not that it is broken.
        unserved = route.passthrough and error.status == 404
        if error.code == "queue_timeout" or error.client_fault or unserved:
            target.health.release()
        elif error.retry_after_s is not None and error.status in (429, 503, 529):
            target.health.hold(now, error.retry_after_s)
        else:
            target.health.failure(now, owner)
        self._said(
            "route.target_failed",
            logging.WARNING,
            stream=request.request_id,
            route=route.name,
            target=target.name,
            code=error.code,
            error=error.message[:200],
            at_token=at_token,
        )

    def _short(self, route: ModelRoute, request: GenerationRequest) -> bool:
        """Whether the route's `short_prompts` rule takes this request: its prompt, counted
        here (the edge's local tokenization), is short enough for the small target, which
        then goes first and answers it whole."""
        rule = route.short_prompts
        if rule is None:
            return False
        # A prompt this long is not short whatever the tokenizer: not worth tokenizing (on
        # the event loop) to find out.
        if len(request.prompt) > rule.max_prompt_tokens * MAX_CHARS_PER_TOKEN:
            return False
        target = self.targets[rule.target]
        return target.engine.prompt_tokens(request.prompt) <= rule.max_prompt_tokens

    def _edge(self, route: ModelRoute, request: GenerationRequest) -> Target | None:
        """The hand-off's first target, when the route has one and it can take the request
        now (else the center answers from the start)."""
        handoff = route.handoff
        if handoff is None or "continuation" in request.options:
            return None
        target = self.targets[handoff.source]
        now = asyncio.get_running_loop().time()
        owner = request.tenant if _passes_through(request) else None
        return target if target.has_room() and target.health.acquire(now, owner) else None

    def _handed_off(
        self,
        route: ModelRoute,
        request: GenerationRequest,
        source: Target,
        to: Target,
        at_token: int,
    ) -> Delta:
        fallback = source is to
        if not fallback:
            self.handoffs[route.name] += 1
        self._said(
            "route.handoff_fallback" if fallback else "route.handoff",
            stream=request.request_id,
            route=route.name,
            **_from(source),
            to=to.name,
            at_token=at_token,
        )
        info: dict[str, object] = {"from": source.name, "to": to.name, "at_token": at_token}
        if fallback:
            info["fallback"] = True  # the center could not take it: the edge finished it
        return Delta(meta={"handoff": info})

    # -- choosing a target -----------------------------------------------------------------

    def _pick(
        self,
        route: ModelRoute,
        order: tuple[str, ...],
        tried: set[str],
        splicing: bool,
        session: bytes | None = None,
        key: str | None = None,
    ) -> Target | None:
        now = asyncio.get_running_loop().time()
        candidates = [self.targets[n] for n in order if n not in tried]
        if session is not None and len(candidates) > 1:
            # Rendezvous hashing: a conversation's turns go to the same target (its prefix
            # cache), and only the sessions of a target that fails move elsewhere.
            candidates.sort(key=lambda t: _rendezvous(session, t.name), reverse=True)
        if splicing:
            # A seam should be short: a target failing other streams right now (not yet
            # ejected), or silent on all of them (a stall its deadlines have not caught
            # yet), goes after those that are not.
            candidates = [t for t in candidates if t.continues]
            candidates.sort(key=lambda t: (t.health.failures > 0, t.silent(now)))
        if route.balance == "least_busy" and len(candidates) > 1:
            self._turn += 1
            n = len(candidates)
            turn = {t.name: (i - self._turn) % n for i, t in enumerate(candidates)}
            candidates.sort(key=lambda t: (t.outstanding, turn[t.name]))
        # Healthy with room first; then healthy but full (it queues); then, when every
        # target is ejected, one anyway: a guess beats a certain refusal.
        for target in candidates:
            if target.has_room() and target.health.acquire(now, key):
                return target
        for target in candidates:
            if target.health.acquire(now, key):
                return target
        for target in candidates:
            if now >= target.health.held_until:
                return target
        return None

    def _unavailable(self, route: ModelRoute) -> EngineError:
        now = asyncio.get_running_loop().time()
        waits = [max(0.0, self.targets[n].health.held_until - now) for n in route.targets]
        return EngineError(
            "upstream_unavailable",
            f"no target of the route {route.name!r} can take the request now",
            retryable=True,
            status=503,
            retry_after_s=max(1.0, min(waits)) if waits else 1.0,
        )

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

    def _count_failover(
        self,
        route: ModelRoute,
        request: GenerationRequest,
        failed: tuple[Target, str],
        to: Target,
        transcript: Transcript,
    ) -> None:
        source, phase = failed
        self.failovers[(route.name, phase)] += 1
        self._said(
            "route.splice" if phase == "mid_stream" else "route.failover",
            stream=request.request_id,
            route=route.name,
            phase=phase,
            **_from(source),
            to=to.name,
            at_token=transcript.tokens,
        )

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


def _for_client(error: EngineError) -> EngineError:
    """The last target's error as the client gets it when no target is left. A target's own
    set-up fault (an upstream 401, 403 or 404: its key, model name or URL) is the gateway's
    502, not the client's 4xx; the message keeps the upstream's status."""
    if error.client_fault or error.status not in TARGET_FAULTS:
        return error
    return EngineError(error.code, error.message, retryable=True, type_="server_error", status=502)


def _from(source: Target) -> dict[str, Any]:
    """A route event's `from` field (a word Python keeps for itself), typed as any field."""
    return {"from": source.name}


def _named(error: EngineError, target: Target) -> EngineError:
    error.target = target.name
    return error


def failed_from(error: EngineError | None) -> str | None:
    return None if error is None else error.target


def _failover_meta(source: str | None, to: Target, at_token: int) -> Delta:
    return Delta(meta={"failover": {"from": source, "to": to.name, "at_token": at_token}})


_SENTENCE_END = re.compile(r"""[.!?。！？…]["'”’)\]]*\s*$|\n\s*$""")


def _sentence_end(text: str) -> bool:
    return bool(_SENTENCE_END.search(text))


def _passes_through(request: GenerationRequest) -> bool:
    """Whether the request hands an upstream fields the gateway does not read."""
    body = request.body
    if body is None:
        return bool(request.options.get("synthetic"))
    return not KNOWN_FIELDS.issuperset(body)


def _session_key(request: GenerationRequest) -> bytes:
    """A conversation's identity across its turns: the key and the conversation's start."""
    if request.messages:
        # Up to the first user message: what every later turn of the conversation repeats.
        first: list[str] = []
        for m in request.messages:
            first.append(m.get("content") or "")
            if m.get("role") == "user":
                break
        start = "\x00".join(first)
    else:
        start = request.prompt[:512]
    return hashlib.blake2b(
        f"{request.tenant}\x00{start}".encode(errors="replace"), digest_size=8
    ).digest()


def _rendezvous(session: bytes, target: str) -> bytes:
    return hashlib.blake2b(session + target.encode(), digest_size=8).digest()


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


class _Reader:
    """A hedged pair's winner, read as a leg is: a call per delta, None at the end."""

    __slots__ = ("deltas",)

    def __init__(self, deltas: AsyncIterator[Delta]) -> None:
        self.deltas = deltas

    async def next(self) -> Delta | None:
        try:
            return await anext(self.deltas)
        except StopAsyncIteration:
            return None


async def _chain(first: Delta | None, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    if first is not None:
        yield first
    async for delta in rest:
        yield delta


def _prefill_meta(course: Course) -> Delta | None:
    """Just before the answer's last delta: the meta event that bills the hand-off's prefill
    (the conversation's prompt and one token at the center's prices, `Ticket.seam`), unless
    the center refused it. Once per answer; a prefill still under way runs on."""
    task, to = course.prefill, course.prefill_to
    if task is None or not to:
        return None
    course.prefill_to = ""
    if task.done() and (task.cancelled() or task.exception() is not None or not task.result()):
        return None
    return Delta(meta={"prefill": {"target": to}})


async def _paced(pacer: Pacer, answer: AsyncIterator[Delta]) -> AsyncGenerator[Delta, None]:
    """`answer`'s deltas, in order, the edge's text let out by `pacer` while the answer is
    read as fast as it comes (the edge's leg is never slowed by the pace); once the next
    leg's text comes, straight through."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Future[Delta] | None = None
    failure: BaseException | None = None
    done = False
    try:
        while True:
            if pacer.released and not len(pacer) and not done:
                if pending is not None:
                    try:
                        delta = await pending
                    except StopAsyncIteration:
                        return
                    finally:
                        pending = None
                    yield delta
                async for delta in answer:
                    yield delta
                return
            now = loop.time()
            at = pacer.next_at(now)
            if at is not None and at <= now:
                yield pacer.take(now)
                continue
            if done:
                if at is None:
                    if failure is not None:
                        raise failure
                    return
                await asyncio.sleep(at - now)
                continue
            if pending is None:
                pending = asyncio.ensure_future(anext(answer))
            timeout = None if at is None else at - now
            finished, _ = await asyncio.wait((pending,), timeout=timeout)
            if not finished:
                continue
            future, pending = pending, None
            try:
                pacer.hold(future.result())
            except StopAsyncIteration:
                done = True
                pacer.release()
            except Exception as exc:
                # What the edge said is the client's before the error is.
                failure, done = exc, True
                pacer.release()
    finally:
        failure = None
        if pending is not None:
            pending.cancel()
            with suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
