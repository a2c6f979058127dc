from __future__ import annotations

from pathlib import Path

import pytest

from firsttoken.config import Settings
from firsttoken.engines import GenerationRequest, SyntheticEngine
from firsttoken.engines.cache import CachedEngine, load_canned


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


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # `[answer]` for `[answers]` would start and answer nothing.
        ('[answer]\n"hi" = "Hello"\n', "unknown table or field 'answer' (known: [answers])"),
        ('greeting = "hi"\n[answers]\n"hi" = "Hello"\n', "unknown table or field 'greeting'"),
        ("[answers]\n", 'no [answers] entries ("prompt" = "answer")'),
        ('[answers]\n"hi" = 3\n', "[answers] must map prompt strings to answer strings"),
    ],
)
def test_a_canned_answers_file_with_a_typo_is_refused(
    tmp_path: Path, body: str, message: str
) -> None:
    path = tmp_path / "canned.toml"
    path.write_text(body)
    with pytest.raises(ValueError) as refused:
        load_canned(path)
    assert str(refused.value).startswith(f"{path}: {message}")


def test_canned_prompts_come_back_normalised(tmp_path: Path) -> None:
    path = tmp_path / "canned.toml"
    path.write_text('[answers]\n"Hi  There!" = "Hello"\n')
    assert load_canned(path) == {"hi there": "Hello"}
