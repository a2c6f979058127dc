"""Admission: who may start a stream now — auth, limits, load shedding — decided up front.

Every refusal is an `APIError` before the first byte (401, 429 or 503 with Retry-After) and is
counted as a `rejected` stream. A key is refused as unknown, expired or disabled (the expiry on
the clock admission is given); its `requests_per_minute` counts per clock minute, like its
tokens (limits.py), checked first: a request refused by a later limit still counted.

A key's `tokens_per_minute` is held two-phase (limits.py): a request reserves its prompt plus
its `max_tokens` when admitted, and its ticket settles the reservation with what the answer
used when it ends. No request is admitted to more than what is left of its key's minute: its
`max_tokens` is lowered to that (`Ticket.max_tokens`, what the engine and an upstream get),
and one that names none may run to that. A key's money `budget` caps an answer that names
no `max_tokens` too (spend.py): to what its share of the money left buys. An answer is
billed its prompt and every token generated, also when its client cut it (its prompt also
before its first token, once an engine took it); one that failed before a token (refused
upstream) or whose client left while it waited for a target's slot is billed nothing.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from decimal import Decimal
from typing import Any

import anyio
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.requests import Request

from firsttoken.admission.keys import ApiKey, KeyRing
from firsttoken.admission.limits import (
    OK,
    RATE,
    SLOTS,
    Lease,
    MemoryLimits,
    Reservation,
    seconds_to_next_minute,
)
from firsttoken.admission.shedding import LoadShedder
from firsttoken.admission.spend import MemorySpend, SpendHold, period_of, period_start
from firsttoken.config import Settings
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.stream import Outcome, Stream, Usage
from firsttoken.generation import DEFAULT_ANSWER_TOKENS, EngineError
from firsttoken.ledger import Ledger
from firsttoken.pricing import PICOS, Leg, TokenCounts, money_text
from firsttoken.telemetry.log import log_event
from firsttoken.telemetry.metrics import OPEN_KEY, Metrics, key_label
from firsttoken.wire.errors import APIError

__all__ = [
    "Admission",
    "ApiKey",
    "KeyRing",
    "LoadShedder",
    "Ticket",
    "billed",
    "key_revoked",
    "sets_own_latency",
]

BUDGET_READ_S = 5.0  # with Redis: how often firsttoken_key_budget_spent is read back
_OPEN = ApiKey(name="")  # no keys file: everyone is the same anonymous caller, unlimited


def billed(outcome: Outcome, usage: Usage | None) -> Usage:
    """What an ended answer's key pays for: its prompt and every token generated, also when
    cut short. One that generated nothing and did not complete pays its prompt when its
    client left (the engine had read it: an upstream bills it so), else nothing (refused,
    failed before a token). `usage` None: no engine had its prompt (it waited in a queue)."""
    if usage is None:
        return Usage()
    if outcome is not Outcome.COMPLETED and usage.completion == 0:
        if outcome is Outcome.DISCONNECTED or outcome is Outcome.CANCELLED:
            return Usage(usage.prompt, 0, 0, usage.cached, usage.cache_write)
        return Usage()
    return usage


def sets_own_latency(options: Mapping[str, Any]) -> bool:
    """Whether a request's engine options chose its own time to first token (the synthetic
    engine's `ttft_ms`): its TTFT measures the request, not the engine, so the guard skips it."""
    synthetic = options.get("synthetic")
    return isinstance(synthetic, Mapping) and synthetic.get("ttft_ms") is not None


