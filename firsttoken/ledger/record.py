"""One ledger record: what one request used and cost, leg by leg."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from firsttoken.pricing import LegCost

__all__ = ["UsageRecord"]


@dataclass(frozen=True, slots=True)
class UsageRecord:
    request_id: str  # the stream's id: one record per request, written once however retried
    at: float  # when the request arrived (Unix seconds)
    key: str
    route: str
    currency: str
    outcome: str
    ttft_ms: float | None
    duration_ms: float
    trace_id: str
    legs: tuple[LegCost, ...]

    @property
    def cost(self) -> int:
        """In picos: the legs' costs added up."""
        return sum(leg.cost for leg in self.legs)

    @property
    def day(self) -> str:
        return datetime.fromtimestamp(self.at, UTC).strftime("%Y-%m-%d")

    def tokens(self) -> dict[str, int]:
        """The request's tokens by kind, its legs added up."""
        out = dict.fromkeys(TOKEN_COLUMNS, 0)
        for leg in self.legs:
            t = leg.tokens
            out["prompt_tokens"] += t.prompt
            out["completion_tokens"] += t.completion
            out["reasoning_tokens"] += t.reasoning
            out["cached_tokens"] += t.cached
            out["cache_write_tokens"] += t.cache_write
        return out


TOKEN_COLUMNS = (
    "prompt_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cached_tokens",
    "cache_write_tokens",
)
