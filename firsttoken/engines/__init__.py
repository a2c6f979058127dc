"""Engines behind one narrow interface; nothing else in the server knows which one runs.

The server's engine, and each route target's, is built in one place: `routes/build.py`."""

from __future__ import annotations

from firsttoken.engines.base import Delta, Engine, EngineError, GenerationRequest
from firsttoken.engines.synthetic import SyntheticEngine, synthetic_tokens

__all__ = [
    "Delta",
    "Engine",
    "EngineError",
    "GenerationRequest",
    "SyntheticEngine",
    "synthetic_tokens",
]