class Ticket:
    """An admitted stream's hold on its slot; the stream reports back through it."""

    # One per waiting stream: slots keep it small (a dict of 19 fields is ~0.4 KiB more).
    __slots__ = (
        "admission",
        "admitting_s",
        "arrived_at",
        "client_fault",
        "key",
        "lease",
        "legs",
        "max_tokens",
        "model",
        "own_latency",
        "prefill",
        "probe",
        "prompt_tokens",
        "released",
        "request_id",
        "reservation",
        "ring",
        "spend_hold",
        "started",
        "trace_id",
        "ttft_s",
    )

    def __init__(
        self,
        admission: Admission,
        key: ApiKey,
        lease: Lease | None,
        probe: bool = False,
        reservation: Reservation | None = None,
    ) -> None:
        self.admission = admission
        self.key = key
        self.lease = lease
        self.reservation = reservation  # tokens held against the key's budget
        # The keys the key was last checked against (None: no keys file): a reload that
        # lands before the stream is registered is caught when it starts (`Admission.revoked`).
        self.ring: KeyRing | None = None
        self.prompt_tokens = 0  # the engine's count of the prompt, taken once at admission
        # The answer's limit as admitted: the request's own, or lower, what is left of its
        # key's budget (None: no limit, as asked, and no budget).
        self.max_tokens: int | None = None
        self.probe = probe  # the half-open breaker's probe: its outcome decides
        self.released = False
        # What the request decided for itself says nothing about the engine, so the guards
        # ignore it: a latency it asked for (`own_latency`, see `sets_own_latency`) and an
        # error it caused (`client_fault`: the stream ended with EngineError.client_fault).
        # Otherwise one key could trip the breaker or the TTFT guard for everyone.
        self.own_latency = False
        self.client_fault = False
        # For the ledger: which request, what it may cost, and where its tokens came from.
        self.spend_hold: SpendHold | None = None  # money held against the key's budget
        self.request_id = ""  # "" : not a request of its own (a takeover's): no record
        self.model = ""
        self.trace_id = ""
        self.arrived_at = time.time()
        self.started = time.perf_counter()
        self.admitting_s = 0.0  # what `admit` took: its calls to shared limits (Redis)
        self.ttft_s: float | None = None
        # The targets that answered, from which token on: a tuple, as most requests have
        # none (no routes file) or one, and an empty one is shared.
        self.legs: tuple[Leg, ...] = ()
        self.prefill = ""  # the hand-off's prefill's target, when it is billed ("" none)

    def first_token(self, ttft_s: float) -> None:
        self.ttft_s = ttft_s
        if not self.legs:
            target = self.admission.serving(self.request_id)
            if target is not None:
                self.legs = (Leg(target),)
        if not self.own_latency:
            # The guard judges the engine: the time admission waited on Redis (up to its 1 s
            # timeout while Redis hangs) is the store's, not the engine's.
            self.admission.shedder.record_ttft(ttft_s - self.admitting_s)

    def prompt_read(self) -> None:
        if not self.legs:
            target = self.admission.serving(self.request_id)
            if target is not None:
                self.legs = (Leg(target),)

    def seam(self, meta: Mapping[str, Any]) -> None:
        """A splice or a hand-off took: the next leg's target, from the token it began at.
        Or the hand-off's prefill answered: billed with the request (`Ledger.account`)."""
        prefill = meta.get("prefill")
        if isinstance(prefill, Mapping) and isinstance(prefill.get("target"), str):
            self.prefill = prefill["target"]
            return
        seam = meta.get("failover") or meta.get("handoff")
        if not isinstance(seam, Mapping) or not isinstance(seam.get("to"), str):
            return
        if not self.legs and isinstance(seam.get("from"), str):
            self.legs = (Leg(seam["from"]),)
        at = seam.get("at_token")
        self.legs += (Leg(seam["to"], at if isinstance(at, int) else 0),)

    async def release(self, outcome: Outcome, usage: Usage | None = None) -> None:
        if self.released:
            return
        self.released = True
        used = billed(outcome, usage)
        self.admission.metrics.count_key_tokens(key_label(self.key.name), used)
        cost = self._account(outcome, used)
        # A fenced stream (moved with no usage) leaves its money hold to the instance that
        # took it over, which settles it as it does a SIGKILLed owner's (`settle_taken`).
        fenced = outcome is Outcome.MOVED and usage is None
        if self.spend_hold is not None and not fenced:
            await self.admission.settle_spend(self.spend_hold, cost)
        # A moved stream's hold is settled by the instance that takes it over, which knows
        # what the whole answer used (`Admission.settle_taken`): once, whoever wins the claim.
        if self.reservation is not None and outcome is not Outcome.MOVED:
            await self.admission.limits.settle(self.reservation, used.prompt + used.completion)
        failed = outcome is Outcome.ERROR and not self.client_fault
        # A client-caused error counts as neither: the breaker learns nothing from it (and a
        # probe that ended so gives its turn back).
        ran = outcome is Outcome.COMPLETED or failed
        if self.probe:
            self.admission.shedder.probe_done(ran, failed)
        elif ran:
            self.admission.shedder.record_outcome(failed=failed)
        if self.lease is not None:
            await self.admission.limits.release(self.lease)

    def _account(self, outcome: Outcome, used: Usage) -> int:
        """The ledger's record of this request, and its cost in picos (none: nobody could read
        it and it costs nothing)."""
        if not self.request_id or not self.admission.ledger.counting:
            return 0
        ttft = self.ttft_s
        return self.admission.ledger.account(
            request_id=self.request_id,
            at=self.arrived_at,
            key=key_label(self.key.name),  # `open` without a keys file, as in metrics
            model=self.model,
            legs=self.legs,
            usage=TokenCounts(
                used.prompt, used.completion, used.reasoning, used.cached, used.cache_write
            ),
            outcome=outcome.value,
            ttft_ms=None if ttft is None else round(ttft * 1000, 3),
            duration_ms=round((time.perf_counter() - self.started) * 1000, 3),
            trace_id=self.trace_id,
            prefill=self.prefill,
        )


