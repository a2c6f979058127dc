"""firsttoken: stream LLM output over Server-Sent Events, fast and honestly.

Names are imported on first use, so `firsttoken diag` and the client don't pay for the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from firsttoken.version import __version__ as __version__

__all__ = [
    "Delta",
    "Engine",
    "EngineError",
    "EventDecoder",
    "GenerationRequest",
    "ServerSentEvent",
    "Settings",
    "SyntheticEngine",
    "create_app",
]

_WHERE = {
    "create_app": "firsttoken.app",
    "Settings": "firsttoken.config",
    "Delta": "firsttoken.engines",
    "Engine": "firsttoken.engines",
    "EngineError": "firsttoken.engines",
    "GenerationRequest": "firsttoken.engines",
    "SyntheticEngine": "firsttoken.engines",
    "EventDecoder": "firsttoken.formats.sse",
    "ServerSentEvent": "firsttoken.formats.sse",
}

if TYPE_CHECKING:
    from firsttoken.app import create_app
    from firsttoken.config import Settings
    from firsttoken.engines import Delta, Engine, EngineError, GenerationRequest, SyntheticEngine
    from firsttoken.formats.sse import EventDecoder, ServerSentEvent


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'firsttoken' has no attribute {name!r}")
