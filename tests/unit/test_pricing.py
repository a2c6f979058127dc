"""Prices and costs: exact to the pico, per leg, cache and reasoning at their own prices."""

from __future__ import annotations

from decimal import Decimal

import pytest

from firsttoken.pricing import (
    LegStart,
    Price,
    Usage,
    answer_cost,
    money_text,
    parse_money,
    to_money,
    to_picos,
)

CENTER = Price.per_million(
    prompt=Decimal("0.50"),
    completion=Decimal("1.50"),
    cached_prompt=Decimal("0.05"),
    cache_write=Decimal("0.625"),
    reasoning=Decimal("3"),
)
EDGE = Price.per_million(prompt=Decimal("0.1"), completion=Decimal("0.2"))


def test_a_price_per_million_is_a_whole_number_of_picos_per_token() -> None:
    assert CENTER.prompt == 500_000
    assert CENTER.cache_write == 625_000
    assert CENTER.cached_prompt == 50_000


def test_cache_prices_default_to_the_prompt_and_reasoning_to_the_completion() -> None:
    assert EDGE.cached_prompt == EDGE.prompt == EDGE.cache_write
    assert EDGE.reasoning == EDGE.completion


def test_each_kind_of_token_is_priced_at_its_own_price() -> None:
    usage = Usage(prompt=1000, completion=300, reasoning=100, cached=600, cache_write=200)
    # fresh prompt 200 x 0.5, cached 600 x 0.05, written 200 x 0.625, answer 200 x 1.5,
    # reasoning 100 x 3, per million
    expected = Decimal("0.0001") + Decimal("0.00003") + Decimal("0.000125")
    expected += Decimal("0.0003") + Decimal("0.0003")
    assert to_money(usage.cost(CENTER)) == expected


def test_decimal_sums_never_drift_as_floats_do() -> None:
    one = Usage(prompt=1, completion=0).cost(Price.per_million(prompt=Decimal("0.1")))
    total = sum(one for _ in range(10_000))
    assert to_money(total) == Decimal("0.001")  # 10,000 x 0.1e-6, exactly
    assert sum(0.1e-6 for _ in range(10_000)) != 0.001  # what floats would have said


def test_a_spliced_answer_is_priced_per_leg_and_the_prompt_once_at_the_first() -> None:
    usage = Usage(prompt=10, completion=30, reasoning=4)
    legs = answer_cost(
        [LegStart("edge"), LegStart("center", 8)], usage, {"edge": EDGE, "center": CENTER}
    )
    assert [(c.target, c.tokens.prompt, c.tokens.completion) for c in legs] == [
        ("edge", 10, 8),
        ("center", 0, 22),
    ]
    assert legs[0].tokens.reasoning == 4  # reasoning comes first: the edge made it
    assert legs[1].tokens.reasoning == 0
    assert legs[0].cost == 10 * 100_000 + 8 * 200_000
    assert legs[1].cost == 22 * 1_500_000


def test_a_leg_past_the_delivered_tokens_gets_none() -> None:
    legs = answer_cost([LegStart("edge"), LegStart("center", 50)], Usage(5, 20), {})
    assert [c.tokens.completion for c in legs] == [20, 0]


def test_no_legs_and_unpriced_targets_cost_nothing() -> None:
    assert [c.cost for c in answer_cost([], Usage(5, 20), {"x": CENTER})] == [0]
    assert answer_cost([LegStart("unpriced")], Usage(5, 20), {"x": CENTER})[0].cost == 0


@pytest.mark.parametrize(
    ("written", "exact"),
    [(0.5, "0.5"), ("1.50", "1.50"), (25, "25"), (0.000001, "0.000001"), (1e-6, "0.000001")],
)
def test_money_is_read_exactly_as_written(written: object, exact: str) -> None:
    assert parse_money(written, "x") == Decimal(exact)


@pytest.mark.parametrize(
    ("written", "says"),
    [
        (-1, "must be a number >= 0"),
        ("abc", "must be a number"),
        (True, "must be a number"),
        (0.0000001, "more than 6 decimal places"),
        (float("nan"), "must be a number >= 0"),
    ],
)
def test_bad_money_is_refused_saying_why(written: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_money(written, "x")


def test_money_is_shown_as_a_plain_decimal() -> None:
    assert money_text(to_picos(Decimal("0.000123"))) == "0.000123"
    assert money_text(0) == "0"
    assert money_text(1) == "0.000000000001"
    assert money_text(to_picos(Decimal(25))) == "25"
