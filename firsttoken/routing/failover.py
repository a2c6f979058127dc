"""Failover: which target a leg goes to, and what a leg's failure means for the answer.

`pick` ranks a route's untried targets (the session's rendezvous order, targets that can
continue for a splice, the least busy) and takes the first whose health lets it be asked;
`leg_failed` tells the target's health and moves the answer on (`course.advance`): a
failure before the first delta is a failover, after it a cut the next leg splices, and a
failure that is the client's answer is raised. Counting a failover and saying it is here too.

Cost: `pick` once per leg (a list of the route's targets, a sort only where the route
balances or splices); nothing per delta. Time is the loop's clock (virtual in the tests).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from firsttoken.generation import TARGET_FAULTS, Delta, EngineError, GenerationRequest
from firsttoken.routing.config import ModelRoute
from firsttoken.routing.course import Course, Event
from firsttoken.routing.target import Target

__all__ = [
    "PHASES",
    "Failover",
    "Said",
    "failover_meta",
    "for_client",
    "named",
    "rendezvous",
    "source",
]

PHASES = ("connect", "first_token", "mid_stream")


class Said(Protocol):
    """A route event's log line (and the observer's event): the router's `_said`."""

    def __call__(self, event: str, level: int = logging.INFO, **fields: Any) -> None: ...


class Failover:
    """The route's choice of target and its answer to a leg's failure. `counts`: the
    failovers by route and phase (the router's `firsttoken_failovers`)."""

    def __init__(self, targets: Mapping[str, Target], routes: Mapping[str, Any], said: Said):
        self.targets = targets
        self.said = said
        self.counts: dict[tuple[str, str], int] = {
            (route, phase): 0 for route in routes for phase in PHASES
        }
        self._turn = 0

    def pick(
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
            candidates.sort(key=lambda t: rendezvous(session, t.name), reverse=True)
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

    def unavailable(self, route: ModelRoute) -> EngineError:
        now = asyncio.get_running_loop().time()
        waits = [max(0.0, self.targets[n].health.held_until - now) for n in route.targets]
        return EngineError(
            "upstream_unavailable",
            f"no target of the route {route.name!r} can take the request now",
            retryable=True,
            status=503,
            retry_after_s=max(1.0, min(waits)) if waits else 1.0,
        )

    def none_left(self, course: Course) -> EngineError:
        """What the client gets when no target is left: the cut, the last refusal, or 503."""
        if course.cut is not None:
            return course.cut
        if course.last is not None:
            return for_client(course.last)
        return self.unavailable(course.route)

    def leg_failed(self, course: Course, error: EngineError, streaming: bool) -> None:
        """A leg failed (`streaming`: after its first delta): tell its target's health, then
        raise what the client gets, or move the answer on (a failover before the first
        delta, else a cut the next leg splices)."""
        target = course.target
        self.target_failed(
            course.route, course.request, target, error, course.transcript.tokens, course.owner
        )
        splicing = course.splicing
        if (error.client_fault and not splicing) or not (error.retryable or error.client_fault):
            course.to(Event.FATAL)
            raise error  # another target would refuse the same request (or it is final)
        if streaming:
            course.cut = named(error, target)
            course.failed = (target, "mid_stream")
            course.to(Event.BROKE)  # a leg that began and broke is a cut, whatever it followed
            return
        if not splicing:
            course.failed = (target, "connect" if error.status is not None else "first_token")
            course.last = error
        # else a continuation refused or failed: the seam is still the first cut
        course.to(Event.REFUSED)

    def target_failed(
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
        self.said(
            "route.target_failed",
            logging.WARNING,
            stream=request.request_id,
            route=route.name,
            target=target.name,
            code=error.code,
            error=error.message[:200],
            at_token=at_token,
        )

    def count(self, course: Course, to: Target) -> None:
        """The failover `course.failed` waits for, now that `to` takes the answer."""
        failed, course.failed = course.failed, None
        if failed is None:
            return
        failing, phase = failed
        self.counts[(course.route.name, phase)] += 1
        self.said(
            "route.splice" if phase == "mid_stream" else "route.failover",
            stream=course.request.request_id,
            route=course.route.name,
            phase=phase,
            **source(failing),
            to=to.name,
            at_token=course.transcript.tokens,
        )


def for_client(error: EngineError) -> EngineError:
    """The last target's error as the client gets it when no target is left. A target's own
    set-up fault (an upstream 401, 403 or 404: its key, model name or URL) is the gateway's
    502, not the client's 4xx; the message keeps the upstream's status."""
    if error.client_fault or error.status not in TARGET_FAULTS:
        return error
    return EngineError(error.code, error.message, retryable=True, type_="server_error", status=502)


def source(failing: Target) -> dict[str, Any]:
    """A route event's `from` field (a word Python keeps for itself), typed as any field."""
    return {"from": failing.name}


def named(error: EngineError, target: Target) -> EngineError:
    error.target = target.name
    return error


def failover_meta(cut: EngineError | None, to: Target, at_token: int) -> Delta:
    """The meta event of a splice that took: from the target that broke off, to `to`."""
    came = None if cut is None else cut.target
    return Delta(meta={"failover": {"from": came, "to": to.name, "at_token": at_token}})


def rendezvous(session: bytes, target: str) -> bytes:
    return hashlib.blake2b(session + target.encode(), digest_size=8).digest()
