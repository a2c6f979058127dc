from __future__ import annotations

from firsttoken.config import Settings
from firsttoken.engines import GenerationRequest, SyntheticEngine
from firsttoken.engines.cache import CachedEngine


class Relay(SyntheticEngine):
    """An inner engine with a counter of its own, as the relay's failovers."""

    def counters(self) -> dict[str, int]:
        return {"failovers": 3}


def test_a_cached_engine_reports_its_inner_engines_counters_too() -> None:
    cached = CachedEngine(Relay(), Settings(cache_ttl_s=5))
    assert cached.counters() == {"failovers": 3, "cache_hits": 0, "canned_hits": 0}


def test_only_deterministic_requests_have_a_key() -> None:
    cached = CachedEngine(SyntheticEngine(), Settings(cache_ttl_s=5))
    base = {"request_id": "r", "prompt": "p", "model": "synthetic", "max_tokens": 10}
    assert cached.key(GenerationRequest(**base, temperature=0)) is not None
    assert cached.key(GenerationRequest(**base, seed=7)) is not None
    assert cached.key(GenerationRequest(**base, temperature=0.8)) is None
    assert cached.key(GenerationRequest(**base, temperature=0)) == cached.key(
        GenerationRequest(**{**base, "request_id": "other"}, temperature=0)
    )


def test_entries_belong_to_a_key_unless_the_cache_is_shared() -> None:
    base = {"request_id": "r", "prompt": "p", "model": "synthetic", "temperature": 0}
    alice = GenerationRequest(**base, tenant="alice")
    bob = GenerationRequest(**base, tenant="bob")
    per_key = CachedEngine(SyntheticEngine(), Settings(cache_ttl_s=5))
    assert per_key.key(alice) != per_key.key(bob)
    assert per_key.key(alice) == per_key.key(GenerationRequest(**base, tenant="alice"))
    shared = CachedEngine(SyntheticEngine(), Settings(cache_ttl_s=5, cache_scope="shared"))
    assert shared.key(alice) == shared.key(bob)
