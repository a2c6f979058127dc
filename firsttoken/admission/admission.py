"""Admission: who may start a stream now — auth, limits, load shedding — decided up front.

Every refusal is an `APIError` before the first byte (401, 429 or 503 with Retry-After) and is
counted as a `rejected` stream. A key is refused as unknown, expired or disabled (the expiry on
the clock admission is given); then the request passes the gate (gate.py): shedding, its
key's requests_per_minute, tokens_per_minute and money budget, its stream slots and the
server's bucket, the breaker's probe; each limit refuses or holds, and a refusal gives back
what the limits before it held.

What passed is fixed in an `Admitted` (its answer's limit, lowered to what is left of its
key's minute or money, what it holds, its ledger record's ids), and its `Ticket` is built from
that (ticket.py): the stream reports to the ticket, which gives it all back and bills the
answer when the stream ends. An answer is billed its prompt and every token generated, also
when its client cut it (its prompt also before its first token, once an engine took it); one
that failed before a token (refused upstream) or whose client left while it waited for a
target's slot is billed nothing.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from decimal import Decimal
from typing import Any

import anyio
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.requests import Request

from firsttoken.admission.gate import (
    Admitted,
    Bucket,
    Draft,
    Limit,
    MoneyBudget,
    Probe,
    RequestRate,
    Shedding,
    Slots,
    TokenRate,
)
from firsttoken.admission.keys import ANONYMOUS, ApiKey, KeyRing
from firsttoken.admission.limits import Lease, MemoryLimits, Reservation
from firsttoken.admission.shedding import LoadShedder
from firsttoken.admission.spend import LocalSpend, Spend, SpendHold, period_of, period_start
from firsttoken.admission.ticket import Ticket
from firsttoken.config import Settings
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.stream import Stream, Usage
from firsttoken.formats.errors import APIError
from firsttoken.generation import EngineError
from firsttoken.ledger import Ledger
from firsttoken.pricing import PICOS, LegStart
from firsttoken.telemetry.log import log_event
from firsttoken.telemetry.metrics import OPEN_KEY, Metrics, key_label

__all__ = ["Admission", "key_revoked"]

BUDGET_READ_S = 5.0  # with Redis: how often firsttoken_key_budget_spent is read back


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
            from firsttoken.admission.redis_spend import RedisSpend

            limits = RedisLimits(
                settings.redis,
                settings.rate_limit_per_s,
                settings.rate_limit_burst,
                max_connections=settings.redis_max_connections,
                cluster=settings.redis_cluster,
            )
            self.limits: MemoryLimits | RedisLimits = limits
            self.spend: Spend = RedisSpend(limits.redis, limits.outage)
        else:
            self.limits = MemoryLimits(settings.rate_limit_per_s, settings.rate_limit_burst)
            self.spend = LocalSpend()
        self.shedder = LoadShedder(settings, metrics)
        self.ledger = Ledger(settings.usage_db, read=settings.admin_key is not None)
        # The gate's limits (gate.py): every request's, and those a key may have of its own;
        # with no keys file and no bucket (--rate-limit-per-s 0), no slots to ask.
        shedding, slots, probe = Shedding(self.shedder), Slots(self), Probe(self.shedder)
        self._open: tuple[Limit, ...] = (shedding, probe)
        if settings.rate_limit_per_s > 0:  # the bucket alone; in this process, at once
            bucket = Bucket(self.limits) if isinstance(self.limits, MemoryLimits) else slots
            self._open = (shedding, bucket, probe)
        # By which of its own limits a key has (requests, tokens, money: bits 4, 2, 1).
        own = ((4, RequestRate(self)), (2, TokenRate(self)), (1, MoneyBudget(self)))
        self._keyed = tuple(
            (shedding, *(limit for bit, limit in own if has & bit), slots, probe)
            for has in range(8)
        )
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
            if self.spend.shared and self.keys is not None:
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
                    await self.spend.seed(key.name, key.budget.per, spent)
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
                await self.spend.at_least(name, per, spent)
                carried[name] = spent
        except Exception as exc:  # the database away: those periods count from what they hold
            log_event("ledger.seed_failed", logging.WARNING, error=repr(exc))
        return carried

    async def budget_spent(self, key: str, per: str) -> int:
        """What `key` spent (and holds) in its current `per` period, in picos."""
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
        local = None if self.spend.shared else self.spend.local
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
        return self.spend.local.clock()

    def authenticate(self, request: Request) -> ApiKey:
        if self.keys is None:
            if not self._warned_open:
                self._warn_if_proxied_from_afar(request)
            return ANONYMOUS
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
        if not isinstance(ticket, Ticket) or ticket.admitted.ring is self.keys or self.keys is None:
            return None
        key = ticket.key
        now = self.keys.holds(key) if key.digest else key
        return key_revoked() if now is None or now.disabled else None

    def held(self, ticket: Ticket) -> dict[str, Any]:
        """What `ticket` holds in the shared limits, as it travels with a stream (another
        instance that takes the stream over gives it back: `settle_taken`)."""
        held: dict[str, Any] = {}
        admitted = ticket.admitted
        if admitted.lease is not None:
            held["lease"] = [admitted.lease.key, admitted.lease.id]
        r = admitted.reservation
        if r is not None and not r.local:  # one held in a dead process died with it
            held["reservation"] = [r.key, r.tokens, r.window]
        h = admitted.spend_hold
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
            await self.spend.settle(SpendHold(key, per, period, picos, local=False), 0)

    def taken_key(self, name: str, sha256: str = "") -> ApiKey | None:
        """The key a stream taken over was admitted for: the entry of the secret it started
        with (`sha256`, its digest), or by name for a stream that carries none; None when
        this instance has no such entry (its secret was removed: the stream ends, as on its
        owner it would have)."""
        if self.keys is None:
            return ANONYMOUS if name == "" else None
        if not sha256:
            return self.keys.named(name)
        try:
            digest = bytes.fromhex(sha256)
        except ValueError:
            return None
        key = self.keys.holds(ApiKey(name=name, digest=digest))
        return key if key is not None and key.name == name else None

    def taken_ticket(self, key: ApiKey, model: str, request_id: str, trace_id: str) -> Ticket:
        """A ticket, not admitted, for what a taken-over stream's owners generated and did not
        bill when the stream cannot go on here: it bills it (the record `request_id`), and
        counts it in the key's budget (a hold of 0, settled to the cost)."""
        hold = None
        if key.budget is not None:
            period, _ = period_of(key.budget.per, self.spend_clock())
            local = not self.spend.shared
            hold = SpendHold(key.name, key.budget.per, period, 0, local=local)
        legs = self.taken_legs(model)
        now = time.perf_counter()
        grant = Admitted(
            key=key,
            ring=None,
            model=model,
            prompt_tokens=0,
            max_tokens=None,
            request_id=request_id,
            trace_id=trace_id,
            own_latency=False,
            lease=None,
            reservation=None,
            spend_hold=hold,
            probe=False,
            legs=legs,
            arrived_at=time.time(),
            started=now,
            admitting_s=0.0,
        )
        # No engine ran here: the breaker learns nothing from it (`client_fault`).
        return Ticket(self, grant, client_fault=True)

    def taken_legs(self, model: str) -> tuple[LegStart, ...]:
        """A taken-over ticket bills the answer from where its owners' billing stopped, which
        may be tokens another instance generated (and, SIGKILLed, never billed): priced at
        the route's target, the one that generates its requests (a route's seams during the
        continuation add their legs as any request's do)."""
        target = self.ledger.target_of(model)
        return (LegStart(target),) if target else ()

    def limits_for(self, key: ApiKey) -> tuple[Limit, ...]:
        """The limits a request of `key` passes (gate.py): the server's always, and the ones
        the key has of its own."""
        if key is ANONYMOUS and self.keys is None:
            return self._open  # no keys file: no slots to ask, and no bucket at rate 0
        has = (
            4 * bool(key.requests_per_minute)
            + 2 * bool(key.tokens_per_minute)
            + (key.budget is not None)
        )
        return self._keyed[has]

    async def admit(
        self,
        key: ApiKey,
        prompt_tokens: int = 0,
        max_tokens: int | None = None,
        model: str = "",
        *,
        request_id: str = "",
        trace_id: str = "",
        own_latency: bool = False,
        taken_over: bool = False,
    ) -> Ticket:
        """Admit a request whose prompt counts `prompt_tokens` and whose answer may run to
        `max_tokens` (None: no limit given), for the route `model`, or raise the refusal.
        `request_id` names its ledger record ("": none), `own_latency` says it chose its
        own TTFT (`sets_own_latency`); `taken_over`: it continues a stream another instance
        started, billed from the route's target on (`taken_legs`)."""
        begun = time.perf_counter()
        ring = self.keys  # what `key` was checked against: before any await
        draft = Draft(key, prompt_tokens, max_tokens, model)
        try:
            for limit in self.limits_for(key):
                waiting = limit.take(draft)  # None: decided at once
                if waiting is not None:
                    await waiting
        except APIError:
            await draft.give_back()  # what the limits before it held, last first
            self._rejected()
            raise
        except BaseException:  # cancelled while a shared store answered
            await draft.give_back()
            raise
        legs = self.taken_legs(model) if taken_over else ()
        return Ticket(self, draft.passed(ring, begun, request_id, trace_id, own_latency, legs))

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