class Admission:
    def __init__(
        self, settings: Settings, metrics: Metrics, clock: Callable[[], float] = time.time
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clock = clock  # Unix time: what a key's expires_at is compared with
        self.keys = KeyRing.load(settings.api_keys) if settings.api_keys else None
        self._warned_open = False
        if settings.redis:
            from firsttoken.admission.redis_limits import RedisLimits

            self.limits: MemoryLimits | RedisLimits = RedisLimits(
                settings.redis,
                settings.rate_limit_per_s,
                settings.rate_limit_burst,
                max_connections=settings.redis_max_connections,
                cluster=settings.redis_cluster,
            )
        else:
            self.limits = MemoryLimits(settings.rate_limit_per_s, settings.rate_limit_burst)
        self.shedder = LoadShedder(settings, metrics)
        self.ledger = Ledger(settings.usage_db, read=settings.admin_key is not None)
        if settings.redis:
            from firsttoken.admission.redis_spend import RedisSpend

            self.spend: MemorySpend | RedisSpend = RedisSpend(self.limits.redis)  # type: ignore[union-attr]
        else:
            self.spend = MemorySpend()
        self.budget_seen: dict[str, int] = {}  # with Redis: `watch_budgets`' last reading
        # The target answering a request now, by request id (the routes say; None without).
        self.serving: Callable[[str], str | None] = lambda request_id: None
        # Every key's usage series from the start, at 0 (a rate over a new series needs two).
        for name in self.keys.names() if self.keys is not None else [OPEN_KEY]:
            metrics.count_key_tokens(key_label(name), Usage())
            self.ledger.spend.setdefault(key_label(name), 0)

    async def run(self, registry: StreamRegistry) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.limits.run)
            tg.start_soon(self.ledger.run)
            tg.start_soon(self._seed_budgets)
            if not isinstance(self.spend, MemorySpend) and self.keys is not None:
                tg.start_soon(self.watch_budgets)
            tg.start_soon(self.shedder.watch_memory, registry.end_oldest)

    async def _seed_budgets(self) -> None:
        """With --usage-db, what each budgeted key spent in its current period so far, from
        the ledger: budgets hold across restarts. Retried while the database is away."""
        if not self.settings.usage_db or self.keys is None:
            return
        named = (self.keys.named(name) for name in self.keys.names())
        budgeted = [k for k in named if k is not None and k.budget is not None]
        if not budgeted:
            return
        await self.ledger.ready.wait()
        while True:
            try:
                for key in budgeted:
                    assert key.budget is not None
                    start = period_start(key.budget.per, self.spend_clock())
                    spent = await self.ledger.spent(key.name, start)
                    await self._seed(key.name, key.budget.per, spent)
                return
            except Exception as exc:  # the database away: budgets count from 0 until it is back
                log_event("ledger.seed_failed", logging.WARNING, error=repr(exc))
                await anyio.sleep(5)

    async def carry_spend(self, ring: KeyRing) -> dict[str, int]:
        """Before a reload swaps in `ring`: each budgeted key whose period (`per`) it changes
        (or whose budget is new) starts its new period's count at what the ledger says the
        key spent in that period, not at 0; in picos by key name. A ledger that cannot answer
        leaves the counts as they are (said in one `ledger.seed_failed` line)."""
        old = {k.name: k.budget for k in self.keys.keys()} if self.keys is not None else {}
        changed = []
        for key in ring.keys():
            before = old.get(key.name)
            if key.budget is not None and key.budget.per != (before and before.per):
                changed.append((key.name, key.budget.per))
        if not changed or not self.ledger.ready.is_set():
            return {}
        carried = {}
        try:
            for name, per in changed:
                spent = await self.ledger.spent(name, period_start(per, self.spend_clock()))
                if isinstance(self.spend, MemorySpend):
                    self.spend.at_least(name, per, spent)
                else:
                    await self.spend.at_least(name, per, spent)
                carried[name] = spent
        except Exception as exc:  # the database away: those periods count from what they hold
            log_event("ledger.seed_failed", logging.WARNING, error=repr(exc))
        return carried

    async def _seed(self, key: str, per: str, picos: int) -> None:
        if isinstance(self.spend, MemorySpend):
            self.spend.seed(key, per, picos)
        else:
            await self.spend.seed(key, per, picos)

    async def budget_spent(self, key: str, per: str) -> int:
        """What `key` spent (and holds) in its current `per` period, in picos."""
        if isinstance(self.spend, MemorySpend):
            return self.spend.spent(key, per)
        return await self.spend.spent(key, per)

    async def watch_budgets(self) -> None:
        """With Redis, each budgeted key's period spend read every `BUDGET_READ_S` for
        `firsttoken_key_budget_spent` (a scrape cannot wait on Redis); nothing without
        budgets."""
        while True:
            ring = self.keys
            budgeted = [k for k in ring.keys() if k.budget is not None] if ring else []
            seen: dict[str, int] = {}
            try:
                for key in budgeted:
                    assert key.budget is not None
                    seen[key.name] = await self.budget_spent(key.name, key.budget.per)
                self.budget_seen = seen
            except Exception as exc:  # Redis answering oddly: the last reading stays
                log_event("budget.read_failed", logging.WARNING, error=repr(exc))
            await anyio.sleep(BUDGET_READ_S)

    def collect(self) -> Iterator[Metric]:
        """Each budgeted key's amount and what its current period spent (held included)."""
        ring = self.keys
        budgeted = [k for k in ring.keys() if k.budget is not None] if ring else []
        if not budgeted:
            return
        amount = GaugeMetricFamily(
            "firsttoken_key_budget_amount",
            f"Each key's money budget per period, in the routes file's currency "
            f"({self.ledger.currency}).",
            labels=["key", "per"],
        )
        spent = GaugeMetricFamily(
            "firsttoken_key_budget_spent",
            "What each budgeted key spent in its current period (reservations of requests "
            "under way included): the budget is used up when it reaches the amount.",
            labels=["key", "per"],
        )
        local = self.spend if isinstance(self.spend, MemorySpend) else None
        for key in budgeted:
            assert key.budget is not None
            labels = [key_label(key.name), key.budget.per]
            amount.add_metric(labels, float(Decimal(key.budget.amount) / PICOS))
            if local is not None:
                picos = local.spent(key.name, key.budget.per)
            else:
                picos = self.budget_seen.get(key.name, 0)
            spent.add_metric(labels, float(Decimal(picos) / PICOS))
        yield amount
        yield spent

    def spend_clock(self) -> float:
        spend = self.spend
        return (spend if isinstance(spend, MemorySpend) else spend.local).clock()

    async def settle_spend(self, hold: SpendHold, cost: int) -> None:
        if isinstance(self.spend, MemorySpend):
            self.spend.settle(hold, cost)
        else:
            await self.spend.settle(hold, cost)

    async def _hold_spend(
        self, key: ApiKey, picos: int, per_token: int = 0, share: int = 1
    ) -> SpendHold | None:
        assert key.budget is not None
        if isinstance(self.spend, MemorySpend):
            return self.spend.reserve(key.name, key.budget, picos, per_token, share)
        return await self.spend.reserve(key.name, key.budget, picos, per_token, share)

    def authenticate(self, request: Request) -> ApiKey:
        if self.keys is None:
            if not self._warned_open:
                self._warn_if_proxied_from_afar(request)
            return _OPEN
        auth = request.headers.get("authorization", "")
        secret = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        # Anthropic's clients send the key as `x-api-key`.
        secret = secret or request.headers.get("x-api-key", "").strip()
        key = self.keys.find(secret) if secret else None
        if key is None:
            self._rejected()
            raise APIError(
                401,
                "invalid_api_key",
                # Both, whichever route: Anthropic's clients send x-api-key.
                "missing or unknown API key "
                "(send Authorization: Bearer <key>, or x-api-key: <key>)",
            )
        self._refuse_if_unusable(key)
        return key

    def _refuse_if_unusable(self, key: ApiKey) -> None:
        """401 for a key that is disabled or expired now."""
        refusal = key.refusal(self.clock())
        if refusal is not None:
            self._rejected()
            why = "was disabled" if refusal == "key_disabled" else "has expired"
            raise APIError(401, refusal, f"the API key {key.name!r} {why}")

    def recheck(self, key: ApiKey) -> ApiKey:
        """`key`, as the keys are now: a reload may have removed or disabled it while its
        request's body was still arriving (`authenticate` read only its head). Refuses as
        `authenticate` does; a key a reload changed comes back as it is now. Without a
        reload since, one dict lookup."""
        keys = self.keys
        if keys is None or not key.digest:
            return key
        now = keys.holds(key)
        if now is key:
            return key
        if now is None:
            self._rejected()
            raise APIError(401, "invalid_api_key", f"the API key {key.name!r} was removed")
        self._refuse_if_unusable(now)
        return now

    def revoked(self, stream: Stream) -> EngineError | None:
        """`key_revoked` when `stream`'s key was removed or disabled by a reload since it was
        checked: the registry asks as it starts a stream (with a keys file), so a stream
        admitted just before a reload, and not yet registered when the reload ended the
        key's streams, ends too. None when its key stands (or nothing was reloaded)."""
        ticket = stream.ticket
        if not isinstance(ticket, Ticket) or ticket.ring is self.keys or self.keys is None:
            return None
        now = self.keys.holds(ticket.key) if ticket.key.digest else ticket.key
        return key_revoked() if now is None or now.disabled else None

    def held(self, ticket: Ticket) -> dict[str, Any]:
        """What `ticket` holds in the shared limits, as it travels with a stream (another
        instance that takes the stream over gives it back: `settle_taken`)."""
        held: dict[str, Any] = {}
        if ticket.lease is not None:
            held["lease"] = [ticket.lease.key, ticket.lease.id]
        r = ticket.reservation
        if r is not None and not r.local:  # one held in a dead process died with it
            held["reservation"] = [r.key, r.tokens, r.window]
        h = ticket.spend_hold
        if h is not None and not h.local:
            held["spend"] = [h.key, h.per, h.period, h.picos]
        return held

    async def settle_taken(
        self, held: Mapping[str, Any], used: int, owner_billed: bool = False
    ) -> None:
        """Give back what a taken-over stream's first instance held (`held`), once: the slot
        (gone already if that instance lived to release it), and the token hold, settled by
        what the answer used there (`used`: what its owners billed). Its money hold too when
        the owner did not live to settle it (`owner_billed` False: SIGKILLed, or fenced): the
        whole answer's cost is then this instance's to bill. Called by the claim's one
        winner."""
        if "lease" in held:
            await self.limits.release(Lease(*held["lease"]))
        if "reservation" in held:
            key, tokens, window = held["reservation"]
            await self.limits.settle(Reservation(key, tokens, window, local=False), used)
        if "spend" in held and not owner_billed:
            key, per, period, picos = held["spend"]
            await self.settle_spend(SpendHold(key, per, period, picos, local=False), 0)

    def taken_key(self, name: str, sha256: str = "") -> ApiKey | None:
        """The key a stream taken over was admitted for: the entry of the secret it started
        with (`sha256`, its digest), or by name for a stream that carries none; None when
        this instance has no such entry (its secret was removed: the stream ends, as on its
        owner it would have)."""
        if self.keys is None:
            return _OPEN if name == "" else None
        if not sha256:
            return self.keys.named(name)
        try:
            digest = bytes.fromhex(sha256)
        except ValueError:
            return None
        key = self.keys.holds(ApiKey(name=name, digest=digest))
        return key if key is not None and key.name == name else None

    def taken_ticket(self, key: ApiKey, model: str) -> Ticket:
        """A ticket, not admitted, for what a taken-over stream's owners generated and did not
        bill when the stream cannot go on here: it bills it, and counts it in the key's budget
        (a hold of 0, settled to the cost)."""
        ticket = Ticket(self, key, None)
        ticket.model = model
        ticket.client_fault = True  # no engine ran here: the breaker learns nothing from it
        if key.budget is not None:
            period, _ = period_of(key.budget.per, self.spend_clock())
            local = isinstance(self.spend, MemorySpend)
            ticket.spend_hold = SpendHold(key.name, key.budget.per, period, 0, local=local)
        self.taken_legs(ticket, model)
        return ticket

    def taken_legs(self, ticket: Ticket, model: str) -> None:
        """A taken-over ticket bills the answer from where its owners' billing stopped, which
        may be tokens another instance generated (and, SIGKILLed, never billed): priced at
        the route's target, the one that generates its requests (a route's seams during the
        continuation add their legs as any request's do)."""
        target = self.ledger.target_of(model)
        if target:
            ticket.legs = (Leg(target),)

    async def admit(
        self,
        key: ApiKey,
        prompt_tokens: int = 0,
        max_tokens: int | None = None,
        model: str = "",
    ) -> Ticket:
        """Admit a request whose prompt counts `prompt_tokens` and whose answer may run to
        `max_tokens` (None: no limit given), for the route `model`, or raise the refusal."""
        begun = time.perf_counter()
        ring = self.keys  # what `key` was checked against: before any await
        refusal = self.shedder.refusal()
        if refusal is not None:
            code, message, retry = refusal
            self._rejected()
            raise APIError(503, code, message, headers=_retry_after(retry))
        rate = key.requests_per_minute
        if rate:
            wait = await self.limits.count_request(key.name, rate)
            if wait is not None:
                self._rejected()
                raise APIError(
                    429,
                    "rate_limited",
                    f"key {key.name!r} made its {rate} requests for this minute "
                    f"(requests_per_minute={rate})",
                    headers=_retry_after(wait),
                )
        reservation = None
        budget = key.tokens_per_minute
        admitted = max_tokens
        if budget:
            asked = prompt_tokens + (1 if max_tokens is None else max_tokens)
            if asked > budget:  # it would never fit: no point in coming back
                self._rejected()
                what = "the prompt" if max_tokens is None else "the prompt and max_tokens"
                raise APIError(
                    400,
                    "token_budget_exceeded",
                    f"{what} ({asked} tokens) do not fit in key {key.name!r}'s budget "
                    f"(tokens_per_minute={budget})",
                    param=None if max_tokens is None else "max_tokens",
                )
            answer = DEFAULT_ANSWER_TOKENS if max_tokens is None else max_tokens
            reservation = await self.limits.reserve(key.name, budget, prompt_tokens, answer)
            if reservation is not None and max_tokens is not None and max_tokens > reservation.left:
                # A limit the client named is never lowered behind its back (OpenAI and
                # LiteLLM refuse too): it waits for a minute that has room for it.
                await self.limits.settle(reservation, 0)
                reservation = None
            if reservation is None:
                self._rejected()
                raise APIError(
                    429,
                    "token_budget_exceeded",
                    f"key {key.name!r} has not {asked} of its {budget} tokens left this "
                    f"minute (tokens_per_minute={budget})",
                    headers=_retry_after(seconds_to_next_minute()),
                )
            # One that names no max_tokens may run to what is left of the minute (its
            # finish_reason says `length` where that cut it).
            left = reservation.left
            admitted = left if max_tokens is None else max_tokens
        hold = None
        limit = key.max_streams or self.settings.max_streams_per_key
        if key.budget is not None:
            # The worst case: the prompt and the whole answer at the route's dearest prices.
            if admitted is None:
                # No answer length to price: it holds, and may run to, its share of what is
                # left (spend.py), else it could run on for any multiple of the budget.
                prompt, answer = self.ledger.worst_prices(model)
                hold = await self._hold_spend(key, prompt_tokens * prompt, answer, limit)
                if hold is not None:
                    admitted = hold.answer_tokens
            else:
                worst = self.ledger.worst_cost(model, prompt_tokens, admitted)
                hold = await self._hold_spend(key, worst)
            if hold is None:
                if reservation is not None:
                    await self.limits.settle(reservation, 0)
                self._rejected()
                money = key.budget
                _, reset = period_of(money.per, self.spend_clock())
                period = "in total" if money.per == "total" else f"this {money.per} (UTC)"
                raise APIError(
                    429,
                    "budget_exceeded",
                    f"key {key.name!r} spent its budget of {money_text(money.amount)} "
                    f"{self.ledger.currency} {period}",
                    headers=_retry_after(reset),
                )
        verdict, wait, lease = await self.limits.admit(
            key.name if self.keys is not None else None, limit
        )
        if verdict != OK and reservation is not None:
            await self.limits.settle(reservation, 0)  # refused: the hold goes back
        if verdict != OK and hold is not None:
            await self.settle_spend(hold, 0)
        if verdict == RATE:
            self._rejected()
            raise APIError(
                429,
                "rate_limit_exceeded",
                f"over the server's limit of {self.settings.rate_limit_per_s:g} new streams "
                "per second",
                headers=_retry_after(wait),
            )
        if verdict == SLOTS:
            self._rejected()
            raise APIError(
                429,
                "concurrency_limit_exceeded",
                f"key {key.name!r} already has {limit} streams open ("
                + (
                    f"its max_streams = {limit}"
                    if key.max_streams
                    else f"--max-streams-per-key {limit}"
                )
                + ")",
                headers=_retry_after(wait),
            )
        probe = False
        if self.shedder.breaker != LoadShedder.CLOSED:
            # Decided only now, once nothing else can refuse this stream: the breaker may have
            # changed while the limits were asked, and a probe taken earlier would be lost.
            refusal = self.shedder.refusal()
            probe = refusal is None and self.shedder.take_probe()
            if not probe:
                if lease is not None:
                    await self.limits.release(lease)
                if reservation is not None:
                    await self.limits.settle(reservation, 0)
                if hold is not None:
                    await self.settle_spend(hold, 0)
                code, message, retry = refusal or (
                    "engine_unavailable",
                    "the breaker is probing the engine",
                    1.0,
                )
                self._rejected()
                raise APIError(503, code, message, headers=_retry_after(retry))
        ticket = Ticket(self, key, lease, probe, reservation)
        ticket.admitting_s = ticket.started - begun
        ticket.ring = ring
        ticket.max_tokens = admitted
        ticket.spend_hold = hold
        ticket.model = model
        return ticket

    def _rejected(self) -> None:
        self.metrics.streams["rejected"] += 1

    def _warn_if_proxied_from_afar(self, request: Request) -> None:
        """Behind a proxy (Caddy, nginx) the gateway listens on loopback, so the start's
        `open_to_the_network` check cannot see that the proxy is open: the first request a
        proxy forwards from a client beyond loopback, with no keys file, says so once."""
        forwarded = request.headers.get("x-forwarded-for", "")
        if not forwarded:
            return  # not proxied: every open server's request
        for client in (hop.strip() for hop in forwarded.split(",") if hop.strip()):
            try:
                if ipaddress.ip_address(client).is_loopback:
                    continue
            except ValueError:  # a name or garbage: not an address we can place
                continue
            self._warned_open = True
            log_event(
                "open_to_the_network",
                logging.WARNING,
                address=client,
                note="a proxy forwarded a request from beyond loopback and there is no "
                "--api-keys: anyone who can reach the proxy can stream, with no per-key "
                "limits; give the gateway a keys file or make the proxy authenticate",
            )
            return


def key_revoked() -> EngineError:
    """How a stream whose key a reload removed or disabled ends (`event: error`)."""
    return EngineError(
        "key_revoked",
        "the API key of this stream was removed or disabled",
        type_="invalid_request_error",
        status=401,  # a stream that had sent nothing yet answers 401
        client_fault=True,  # the breaker learns nothing from it
    )


def _retry_after(seconds: float) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(seconds)))}
