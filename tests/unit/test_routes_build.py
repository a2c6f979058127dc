"""From settings to engines: the `--engine openai --upstream A,B` shorthand is one route, and
each target kind becomes its engine with the file's settings (no sockets are opened here)."""

from __future__ import annotations

import pytest

from firsttoken.config import Settings
from firsttoken.engines.anthropic_relay import AnthropicRelay
from firsttoken.engines.batching import BatchingEngine
from firsttoken.engines.cache import CachedEngine
from firsttoken.engines.relay import RelayEngine
from firsttoken.engines.synthetic import SyntheticEngine
from firsttoken.routing.build import build_engine, build_routes, engine_of, routes_in, shorthand
from firsttoken.routing.config import parse_routes
from firsttoken.routing.engine import RoutedEngine


def test_the_upstream_shorthand_is_one_balanced_route_without_splices() -> None:
    settings = Settings(
        engine="openai",
        upstream="http://127.0.0.1:8001/v1,http://127.0.0.1:8002/v1",
        upstream_connect_timeout_s=2.0,
        upstream_read_timeout_s=45.0,
    )
    table = shorthand(settings)
    assert list(table.targets) == ["upstream-1", "upstream-2"]
    first = table.targets["upstream-1"]
    assert (first.kind, first.url) == ("openai", "http://127.0.0.1:8001/v1")
    assert table.targets["upstream-2"].url == "http://127.0.0.1:8002/v1"
    assert first.connect_timeout_s == 2.0
    assert first.first_token_timeout_s == first.idle_timeout_s == 45.0
    assert first.continuation == "none"
    route = table.default
    assert route.name == "default" and route.targets == ("upstream-1", "upstream-2")
    assert (route.balance, route.max_splices, route.passthrough) == ("least_busy", 0, True)


def test_each_kind_becomes_its_engine_with_the_files_settings() -> None:
    table = parse_routes(
        {
            "targets": {
                "vllm": {
                    "kind": "openai",
                    "url": "http://127.0.0.1:8001/v1",
                    "model": "Qwen/Qwen3-8B",
                    "api_key_env": "VLLM_KEY",
                },
                "llama": {
                    "kind": "openai",
                    "url": "http://127.0.0.1:8003/v1",
                    "continuation": "completions",
                },
                "claude": {"kind": "anthropic", "url": "http://127.0.0.1:8002/v1"},
                "fake": {"kind": "synthetic", "ttft_ms": 3, "itl_ms": 1},
            },
            "models": {"chat": {"targets": ["vllm", "llama", "claude", "fake"]}},
        }
    )
    engine = build_routes(table, Settings(), env={"VLLM_KEY": "sk-vllm"})
    relay, claude, fake = (engine.targets[n].engine for n in ("vllm", "claude", "fake"))
    assert isinstance(relay, RelayEngine)
    assert relay.model == "Qwen/Qwen3-8B"
    assert relay._headers["authorization"] == "Bearer sk-vllm"
    assert relay._template is None
    llama = engine.targets["llama"].engine
    assert isinstance(llama, RelayEngine) and llama._template == "chatml"
    assert isinstance(claude, AnthropicRelay)
    assert isinstance(fake, SyntheticEngine)
    assert (fake.ttft_ms, fake.itl_ms) == (3.0, 1.0)
    assert engine.models == ("chat",)
    assert engine.targets["fake"].continues and not engine.targets["vllm"].continues


def test_the_servers_own_engine_comes_from_the_same_builder_as_a_targets() -> None:
    alone = build_engine(Settings(synthetic_ttft_ms=7, synthetic_fail_rate=0.5))
    assert isinstance(alone, SyntheticEngine)
    assert alone.ttft_ms == 7.0 and alone.faults.rate == 0.5
    assert isinstance(build_engine(Settings(batch_max=4)), BatchingEngine)
    cached = build_engine(Settings(cache_ttl_s=60))
    assert isinstance(cached, CachedEngine) and isinstance(cached.inner, SyntheticEngine)
    with pytest.raises(ValueError, match="unknown engine 'openai'"):
        engine_of("openai", Settings())  # a relay needs a target's URL


def test_the_app_finds_the_routes_under_the_cache_and_none_in_a_single_engine() -> None:
    upstream = Settings(engine="openai", upstream="http://127.0.0.1:8001/v1", cache_ttl_s=60)
    cached = build_engine(upstream)
    assert isinstance(cached, CachedEngine) and isinstance(cached.inner, RoutedEngine)
    assert routes_in(cached) is cached.inner
    assert routes_in(cached.inner) is cached.inner
    assert routes_in(build_engine(Settings())) is None
