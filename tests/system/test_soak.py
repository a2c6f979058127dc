"""A short soak (`python -m bench.soak` for 20 s): mixed traffic, no stream lost, nothing left
behind once it stops. The 10-minute run's figures are in docs/reliability.md."""

from __future__ import annotations

import asyncio

from bench.soak import soak


def test_short_soak_loses_nothing_and_leaks_nothing() -> None:
    result = asyncio.run(soak(20, 4, 2, resume_ttl_s=2))
    assert result.ok, result.failures
    assert result.lost == 0
    assert set(result.scenarios) >= {"complete", "cancel", "resume", "disconnect", "engine_error"}
    assert sum(result.scenarios.values()) > 100
    assert result.idle_after["active"] == 0
