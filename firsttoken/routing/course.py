"""One answer's way through its route: the state it is in between and during legs.

An answer is asked of one target after another until one finishes it. Why the next leg is
asked is the answer's state, and every change of it goes through one table (`advance`;
`Course.to` moves a course by it):

    START ──first delta──▶ STREAMING ──the leg ended──▶ DONE
      │                     │  └──the edge's part is done──▶ HANDOFF
      │                     └──broke off (retryable)──▶ SPLICE
      └──refused──▶ FAILOVER
    FAILOVER, SPLICE, HANDOFF ──first delta──▶ STREAMING
    FAILOVER, SPLICE, HANDOFF ──refused──▶ themselves (the next target is asked the same way)
    any of these ──the client's answer──▶ FAILED

"Refused" is a leg that failed before its first delta (down, a 5xx, a deadline, a
continuation it would not take); "broke off" is one that failed after it. "The client's
answer" is an error no other target would change: not retryable, the client's own fault
before any text, no splice allowed, no target left. A leg that ends without a delta, and a
cut exactly at `max_tokens`, are DONE. A client that leaves ends the answer where it is.

Cost: one `Course` per answer on a route (none without routes), its `Handover` only on a
route that hands off; a transition is a dict look-up (the members hash by identity), two
per leg (its first delta, its end), never per delta.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from firsttoken.generation import EngineError, GenerationRequest
from firsttoken.routing.config import ModelRoute
from firsttoken.routing.splice import Transcript
from firsttoken.routing.target import Target

if TYPE_CHECKING:
    from firsttoken.routing.handoff import Handover

__all__ = [
    "KNOWN_FIELDS",
    "MAX_CHARS_PER_TOKEN",
    "Course",
    "Event",
    "IllegalTransition",
    "State",
    "advance",
    "passes_through",
    "plan",
    "session_key",
]

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


class State(enum.Enum):
    START = "start"  # the first leg is asked (or none yet)
    FAILOVER = "failover"  # nothing was sent, a leg failed: the next target is asked afresh
    SPLICE = "splice"  # a leg broke off mid-answer: the next continues what was sent
    HANDOFF = "handoff"  # the edge's part is done: the center continues what was sent
    STREAMING = "streaming"  # a leg's deltas flow
    DONE = "done"  # the answer is complete
    FAILED = "failed"  # the answer ended in an error the client gets

    # A member is its one instance: hashed by identity in C, not by `Enum.__hash__`'s
    # Python call (two a transition, on every stream's way).
    __hash__ = object.__hash__


class Event(enum.Enum):
    FIRST_DELTA = "first_delta"  # the leg gave its first delta
    REFUSED = "refused"  # the leg failed before its first delta, and another may be asked
    BROKE = "broke"  # the leg failed after its first delta, and another may continue
    HANDED = "handed"  # the edge's leg reached its part's end and was closed
    ENDED = "ended"  # the leg's deltas ended
    FATAL = "fatal"  # an error the client gets: no other target is asked

    __hash__ = object.__hash__  # as `State`'s


class IllegalTransition(RuntimeError):
    """A bug: an event the state machine has no arrow for."""


_ASKING = (State.START, State.FAILOVER, State.SPLICE, State.HANDOFF)
_LIVE = (*_ASKING, State.STREAMING)
_ARROWS: dict[tuple[State, Event], State] = {
    **{(s, Event.FIRST_DELTA): State.STREAMING for s in _ASKING},
    **{(s, Event.ENDED): State.DONE for s in _LIVE},
    **{(s, Event.FATAL): State.FAILED for s in _LIVE},
    (State.START, Event.REFUSED): State.FAILOVER,
    (State.FAILOVER, Event.REFUSED): State.FAILOVER,
    (State.SPLICE, Event.REFUSED): State.SPLICE,
    (State.HANDOFF, Event.REFUSED): State.HANDOFF,
    (State.STREAMING, Event.BROKE): State.SPLICE,
    (State.STREAMING, Event.HANDED): State.HANDOFF,
}


def advance(state: State, event: Event) -> State:
    """The one transition function: the state `event` leads to from `state`."""
    try:
        return _ARROWS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"{event.value} in state {state.value}") from None


class Course:
    """One answer's way through its route: its state, what was sent, which targets were
    tried, and what the next leg needs to know (the cut it continues, the failover it
    counts). The hand-off's own state is `handover`'s (None: the route does not hand off,
    or this answer starts at the center)."""

    __slots__ = (
        "cut",
        "failed",
        "handoffs",
        "handover",
        "last",
        "leg_request",
        "order",
        "owner",
        "request",
        "route",
        "session",
        "splices",
        "splicing",
        "state",
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
        self.state = State.START
        self.session: bytes | None = None  # balance = "session": the conversation's key
        self.owner: str | None = None  # whose failure a failure is (a key's, or the target's)
        self.transcript = Transcript()
        self.tried: set[str] = set()
        self.leg_request = request  # what the current leg asks (a continuation once spliced)
        self.splices = 0
        self.handoffs = 0
        self.cut: EngineError | None = None  # what broke the answer off, once it had begun
        self.last: EngineError | None = None  # the last refusal before any token
        # A failover not yet counted: the leg that failed, and its phase (counted when the
        # next leg is asked, or, for a splice, when the continuation takes).
        self.failed: tuple[Target, str] | None = None
        self.handover: Handover | None = None
        # this leg's
        self.splicing = False  # text was sent before this leg: it continues the answer
        self.target: Target  # set by `begin_leg`

    def begin_leg(self, target: Target) -> None:
        self.target = target

    def to(self, event: Event) -> State:
        """Move on by `event` (`advance`, inlined: once per leg boundary of every answer);
        returns the state the answer was in."""
        was = self.state
        try:
            self.state = _ARROWS[(was, event)]
        except KeyError:
            raise IllegalTransition(f"{event.value} in state {was.value}") from None
        return was


def plan(
    route: ModelRoute, request: GenerationRequest, targets: Mapping[str, Target]
) -> tuple[Course, bool]:
    """The course of one answer: the order of its targets (the `short_prompts` target first
    for a short prompt), its session and whose its failures are; and whether the prompt is
    short (then no hand-off applies: the small target answers it whole)."""
    short = _short(route, request, targets)
    rule = route.short_prompts
    order = route.targets
    if short and rule is not None:
        order = (rule.target, *(n for n in route.targets if n != rule.target))
    course = Course(route, request, order)
    course.session = session_key(request) if route.balance == "session" else None
    # Whose a failure is: the key's, when its request hands the upstream fields the
    # gateway does not read (TargetHealth counts those per key first); else the target's.
    course.owner = request.tenant if passes_through(request) else None
    return course, short


def _short(route: ModelRoute, request: GenerationRequest, targets: Mapping[str, Target]) -> bool:
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
    target = targets[rule.target]
    return target.engine.prompt_tokens(request.prompt) <= rule.max_prompt_tokens


def passes_through(request: GenerationRequest) -> bool:
    """Whether the request hands an upstream fields the gateway does not read."""
    body = request.body
    if body is None:
        return bool(request.options.get("synthetic"))
    return not KNOWN_FIELDS.issuperset(body)


def session_key(request: GenerationRequest) -> bytes:
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
