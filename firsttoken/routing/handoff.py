"""The hand-off: a route's edge target starts the answer, its center continues it.

`Handoffs.plan` gives an answer its `Handover` when the edge can take it: the center that
will likely take over is asked for a prefill at once (its prefix cache warms while the edge
writes), and the edge's text is paced so the client does not wait through the seam
(routing/seam.py). `hands_off` says, per edge delta, when the edge's part ends; the center's
first delta is then the hand-off (`took`); a center that cannot take it leaves the edge to
finish, where the route allows (`fallback`). `answer` wraps the answer of a route that hands
off: the pace, and the prefill's bill before the last delta.

Cost: none for a route without `handoff` (`plan` returns at once; `generate` returns the
answer unwrapped). With one: a prefill task and a pacer per answer, and per edge delta the
`Seam`'s arithmetic (a clock read, a few comparisons, a regular expression at a boundary).
Time is the loop's clock (virtual in the tests).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing, suppress
from typing import Any

from firsttoken.generation import Delta, EngineError, GenerationRequest
from firsttoken.routing.config import ModelRoute
from firsttoken.routing.course import Course, State
from firsttoken.routing.failover import Said, rendezvous, source
from firsttoken.routing.seam import EdgePacer, Seam, prefill_request
from firsttoken.routing.splice import Transcript, continuation
from firsttoken.routing.target import Target

__all__ = ["Handoffs", "Handover", "paced", "prefill_meta"]

# One leg read as a generator (the router's `_leg`), for the prefill read from a task.
OpenLeg = Callable[[Target, GenerationRequest, ModelRoute], AsyncGenerator[Delta, None]]


class Handover:
    """One answer's hand-off: the edge until its leg starts, the one whose part is done
    while the answer is in `State.HANDOFF`, the timing (`seam`), the pace and the prefill."""

    __slots__ = (
        "asked_at",
        "began_at",
        "edge",
        "fell_back",
        "handing",
        "pacer",
        "prefill",
        "prefill_to",
        "seam",
    )

    def __init__(self, edge: Target, seam: Seam, pacer: EdgePacer | None) -> None:
        self.edge: Target | None = edge  # the first target, until its leg starts
        self.handing: Target | None = None  # the target whose part is done (HANDOFF)
        self.fell_back = False  # the edge was asked to finish what the center could not take
        self.seam = seam
        self.pacer = pacer  # the edge's text held back (pace_ms > 0)
        self.prefill: asyncio.Task[bool] | None = None  # the center's prefill, under way
        self.prefill_to = ""  # the center asked for the prefill
        self.asked_at: float | None = None  # when the center was asked to take over
        self.began_at: float | None = None  # when the current leg gave its first delta


class Handoffs:
    """The hand-off policy of a router's routes. `counts`: answers handed off, by route
    (`firsttoken_handoffs`)."""

    def __init__(
        self, targets: Mapping[str, Target], routes: Mapping[str, Any], said: Said, leg: OpenLeg
    ) -> None:
        self.targets = targets
        self.said = said
        self.leg = leg
        self.counts: dict[str, int] = dict.fromkeys(routes, 0)
        self._prefills: set[asyncio.Task[bool]] = set()  # running on past their answers

    def close(self) -> None:
        for task in self._prefills:
            task.cancel()

    # -- before the answer -----------------------------------------------------------------

    def plan(self, course: Course) -> None:
        """Give `course` its hand-off when the route has one and its edge can take the
        request now (else the center answers from the start)."""
        handoff, request = course.route.handoff, course.request
        if handoff is None or "continuation" in request.options:
            return
        edge = self.targets[handoff.source]
        now = asyncio.get_running_loop().time()
        if not (edge.has_room() and edge.health.acquire(now, course.owner)):
            return
        seam = Seam(handoff.after_tokens, sentence=handoff.at == "sentence", prefill=False)
        pacer = EdgePacer(handoff.pace_ms / 1000) if handoff.pace_ms > 0 else None
        handover = course.handover = Handover(edge, seam, pacer)
        center = self.likely_center(course)
        if center is None:
            return
        # Without a prefill a continuation costs the center's usual first-token time.
        seam.warm_s = center.first_token_s
        if handoff.prefill:
            seam.prefill = True
            seam.warm_s = center.handoff_s
            if center.prefill_s is not None:
                seam.expect_ready_at = now + center.prefill_s
            loop = asyncio.get_running_loop()
            handover.prefill = loop.create_task(self._prefill(course, center, seam))
            handover.prefill_to = center.name

    def likely_center(self, course: Course) -> Target | None:
        """The target a hand-off would go to now, as `Failover.pick` would rank them
        (without taking it: the continuation takes its own turn)."""
        now = asyncio.get_running_loop().time()
        names = list(course.order)
        if course.session is not None:
            session = course.session
            names.sort(key=lambda n: rendezvous(session, n), reverse=True)
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
            async with aclosing(self.leg(center, request, course.route)) as deltas:
                async for _ in deltas:
                    break
        except EngineError as exc:
            self.said(
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

    # -- during the answer -----------------------------------------------------------------

    def first_leg(self, course: Course) -> Target | None:
        """The edge, for the answer's first leg (once)."""
        handover = course.handover
        if handover is None or handover.edge is None:
            return None
        edge, handover.edge = handover.edge, None
        return edge

    def hands_off(self, handover: Handover, transcript: Transcript, delta: Delta) -> bool:
        """Whether the edge's part ends after `delta`: by time (routing/seam.py), bounded by
        the route's `after_tokens`."""
        if delta.finish_reason is not None or not delta.text or transcript.why_not() is not None:
            return False
        now = asyncio.get_running_loop().time()
        pacer, tokens = handover.pacer, transcript.text_tokens
        in_hand = pacer.in_hand(now) if pacer is not None else 0.0
        began = handover.began_at
        edge_itl = (now - began) / (tokens - 1) if began is not None and tokens > 1 else None
        return handover.seam.hands_off(
            now,
            tokens,
            in_hand,
            _sentence_end(delta.text),
            edge_itl=edge_itl,
            pace_s=pacer.pace_s if pacer is not None else 0.0,
        )

    def handing_over(self, course: Course) -> None:
        """The edge's leg is closed (the answer is in HANDOFF): the center is asked now, and
        the held text is spread over its expected delay."""
        handover = course.handover
        assert handover is not None
        handover.handing = course.target
        now = asyncio.get_running_loop().time()
        handover.asked_at = now
        if handover.pacer is not None:
            handover.pacer.handed_off(handover.seam.expected_first(now))

    def fallback(self, course: Course) -> Target | None:
        """No center can take the answer: the edge finishes it, where the route allows
        (once). Raises when the hand-off itself can go nowhere."""
        handoff, handover = course.route.handoff, course.handover
        if handoff is None or handover is None:
            return None
        if course.state is State.HANDOFF:
            handing = handover.handing
            if handoff.fallback and handing is not None and handing.continues:
                if not handover.fell_back:
                    handover.fell_back = True
                    return handing
            raise EngineError(
                "upstream_unavailable",
                f"no target of the route {course.route.name!r} could take the hand-off",
                retryable=True,
                status=503,
            )
        if course.cut is not None and course.handoffs:
            # The center broke off after it took over, and no other can continue: the edge
            # finishes the answer, where allowed (a splice onto it).
            edge = self.targets[handoff.source]
            if handoff.fallback and edge.continues and not handover.fell_back:
                handover.fell_back = True
                return edge
        return None

    def began(self, handover: Handover, continues: bool, now: float) -> None:
        """A leg's first delta; one that `continues` the answer (a hand-off taken, a splice)
        lets its text flow: what the pacer holds leaves now."""
        handover.began_at = now
        if continues and handover.pacer is not None:
            handover.pacer.release()

    def took(self, course: Course, target: Target, at_token: int) -> Delta:
        """`target`'s first delta after the edge's part: the hand-off (or the edge's own
        fallback) is counted, said, and its meta event is what the client sees first."""
        handover = course.handover
        assert handover is not None and handover.handing is not None
        handing, handover.handing = handover.handing, None
        if handing is not target and handover.asked_at is not None:
            self._learn(handover, target)
        course.handoffs += 1
        route, request = course.route, course.request
        fell_back = handing is target
        if not fell_back:
            self.counts[route.name] += 1
        self.said(
            "route.handoff_fallback" if fell_back else "route.handoff",
            stream=request.request_id,
            route=route.name,
            **source(handing),
            to=target.name,
            at_token=at_token,
        )
        info: dict[str, object] = {"from": handing.name, "to": target.name, "at_token": at_token}
        if fell_back:
            info["fallback"] = True  # the center could not take it: the edge finished it
        return Delta(meta={"handoff": info})

    def _learn(self, handover: Handover, target: Target) -> None:
        """The center's delay on this hand-off, from the later of its asking and its
        readiness (a prefill's answer) to its first token."""
        now = asyncio.get_running_loop().time()
        since = handover.asked_at or now
        seam = handover.seam
        if not seam.prefill or seam.ready_at is None:
            return  # no prefill (or none answered): this delay says nothing about a warm one
        target.took_over(max(0.0, now - max(since, seam.ready_at)))

    # -- around the answer -----------------------------------------------------------------

    async def answer(
        self, plan: Callable[[], Course], answer_of: Callable[[Course], AsyncGenerator[Delta, None]]
    ) -> AsyncGenerator[Delta, None]:
        """The answer of a route that hands off (`answer_of` the course `plan` makes, once
        this is first read): paced, and its prefill ended with it."""
        course = plan()
        handover = course.handover
        complete = False
        try:
            async with aclosing(answer_of(course)) as answer:
                if handover is None or handover.pacer is None:
                    async for delta in answer:
                        if delta.finish_reason is not None and handover is not None:
                            if (billed := prefill_meta(handover)) is not None:
                                yield billed
                        yield delta
                else:
                    # Closed first: its read of `answer` ends before `answer` is closed.
                    async with aclosing(paced(handover.pacer, answer)) as deltas:
                        async for delta in deltas:
                            if delta.finish_reason is not None:
                                if (billed := prefill_meta(handover)) is not None:
                                    yield billed
                            yield delta
            complete = True
        finally:
            if handover is not None:
                self._end_prefill(handover, complete)

    def _end_prefill(self, handover: Handover, complete: bool) -> None:
        """A prefill still under way when the answer is complete runs to its answer (the
        center's time to be ready is learned from it); otherwise it is cancelled."""
        task = handover.prefill
        if task is None or task.done():
            return
        if not complete:
            task.cancel()  # its leg closes as the task ends
            return
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)


def prefill_meta(handover: Handover) -> Delta | None:
    """Just before the answer's last delta: the meta event that bills the hand-off's prefill
    (the conversation's prompt and one token at the center's prices, `Ticket.seam`), unless
    the center refused it. Once per answer; a prefill still under way runs on."""
    task, to = handover.prefill, handover.prefill_to
    if task is None or not to:
        return None
    handover.prefill_to = ""
    if task.done() and (task.cancelled() or task.exception() is not None or not task.result()):
        return None
    return Delta(meta={"prefill": {"target": to}})


_SENTENCE_END = re.compile(r"""[.!?。！？…]["'”’)\]]*\s*$|\n\s*$""")


def _sentence_end(text: str) -> bool:
    return bool(_SENTENCE_END.search(text))


async def paced(pacer: EdgePacer, answer: AsyncIterator[Delta]) -> AsyncGenerator[Delta, None]:
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
