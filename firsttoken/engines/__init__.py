"""Engines behind one narrow interface; nothing else in the server knows which one runs."""

from __future__ import annotations

from firsttoken.config import Settings
from firsttoken.engines.base import Delta, Engine, EngineError, GenerationRequest
from firsttoken.engines.synthetic import SyntheticEngine, synthetic_tokens

__all__ = [
    "Delta",
    "Engine",
    "EngineError",
    "GenerationRequest",
    "SyntheticEngine",
    "build_engine",
    "synthetic_tokens",
]


def build_engine(settings: Settings) -> Engine:
    """One engine in this process (the routes build relays and wrap several of these)."""
    engine: Engine
    if settings.engine == "synthetic" and settings.batch_max > 0:
        from firsttoken.engines.batching import BatchingEngine

        engine = BatchingEngine(settings)
    elif settings.engine == "synthetic":
        engine = SyntheticEngine(
            ttft_ms=settings.synthetic_ttft_ms,
            itl_ms=settings.synthetic_itl_ms,
            style=settings.synthetic_style,
            fail_rate=settings.synthetic_fail_rate,
        )
    elif settings.engine == "llamacpp":
        from firsttoken.engines.llamacpp import LlamaCppEngine

        engine = LlamaCppEngine(settings)
    else:
        raise ValueError(f"unknown engine {settings.engine!r}")
    if settings.cache_ttl_s > 0 or settings.canned_answers:
        from firsttoken.engines.cache import CachedEngine

        engine = CachedEngine(engine, settings)
    return engine
