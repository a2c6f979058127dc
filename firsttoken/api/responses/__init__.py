"""OpenAI's Responses API: the adapter (`adapter.py`) and its request models (`protocol.py`)."""

from firsttoken.api.responses.adapter import RESPONSES

__all__ = ["RESPONSES"]
