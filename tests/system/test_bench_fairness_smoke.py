"""`python -m bench.fairness` must not rot: each scenario once, small.

Not a performance test: no figure is checked against a target, only what each scenario
reports holds together (the budget's overshoot is at most one request, a cut stream is billed
what it generated, every flooded stream completes)."""

from __future__ import annotations

from bench.fairness import budget, cut, flood


def test_the_budget_scenario_goes_over_by_at_most_one_request() -> None:
    result = budget(requests=8, max_tokens=50)
    assert 1 <= result["admitted"] < 8
    assert set(result["refused"]) == {"token_budget_exceeded"}
    assert result["over_budget_requests"] <= 1
    billed = result["billed"]
    assert billed["prompt"] + billed["completion"] == result["tokens_used"]


def test_the_cut_scenario_bills_what_was_generated() -> None:
    result = cut(after_chunks=5, max_tokens=200)
    assert result["chunks_read"] == 5 and result["outcome"] == "disconnected"
    assert result["billed"]["completion"] == result["tokens_generated"] < 200
    assert result["billed"]["prompt"] > 0


def test_the_flood_scenario_completes_every_stream() -> None:
    result = flood(tokens=10, delay_s=0.05)
    for key, figures in result["keys"].items():
        assert figures["completed"] == figures["streams"], (key, figures)
        assert figures["ttft_p50_ms"] is not None
