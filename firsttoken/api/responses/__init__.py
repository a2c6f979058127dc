"""OpenAI's Responses API: the adapter (`adapter.py`), its request models (`protocol.py`),
the endpoints that read a response back by id (`stored.py`), and stored conversations
(`conversation.py`, `records.py`: input_items, previous_response_id)."""

from firsttoken.api.responses.adapter import RESPONSES
from firsttoken.api.responses.conversation import input_items
from firsttoken.api.responses.stored import (
    cancel_response,
    delete_response,
    retrieve_response,
)

__all__ = ["RESPONSES", "cancel_response", "delete_response", "input_items", "retrieve_response"]
