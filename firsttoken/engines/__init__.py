"""Engines behind one narrow interface; nothing else in the server knows which one runs.

The server's engine, and each route target's, is built in one place: `routing/build.py`."""

from __future__ import annotations

from firsttoken.engines.synthetic import SyntheticEngine, synthetic_tokens
from firsttoken.generation import Delta, Engine, EngineError, GenerationRequest

__all__ = [
    "Delta",
    "Engine",
    "EngineError",
    "GenerationRequest",
    "SyntheticEngine",
    "synthetic_tokens",
]
