"""The gate: the limits a request passes in turn before it may start a stream.

Each limit (`Limit`) refuses, raising the `APIError` its client gets (429 or 503 with
Retry-After; 400 for what could never fit), or grants; and what it grants it may hold: a
token reservation, a money hold, a stream slot. Each hold is noted with how to give it back
(`Draft.hold`): a later limit's refusal puts those on an `AsyncExitStack` and closes it, so
everything held before it goes back, last first, each even if one before it failed
(`Draft.give_back`); an admission that passes keeps it all, frozen in its `Admitted`
(`Draft.passed`), and its `Ticket` gives it back when the stream ends. `Admission.admit`
runs them, in one loop.

The limits, in this order (`Admission.limits_for` picks those a key has):

    Shedding     the server drains, the breaker is open, TTFT or memory over: 503
    RequestRate  the key's requests_per_minute: counted, and kept counted when a later
                 limit refuses (a refused request still asked)
    TokenRate    the key's tokens_per_minute, two-phase (limits.py): 400 when it could never
                 fit, else 429; an answer naming no max_tokens runs to what is left
    MoneyBudget  the key's money budget (spend.py): 429; an open-ended answer runs to the
                 tokens its share of the money left buys
    Slots        the key's max_streams, then the server's new-stream bucket: 429 (no keys
                 file, in this process: `Bucket`, the bucket alone, decided at once)
    Probe        a breaker not closed: this stream becomes its probe, or 503; last, as
                 nothing after it may refuse the stream its probe is

Cost: a request pays for the limits configured. With no keys file it passes Shedding and
Probe, and the server's bucket only with --rate-limit-per-s above 0 (no slots and no lease
without keys; `Bucket`, or `Slots` with Redis): it holds nothing, and no undo is noted. A
limit that decides at once (Shedding, Bucket, Probe) is a plain call, not a coroutine (one
costs ~0.3 µs to make and await); one that may ask a shared store (Redis) is an `async def
take`, awaited. A key pays only for the limits it has.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, NamedTuple, Protocol

from firsttoken.admission.keys import ApiKey, KeyRing
from firsttoken.admission.limits import (
    RATE,
    SLOTS,
    Lease,
    MemoryLimits,
    Reservation,
    seconds_to_next_minute,
)
from firsttoken.admission.shedding import LoadShedder
from firsttoken.admission.spend import SpendHold, period_of
from firsttoken.formats.errors import APIError
from firsttoken.generation import DEFAULT_ANSWER_TOKENS
from firsttoken.pricing import LegStart, money_text

if TYPE_CHECKING:
    from firsttoken.admission.admission import Admission

__all__ = [
    "Admitted",
    "Bucket",
    "Draft",
    "Limit",
    "MoneyBudget",
    "Probe",
    "RequestRate",
    "Shedding",
    "Slots",
    "TokenRate",
    "over_rate",
    "retry_after",
]


class Admitted(NamedTuple):
    """What admission granted one request, fixed once it passed the gate: the ticket is built
    from it (`Ticket`), and the stream from the ticket (its answer's limit, its prompt's
    count). A tuple: one per stream, built in one step."""

    key: ApiKey
    # The keys `key` was checked against (None: no keys file): a reload that lands before
    # the stream is registered is caught when it starts (`Admission.revoked`).
    ring: KeyRing | None
    model: str  # the route asked for: what the ledger prices
    prompt_tokens: int  # the engine's count of the prompt, taken once (0: a takeover's)
    # The answer's limit as admitted: the request's own, or lower, what is left of its key's
    # budget (None: no limit, as asked, and no budget).
    max_tokens: int | None
    request_id: str  # the ledger's record ("": not a request of its own, no record)
    trace_id: str
    # The request chose its own latency (`sets_own_latency`): the TTFT guard skips it.
    own_latency: bool
    lease: Lease | None  # the key's stream slot (None: no keys file)
    reservation: Reservation | None  # tokens held against the key's tokens_per_minute
    spend_hold: SpendHold | None  # money held against the key's budget
    probe: bool  # the half-open breaker's probe: its outcome decides
    # The targets known to answer before any token: a taken-over stream's route target
    # (its seams add theirs as any request's do). A tuple: most have none or one.
    legs: tuple[LegStart, ...]
    arrived_at: float  # Unix time: the ledger record's time
    started: float  # perf_counter when admitted: the record's duration counts from it
    admitting_s: float  # what admission took: its calls to shared limits (Redis)


class Draft:
    """One request's admission under way: what it asked, and what the limits granted so
    far. Limits lower `max_tokens` (a budget's cap) and fill in what they hold."""

    __slots__ = (
        "key",
        "lease",
        "max_tokens",
        "model",
        "probe",
        "prompt_tokens",
        "reservation",
        "spend_hold",
        "undo",
    )

    def __init__(self, key: ApiKey, prompt_tokens: int, max_tokens: int | None, model: str):
        self.key = key
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.model = model
        self.lease: Lease | None = None
        self.reservation: Reservation | None = None
        self.spend_hold: SpendHold | None = None
        self.probe = False
        # How to give back each hold, in the order taken (None: nothing held). A list, not
        # the exit stack itself: making one and pushing two holds costs ~1.4 µs, a list
        # ~0.1, and nearly every admission passes, when it is never closed.
        self.undo: list[tuple[Callable[..., Awaitable[None]], tuple[object, ...]]] | None = None

    def hold(self, give_back: Callable[..., Awaitable[None]], *args: object) -> None:
        """Something taken: `give_back(*args)` returns it should a later limit refuse."""
        if self.undo is None:
            self.undo = []
        self.undo.append((give_back, args))

    async def give_back(self) -> None:
        """A limit refused (or the request was cancelled): what the limits before it hold
        goes back, last first (the exit stack's order), each also when one failed."""
        if self.undo is None:
            return
        stack = AsyncExitStack()
        for give_back, args in self.undo:
            stack.push_async_callback(give_back, *args)
        self.undo = None
        await stack.aclose()

    def passed(
        self,
        ring: KeyRing | None,
        begun: float,
        request_id: str,
        trace_id: str,
        own_latency: bool,
        legs: tuple[LegStart, ...],
    ) -> Admitted:
        """Every limit passed: the holds are the request's to keep (the undo stack is dropped,
        never closed), frozen with what was granted. `begun`: perf_counter before the gate."""
        started = time.perf_counter()
        # tuple.__new__ with the fields in order: NamedTuple's own __new__ takes ~0.4 µs more.
        return _make_admitted(
            Admitted,
            (
                self.key,
                ring,
                self.model,
                self.prompt_tokens,
                self.max_tokens,
                request_id,
                trace_id,
                own_latency,
                self.lease,
                self.reservation,
                self.spend_hold,
                self.probe,
                legs,
                time.time(),
                started,
                started - begun,
            ),
        )


_make_admitted = tuple.__new__


class Limit(Protocol):
    def take(self, draft: Draft) -> Awaitable[None] | None:
        """Grant `draft` what this limit allows, holding what it takes (`Draft.hold`), or
        raise the refusal its client gets. None: decided at once; else what to await (the
        limit asks a store that may be shared: an `async def take`)."""
        ...


class Shedding:
    """503 while the server sheds load (shedding.py); holds nothing."""

    __slots__ = ("shedder",)

    def __init__(self, shedder: LoadShedder) -> None:
        self.shedder = shedder

    def take(self, draft: Draft) -> None:
        refusal = self.shedder.refusal()
        if refusal is not None:
            code, message, retry = refusal
            raise APIError(503, code, message, headers=retry_after(retry))


class RequestRate:
    """The key's `requests_per_minute`: the request counts, refused later or not."""

    __slots__ = ("admission",)

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def take(self, draft: Draft) -> None:
        key = draft.key
        rate = key.requests_per_minute or 0
        wait = await self.admission.limits.count_request(key.name, rate)
        if wait is not None:
            raise APIError(
                429,
                "rate_limited",
                f"key {key.name!r} made its {rate} requests for this minute "
                f"(requests_per_minute={rate})",
                headers=retry_after(wait),
            )


class TokenRate:
    """The key's `tokens_per_minute`: holds the prompt and the answer's limit (limits.py).
    An answer that names no `max_tokens` may run to what is left of the minute (its
    finish_reason says `length` where that cut it); one that names one is never lowered
    behind the client's back (OpenAI and LiteLLM refuse too): it waits for a minute with
    room for it."""

    __slots__ = ("admission",)

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def take(self, draft: Draft) -> None:
        key, prompt, max_tokens = draft.key, draft.prompt_tokens, draft.max_tokens
        budget = key.tokens_per_minute or 0
        asked = prompt + (1 if max_tokens is None else max_tokens)
        if asked > budget:  # it would never fit: no point in coming back
            what = "the prompt" if max_tokens is None else "the prompt and max_tokens"
            raise APIError(
                400,
                "token_budget_exceeded",
                f"{what} ({asked} tokens) do not fit in key {key.name!r}'s budget "
                f"(tokens_per_minute={budget})",
                param=None if max_tokens is None else "max_tokens",
            )
        limits = self.admission.limits
        answer = DEFAULT_ANSWER_TOKENS if max_tokens is None else max_tokens
        reservation = await limits.reserve(key.name, budget, prompt, answer)
        if reservation is not None and max_tokens is not None and max_tokens > reservation.left:
            await limits.settle(reservation, 0)
            reservation = None
        if reservation is None:
            raise APIError(
                429,
                "token_budget_exceeded",
                f"key {key.name!r} has not {asked} of its {budget} tokens left this "
                f"minute (tokens_per_minute={budget})",
                headers=retry_after(seconds_to_next_minute()),
            )
        draft.hold(limits.settle, reservation, 0)
        draft.reservation = reservation
        if max_tokens is None:
            draft.max_tokens = reservation.left


class MoneyBudget:
    """The key's money `budget`: holds the worst case, the prompt and the whole answer at
    the route's dearest prices (spend.py). An answer with no length to price holds, and may
    run to, its share of what is left, else it could run on for any multiple of the budget."""

    __slots__ = ("admission",)

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def take(self, draft: Draft) -> None:
        admission, key = self.admission, draft.key
        money = key.budget
        assert money is not None
        spend, ledger = admission.spend, admission.ledger
        if draft.max_tokens is None:
            prompt, answer = ledger.worst_prices(draft.model)
            share = key.max_streams or admission.settings.max_streams_per_key
            picos = draft.prompt_tokens * prompt
            hold = await spend.reserve(key.name, money, picos, answer, share)
            if hold is not None:
                draft.max_tokens = hold.answer_tokens
        else:
            worst = ledger.worst_cost(draft.model, draft.prompt_tokens, draft.max_tokens)
            hold = await spend.reserve(key.name, money, worst)
        if hold is None:
            _, reset = period_of(money.per, spend.local.clock())
            period = "in total" if money.per == "total" else f"this {money.per} (UTC)"
            raise APIError(
                429,
                "budget_exceeded",
                f"key {key.name!r} spent its budget of {money_text(money.amount)} "
                f"{ledger.currency} {period}",
                headers=retry_after(reset),
            )
        draft.hold(spend.settle, hold, 0)
        draft.spend_hold = hold


class Slots:
    """The key's stream slots (`max_streams`, else --max-streams-per-key; none without a
    keys file), then the server's new-stream bucket (--rate-limit-per-s): a lease, held
    until the stream ends."""

    __slots__ = ("admission",)

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def take(self, draft: Draft) -> None:
        admission, key = self.admission, draft.key
        settings, limits = admission.settings, admission.limits
        limit = key.max_streams or settings.max_streams_per_key
        verdict, wait, lease = await limits.admit(
            key.name if admission.keys is not None else None, limit
        )
        if verdict == RATE:
            raise over_rate(settings.rate_limit_per_s, wait)
        if verdict == SLOTS:
            own = f"its max_streams = {limit}" if key.max_streams else None
            raise APIError(
                429,
                "concurrency_limit_exceeded",
                f"key {key.name!r} already has {limit} streams open ("
                + (own or f"--max-streams-per-key {limit}")
                + ")",
                headers=retry_after(wait),
            )
        if lease is not None:
            draft.hold(limits.release, lease)
            draft.lease = lease


class Bucket:
    """The server's new-stream bucket alone (no keys file: no slots, no lease), in this
    process: decided at once, as `Slots` would with the open key, without its coroutine."""

    __slots__ = ("limits",)

    def __init__(self, limits: MemoryLimits) -> None:
        self.limits = limits

    def take(self, draft: Draft) -> None:
        wait = self.limits.take_rate()
        if wait is not None:
            raise over_rate(self.limits.rate, wait)


class Probe:
    """With the breaker not closed, decided only now, once nothing else can refuse this
    stream: the breaker may have changed while the limits were asked, and a probe taken
    earlier would be lost. The stream becomes the probe, or is refused (503)."""

    __slots__ = ("shedder",)

    def __init__(self, shedder: LoadShedder) -> None:
        self.shedder = shedder

    def take(self, draft: Draft) -> None:
        shedder = self.shedder
        if shedder.breaker == LoadShedder.CLOSED:
            return
        refusal = shedder.refusal()
        if refusal is None and shedder.take_probe():
            draft.probe = True
            return
        code, message, retry = refusal or (
            "engine_unavailable",
            "the breaker is probing the engine",
            1.0,
        )
        raise APIError(503, code, message, headers=retry_after(retry))


def over_rate(rate: float, wait: float) -> APIError:
    """The refusal of a stream over the server's --rate-limit-per-s."""
    return APIError(
        429,
        "rate_limit_exceeded",
        f"over the server's limit of {rate:g} new streams per second",
        headers=retry_after(wait),
    )


def retry_after(seconds: float) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(seconds)))}
