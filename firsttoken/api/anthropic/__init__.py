"""Anthropic's Messages API: the adapter (`adapter.py`) and its request models (`protocol.py`)."""

from firsttoken.api.anthropic.adapter import MESSAGES, count_tokens

__all__ = ["MESSAGES", "count_tokens"]
