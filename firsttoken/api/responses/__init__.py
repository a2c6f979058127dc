"""OpenAI's Responses API: the adapter (`adapter.py`), its request models (`protocol.py`),
and the endpoints that read a response back by id (`stored.py`)."""

from firsttoken.api.responses.adapter import RESPONSES
from firsttoken.api.responses.stored import (
    cancel_response,
    delete_response,
    input_items,
    retrieve_response,
)

__all__ = ["RESPONSES", "cancel_response", "delete_response", "input_items", "retrieve_response"]
