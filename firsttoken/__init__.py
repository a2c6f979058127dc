"""firsttoken: stream LLM output over Server-Sent Events, fast and honestly."""

from firsttoken.app import create_app
from firsttoken.config import Settings
from firsttoken.engines import Delta, Engine, EngineError, GenerationRequest, SyntheticEngine
from firsttoken.sse import EventDecoder, ServerSentEvent

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
__version__ = "0.1.0"
