"""Reading a native event stream's body in tests."""

from __future__ import annotations

import json

from firsttoken.formats.sse import EventDecoder

__all__ = ["tokens_of"]


def tokens_of(body: bytes) -> tuple[list[str], str, bool, dict | None]:
    """(tokens, last event id, [DONE] seen, error object) of a native event stream body."""
    decoder = EventDecoder()
    tokens, done, error = [], False, None
    for event in decoder.feed(body):
        if event.data == "[DONE]":
            done = True
        elif event.event == "error":
            error = json.loads(event.data or "")["error"]
        elif event.event is None:
            tokens.append(json.loads(event.data or "")["token"])
    return tokens, decoder.last_event_id, done, error
