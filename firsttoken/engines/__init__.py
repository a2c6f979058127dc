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
    if settings.engine == "synthetic":
        return SyntheticEngine(ttft_ms=settings.synthetic_ttft_ms, itl_ms=settings.synthetic_itl_ms)
    raise ValueError(f"engine {settings.engine!r} is not available in this build")
