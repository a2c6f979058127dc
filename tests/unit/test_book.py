"""The ledger as the gateway holds it: the worst case a budget reserves, what an ended
request costs and counts, and the targets said to cost nothing."""

from __future__ import annotations

from firsttoken.ledger.book import Ledger
from firsttoken.pricing import LegStart, Usage
from firsttoken.routing.config import parse_routes

ROUTES = {
    "currency": "EUR",
    "targets": {
        "edge": {"kind": "synthetic", "price": {"prompt": 0.1, "completion": 0.2}},
        "center": {
            "kind": "synthetic",
            "price": {"prompt": 0.5, "completion": 1.5, "cache_write": 0.625, "reasoning": 3},
        },
        "free": {"kind": "synthetic"},
    },
    "models": {
        "chat": {"targets": ["center"], "handoff": {"from": "edge", "after_tokens": 5}},
        "cheap": {"targets": ["edge", "free"]},
    },
}


def ledger() -> Ledger:
    book = Ledger()
    book.price(parse_routes(ROUTES))
    return book


def test_the_worst_case_is_the_routes_dearest_prices() -> None:
    book = ledger()
    # prompt at the dearest prompt-side price (cache_write 0.625), and again at the center's
    # dearest for the hand-off's prefill; answer at reasoning's 3
    assert book.worst_cost("chat", 100, 1000) == 100 * 2 * 625_000 + 1000 * 3_000_000
    assert book.worst_cost("cheap", 100, 1000) == 100 * 100_000 + 1000 * 200_000
    assert book.worst_cost("unknown", 1, 1) == book.worst_cost("chat", 1, 1)  # the default


def test_an_ended_request_is_priced_counted_and_queued() -> None:
    book = ledger()
    cost = book.account(
        request_id="r1",
        at=0.0,
        key="alice",
        model="chat",
        legs=[LegStart("edge"), LegStart("center", 5)],
        usage=Usage(prompt=10, completion=15),
        outcome="completed",
        ttft_ms=3.0,
        duration_ms=9.0,
        trace_id="t",
    )
    assert cost == 10 * 100_000 + 5 * 200_000 + 10 * 1_500_000
    assert book.spend == {"alice": cost}
    assert book.route_cost["chat"] == cost and book.route_tokens["chat"] == 25
    (record,) = book.writer.queue
    assert record.currency == "EUR" and [leg.target for leg in record.legs] == ["edge", "center"]


def test_the_targets_without_a_price_are_named() -> None:
    book = ledger()
    assert book.unpriced(parse_routes(ROUTES)) == ["free"]
    unpriced = {"targets": {"a": {"kind": "synthetic"}}, "models": {"m": {"targets": ["a"]}}}
    nothing = Ledger()
    nothing.price(parse_routes(unpriced))
    assert nothing.unpriced(parse_routes(unpriced)) == []  # no prices at all: nothing to say


def test_metrics_say_spend_and_cost_per_million() -> None:
    book = ledger()
    book.account(
        request_id="r1",
        at=0.0,
        key="open",
        model="cheap",
        legs=[LegStart("edge")],
        usage=Usage(prompt=500_000, completion=500_000),
        outcome="completed",
        ttft_ms=None,
        duration_ms=1.0,
        trace_id="",
    )
    families = {f.name: f for f in book.collect()}
    assert families["firsttoken_key_spend"].samples[0].labels == {"key": "open", "currency": "EUR"}
    assert families["firsttoken_key_spend"].samples[0].value == 0.15
    cheap = [
        s
        for s in families["firsttoken_cost_per_million_tokens"].samples
        if s.labels["route"] == "cheap"
    ]
    assert cheap[0].value == 0.15


def test_a_taken_over_part_is_priced_at_its_routes_first_target() -> None:
    book = ledger()
    assert book.target_of("cheap") == "edge" and book.target_of("chat") == "center"
    assert book.target_of("unknown") == "center"  # the default route's
    assert Ledger().target_of("chat") == ""  # no routes: no target, no price


def test_a_ledger_nobody_reads_and_without_prices_counts_nothing() -> None:
    """No database, no admin key to read GET /v1/usage, no price: a record would be kept for
    nobody (and every cost is 0), so a request pays nothing for one."""
    unread = Ledger(read=False)
    assert not unread.counting
    priced = {"kind": "synthetic", "price": {"prompt": 1}}
    unread.price(parse_routes({"targets": {"t": priced}, "models": {"m": {"targets": ["t"]}}}))
    assert unread.counting  # priced: spend and budgets need the cost
    assert Ledger(read=True).counting and Ledger("sqlite:///x.db", read=False).counting


def end(book: Ledger, key: str = "alice", **extra: object) -> int:
    return book.account(
        request_id="r1",
        at=0.0,
        key=key,
        model="chat",
        legs=[LegStart("edge"), LegStart("center", 5)],
        usage=Usage(prompt=10, completion=15),
        outcome="completed",
        ttft_ms=3.0,
        duration_ms=9.0,
        trace_id="t",
        **extra,  # type: ignore[arg-type]
    )


def test_the_hand_offs_prefill_is_billed_as_a_leg_at_the_centers_prices() -> None:
    book = ledger()
    answer = 10 * 100_000 + 5 * 200_000 + 10 * 1_500_000
    cost = end(book, prefill="center")
    # The prompt again and one token, at the center's prices.
    assert cost == answer + 10 * 500_000 + 1 * 1_500_000
    assert book.spend == {"alice": cost}
    (record,) = book.writer.queue
    assert [(leg.target, leg.tokens.prompt, leg.tokens.completion) for leg in record.legs] == [
        ("edge", 10, 5),
        ("center", 0, 10),
        ("center", 10, 1),
    ]
    assert record.cost == cost


def test_a_currency_change_counts_spend_apart() -> None:
    book = ledger()
    euros = end(book)
    dollars = dict(ROUTES, currency="USD")
    book.price(parse_routes(dollars))
    spent = end(book)
    samples = {
        (s.labels["key"], s.labels["currency"]): s.value
        for f in book.collect()
        if f.name == "firsttoken_key_spend"
        for s in f.samples
    }
    assert samples == {("alice", "USD"): spent / 10**12, ("alice", "EUR"): euros / 10**12}
    book.price(parse_routes(ROUTES))  # back to euros: that count goes on
    assert book.spend == {"alice": euros} and book.spend_before == {("alice", "USD"): spent}
