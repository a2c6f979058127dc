"""The ledger as the gateway holds it: prices, what each request cost, the counters, and the
records on their way to the store.

`worst_cost` is what admission reserves against a money budget; `account` prices an ended
request (`pricing.answer_cost`), counts it (`firsttoken_key_spend_total`,
`firsttoken_cost_per_million_tokens`) and queues its record. The spend counter and the record
come from the same integer, so the ledger's total and the counter agree to the last pico.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal

import anyio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from firsttoken.ledger.record import UsageRecord
from firsttoken.ledger.stores import LedgerStore, open_store
from firsttoken.ledger.writer import LedgerWriter
from firsttoken.pricing import FREE, PICOS, LegCost, LegStart, Price, Usage, answer_cost
from firsttoken.routing.config import ModelRoute, RouteTable
from firsttoken.telemetry.log import log_event

__all__ = ["Ledger"]


class Ledger:
    def __init__(
        self, url: str | None = None, max_records: int = 100_000, *, read: bool = True
    ) -> None:
        self.url = url
        # Whether anyone can read its records: a database, or an admin key for GET /v1/usage
        # and /ops. Without either, and without prices (every cost 0), a request's record
        # would be kept for nobody: `counting` is False and nothing is accounted.
        self.read = read or url is not None
        self.store: LedgerStore = open_store(url)
        self.writer = LedgerWriter(self.store, max_records=max_records)
        self.currency = "USD"
        self.prices: dict[str, Price] = {}
        self._routes: Mapping[str, ModelRoute] = {}
        self._default: ModelRoute | None = None
        self._worst: dict[str, tuple[int, int]] = {}  # route -> picos per prompt, answer token
        self.spend: dict[str, int] = {}  # key -> picos in `currency`, since start
        # What keys spent in a currency the routes file named before (a reload changed it).
        self.spend_before: dict[tuple[str, str], int] = {}
        self.route_cost: dict[str, int] = {}  # route -> picos
        self.route_tokens: dict[str, int] = {}  # route -> prompt + completion tokens
        self.ready = asyncio.Event()  # the store is open (its schema migrated)
        self.counting = self.read

    def price(self, table: RouteTable, routes: Mapping[str, ModelRoute] | None = None) -> None:
        """Take the routes file's prices; `routes`: the engine's model names (aliases too)."""
        if table.currency != self.currency:  # counted apart: two currencies never add up
            for key, picos in self.spend.items():
                was = self.spend_before.get((key, self.currency), 0)
                self.spend_before[key, self.currency] = was + picos
            self.spend = {
                key: self.spend_before.pop((key, table.currency), 0) for key in self.spend
            }
        self.currency = table.currency
        self.prices = {name: t.price for name, t in table.targets.items() if t.price is not None}
        self.counting = self.read or bool(self.prices)
        self._routes = routes if routes is not None else table.routes
        self._default = table.default
        for name, route in table.routes.items():
            names = list(route.targets)
            if route.handoff is not None:
                names.append(route.handoff.source)
            if route.short_prompts is not None:
                names.append(route.short_prompts.target)
            prices = [self.prices.get(n, FREE) for n in names]
            prompt = max(p.most_per_prompt_token() for p in prices)
            answer = max(p.most_per_answer_token() for p in prices)
            if route.handoff is not None and route.handoff.prefill:
                # The prefill reads the prompt again at a center's price (its one answer
                # token is left out: held per answer token, it would double every hold).
                centers = [self.prices.get(n, FREE) for n in route.targets]
                prompt += max(p.most_per_prompt_token() for p in centers)
            self._worst[name] = (prompt, answer)
            self.route_cost.setdefault(name, 0)
            self.route_tokens.setdefault(name, 0)

    @property
    def priced(self) -> bool:
        return bool(self.prices)

    def unpriced(self, table: RouteTable) -> list[str]:
        """The targets without a price (their tokens cost 0), when any target has one."""
        return [n for n, t in table.targets.items() if t.price is None] if self.prices else []

    def route_of(self, model: str) -> str:
        route = self._routes.get(model) or self._default
        return route.name if route is not None else model

    def target_of(self, model: str) -> str:
        """The route's first target ("" without routes): what a taken-over answer's part
        is priced at, as the instance that generated it is not there to say."""
        route = self._routes.get(model) or self._default
        return route.targets[0] if route is not None and route.targets else ""

    def worst_cost(self, model: str, prompt_tokens: int, answer_tokens: int) -> int:
        """In picos: the prompt and the whole answer at the route's dearest prices."""
        prompt, answer = self.worst_prices(model)
        return prompt_tokens * prompt + answer_tokens * answer

    def worst_prices(self, model: str) -> tuple[int, int]:
        """In picos: the route's dearest price of a prompt token and of an answer token."""
        return self._worst.get(self.route_of(model), (0, 0))

    def account(
        self,
        *,
        request_id: str,
        at: float,
        key: str,
        model: str,
        legs: Sequence[LegStart],
        usage: Usage,
        outcome: str,
        ttft_ms: float | None,
        duration_ms: float,
        trace_id: str,
        prefill: str = "",
    ) -> int:
        """Price an ended request, count it, queue its record; its cost in picos. `prefill`:
        the target of the hand-off's prefill, a leg of its own (the prompt and one token)."""
        route = self.route_of(model)
        costs = answer_cost(legs, usage, self.prices)
        if prefill:
            asked = Usage(prompt=usage.prompt, completion=1)
            price = self.prices.get(prefill)
            costs.append(LegCost(prefill, asked, asked.cost(price) if price is not None else 0))
        record = UsageRecord(
            request_id=request_id,
            at=at,
            key=key,
            route=route,
            currency=self.currency,
            outcome=outcome,
            ttft_ms=ttft_ms,
            duration_ms=duration_ms,
            trace_id=trace_id,
            legs=tuple(costs),
        )
        cost = costs[0].cost if len(costs) == 1 else record.cost
        self.spend[key] = self.spend.get(key, 0) + cost
        self.route_cost[route] = self.route_cost.get(route, 0) + cost
        self.route_tokens[route] = self.route_tokens.get(route, 0) + usage.prompt + usage.completion
        self.writer.submit(record)
        return cost

    async def spent(self, key: str, since: float) -> int:
        """What `key`'s requests that arrived from `since` (Unix seconds) cost, in picos: the
        store's records and those still queued for it."""
        money = self.currency  # a budget's amount is in the routes file's currency
        stored = await self.store.spent(key, since, money)
        return stored + sum(
            r.cost
            for r in self.writer.queue
            if r.key == key and r.at >= since and r.currency == money
        )

    async def run(self) -> None:
        """Open the store (create or migrate its schema), then write what is queued until
        cancelled. A database away at start is tried again; records queue meanwhile."""
        delay = 0.1
        while True:
            try:
                await self.store.open()
                break
            except Exception as exc:  # away, or refusing us: said once, tried again
                self.writer.up = False
                if delay == 0.1:
                    log_event(
                        "ledger.open_failed", logging.ERROR, store=self.store.shown, error=repr(exc)
                    )
                await anyio.sleep(delay)
                delay = min(2.0, delay * 2)
        self.writer.up = True
        self.ready.set()
        await self.writer.run()

    @property
    def degraded(self) -> str | None:
        """What /readyz reports degraded: "ledger" while --usage-db refuses writes (records
        queue, streams go on); None otherwise."""
        return "ledger" if self.url and not self.writer.up else None

    def collect(self) -> Iterator[Metric]:
        spend = CounterMetricFamily(
            "firsttoken_key_spend",
            "What each API key spent since this process started (not per budget period: "
            "firsttoken_key_budget_spent is), in each currency the routes file named, "
            "priced per target.",
            labels=["key", "currency"],
        )
        for key, picos in self.spend.items():
            spend.add_metric([key, self.currency], float(Decimal(picos) / PICOS))
        for (key, money), picos in self.spend_before.items():
            spend.add_metric([key, money], float(Decimal(picos) / PICOS))
        yield spend
        currency = GaugeMetricFamily(
            "firsttoken_currency",
            "1, labelled with the currency the routes file prices in now.",
            labels=["currency"],
        )
        currency.add_metric([self.currency], 1.0)
        yield currency
        per_million = GaugeMetricFamily(
            "firsttoken_cost_per_million_tokens",
            "What a million tokens (prompt and answer) cost on each route since the start.",
            labels=["route"],
        )
        for route, picos in self.route_cost.items():
            tokens = self.route_tokens.get(route, 0)
            per_million.add_metric(
                [route], float(Decimal(picos) * 10**6 / PICOS / tokens) if tokens else 0.0
            )
        yield per_million
        dropped = CounterMetricFamily(
            "firsttoken_usage_records_dropped",
            "Ledger records dropped: the queue to the usage database was full.",
        )
        dropped.add_metric([], self.writer.dropped)
        yield dropped
        if self.url:
            up = GaugeMetricFamily(
                "firsttoken_usage_db_up",
                "1 while the usage database (--usage-db) takes writes, 0 while it refuses them.",
            )
            up.add_metric([], 1.0 if self.writer.up else 0.0)
            yield up
        queued = GaugeMetricFamily(
            "firsttoken_usage_records_queued",
            "Ledger records waiting to be written to the usage database.",
        )
        queued.add_metric([], len(self.writer.queue))
        yield queued
