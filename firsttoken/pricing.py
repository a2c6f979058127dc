"""What tokens cost: a target's prices and the exact cost of an answer's legs.

Prices are written per million tokens, as decimals with at most six places (0.625, 1.50).
Every cost is computed in whole *picos* (10⁻¹² of the currency unit): a price of at most six
places is a whole number of picos per token (0.625 per million tokens is 625,000 picos a
token), so a cost is a sum of integer products, exact, with no rounding anywhere, and adds up
in Redis (INCRBY) and in a database column (BIGINT) the same as here. `Decimal` is only for
reading and showing: `to_money`. Never a float (a float's 0.1 is not 0.1, and sums drift).

A spliced or handed-off answer is priced per leg, each at its own target's prices for the
tokens it produced; the prompt (and the prompt cache's reads and writes) once, at the first
leg's target, as every API's usage counts it once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import NamedTuple

__all__ = [
    "PICOS",
    "LegCost",
    "LegStart",
    "Price",
    "Usage",
    "answer_cost",
    "parse_money",
    "to_money",
]

PICOS = 10**12  # picos in one unit of the currency
_PER_MILLION = 10**6  # a price per million tokens, as picos per token: price * 10**6
_PLACES = 6


def parse_money(value: object, what: str) -> Decimal:
    """A price or an amount as written in a TOML file (a number or a decimal string), exact,
    not negative, at most six decimal places; ValueError naming `what` otherwise. TOML floats
    come back through their shortest repr, which is the literal as written (0.50 → 0.5)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise ValueError(f"{what} must be a number")
    try:
        money = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    except InvalidOperation:
        raise ValueError(f"{what} must be a number") from None
    if not money.is_finite() or money < 0:
        raise ValueError(f"{what} must be a number >= 0")
    exponent = money.normalize().as_tuple().exponent
    if isinstance(exponent, int) and exponent < -_PLACES:
        raise ValueError(f"{what} has more than {_PLACES} decimal places")
    return money


def to_picos(money: Decimal) -> int:
    """An amount of the currency in picos (exact for at most twelve places)."""
    return int(money * PICOS)


def to_money(picos: int) -> Decimal:
    """Picos as an amount of the currency, exact, with twelve places dropped when zero."""
    return (Decimal(picos) / PICOS).normalize() if picos else Decimal(0)


def money_text(picos: int) -> str:
    """An amount as a plain decimal string (never exponent notation): what JSON and CSV say."""
    return format(to_money(picos), "f")


@dataclass(frozen=True, slots=True)
class Price:
    """A target's prices per million tokens, held as picos per token.

    `reasoning` defaults to `completion`; `cached_prompt` (prompt-cache reads) and
    `cache_write` (prompt-cache writes) to `prompt`."""

    prompt: int = 0
    completion: int = 0
    cached_prompt: int = 0
    cache_write: int = 0
    reasoning: int = 0

    @classmethod
    def per_million(
        cls,
        prompt: Decimal = Decimal(0),
        completion: Decimal = Decimal(0),
        cached_prompt: Decimal | None = None,
        cache_write: Decimal | None = None,
        reasoning: Decimal | None = None,
    ) -> Price:
        def picos(d: Decimal) -> int:
            return int(d * _PER_MILLION)

        return cls(
            prompt=picos(prompt),
            completion=picos(completion),
            cached_prompt=picos(prompt if cached_prompt is None else cached_prompt),
            cache_write=picos(prompt if cache_write is None else cache_write),
            reasoning=picos(completion if reasoning is None else reasoning),
        )

    @property
    def free(self) -> bool:
        return not (
            self.prompt
            or self.completion
            or self.cached_prompt
            or self.cache_write
            or self.reasoning
        )

    def most_per_prompt_token(self) -> int:
        return max(self.prompt, self.cached_prompt, self.cache_write)

    def most_per_answer_token(self) -> int:
        return max(self.completion, self.reasoning)

    def shown(self) -> dict[str, str]:
        """Per million tokens, as decimal strings."""
        return {
            name: format((Decimal(getattr(self, name)) / _PER_MILLION).normalize(), "f")
            for name in ("prompt", "completion", "cached_prompt", "cache_write", "reasoning")
        }


FREE = Price()


class Usage(NamedTuple):
    """What one answer (or one leg of it) used, in tokens: what its key is billed and counted
    for. `prompt` includes `cached` and `cache_write` (as OpenAI's prompt_tokens does);
    `completion` includes `reasoning`."""

    prompt: int = 0
    completion: int = 0
    reasoning: int = 0
    cached: int = 0  # prompt tokens the upstream read from its cache
    cache_write: int = 0  # prompt tokens the upstream wrote to its cache

    def cost(self, price: Price) -> int:
        """In picos."""
        fresh = max(0, self.prompt - self.cached - self.cache_write)
        answer = max(0, self.completion - self.reasoning)
        return (
            fresh * price.prompt
            + self.cached * price.cached_prompt
            + self.cache_write * price.cache_write
            + answer * price.completion
            + self.reasoning * price.reasoning
        )


@dataclass(frozen=True, slots=True)
class LegStart:
    """Where one part of an answer came from: the target, and the answer's token count before
    this leg began (0 for the first)."""

    target: str
    at_token: int = 0


_NO_LEG = LegStart("")


@dataclass(frozen=True, slots=True)
class LegCost:
    target: str
    tokens: Usage
    cost: int  # picos


def answer_cost(
    legs: Sequence[LegStart], usage: Usage, prices: Mapping[str, Price]
) -> list[LegCost]:
    """`usage` (the whole answer's, as its client was told) split over its legs and priced:
    each leg's answer tokens at its own target's prices, the prompt at the first leg's.
    Reasoning comes before the answer, so the first `usage.reasoning` tokens are reasoning,
    whichever leg made them. No legs (nothing was generated, or no routes): one leg of
    target "" that costs nothing."""
    if len(legs) <= 1 and 0 <= usage.reasoning <= usage.completion:
        # One target (or none) from the first token: the whole usage is its leg's, the
        # loop's numbers without its arithmetic (every request's end takes this path).
        leg = legs[0] if legs else _NO_LEG
        if leg.at_token <= 0:
            price = prices.get(leg.target)
            return [LegCost(leg.target, usage, usage.cost(price) if price is not None else 0)]
    if not legs:
        legs = (_NO_LEG,)
    out: list[LegCost] = []
    total = usage.completion
    for i, leg in enumerate(legs):
        start = min(max(0, leg.at_token), total)
        end = total if i + 1 == len(legs) else min(max(start, legs[i + 1].at_token), total)
        reasoning = max(0, min(end, usage.reasoning) - start)
        tokens = Usage(
            prompt=usage.prompt if i == 0 else 0,
            completion=end - start,
            reasoning=reasoning,
            cached=usage.cached if i == 0 else 0,
            cache_write=usage.cache_write if i == 0 else 0,
        )
        out.append(LegCost(leg.target, tokens, tokens.cost(prices.get(leg.target, FREE))))
    return out
