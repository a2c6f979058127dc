"""OpenAI's API: Chat Completions, Completions (`adapter.py`, models in `protocol.py`) and the
model list (`models.py`)."""

from firsttoken.api.openai.adapter import CHAT, COMPLETIONS
from firsttoken.api.openai.models import model, models

__all__ = ["CHAT", "COMPLETIONS", "model", "models"]
