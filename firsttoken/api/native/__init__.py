"""The native stream API: create (`adapter.py`), read and cancel (`streams.py`)."""

from firsttoken.api.native.adapter import STREAMS
from firsttoken.api.native.streams import cancel_stream, stream_events

__all__ = ["STREAMS", "cancel_stream", "stream_events"]
