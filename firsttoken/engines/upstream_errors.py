"""What a client may read of an upstream's error (`--upstream-errors`).

An upstream's error body is written for its operator as much as for the client: a traceback,
a proxy's page, a connection string. The client gets the upstream's status, and its message
only when the body is an error in a shape a server writes for its clients (OpenAI's and
Anthropic's `{"error": {"message"}}`, vLLM's flat `{"object": "error", "message"}`, TGI's
`{"error": "..."}`), with control characters and terminal escapes taken out. With `redact`
even that stays in the server's log.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

import orjson

__all__ = ["MAX_MESSAGE", "clean", "generic", "shaped_message"]

MAX_MESSAGE = 500  # characters of an upstream's message a client reads

# ANSI escape sequences (CSI `ESC [ … final`, OSC `ESC ] … BEL|ST`, and two-character ones),
# then any other control character (C0, DEL, C1), and bidi overrides that reorder text.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?")
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]+")
_SPACES = re.compile(r" {2,}")


def clean(text: str, limit: int = MAX_MESSAGE) -> str:
    """One line of plain text: escapes removed, control characters (CR and LF included) as
    spaces, at most `limit` characters."""
    text = _CONTROLS.sub(" ", _ESCAPES.sub("", text[: limit * 4]))
    return _SPACES.sub(" ", text).strip()[:limit]


def shaped_message(body: Any) -> str | None:
    """The message of an error body in a shape servers write for clients, else None. `body`
    is the parsed JSON (or the raw bytes, parsed here)."""
    if isinstance(body, bytes | bytearray):
        try:
            body = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(body, Mapping):
        return None
    err = body.get("error")
    if isinstance(err, Mapping):  # OpenAI, Anthropic, llama.cpp, newer vLLM
        message = err.get("message")
    elif isinstance(err, str):  # TGI
        message = err
    elif body.get("object") == "error":  # vLLM's flat ErrorResponse
        message = body.get("message")
    else:
        return None
    if not isinstance(message, str):
        return None
    return clean(message) or None


def generic(status: int | None) -> str:
    """What a client reads when the upstream's own words are not passed on."""
    if status is None:
        return "the upstream failed"
    try:
        return f"the upstream answered {status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"the upstream answered {status}"
