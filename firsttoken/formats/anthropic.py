"""The Anthropic Messages wire format: the streamed events and the whole message object.

A stream is `message_start`, `ping`, then content blocks, each `content_block_start`, its
`content_block_delta`s and `content_block_stop`, one block open at a time (thinking, text,
tool_use), then `message_delta` (stop reason, output tokens) and `message_stop`. A failed stream
ends with `event: error`, as Anthropic's does: the SDK raises on it and keeps what it had.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import orjson

from firsttoken.delta import Delta
from firsttoken.formats.assemble import ChatAnswer
from firsttoken.formats.render import Events

__all__ = [
    "THREAD_UNSUPPORTED",
    "Block",
    "MessagesRenderer",
    "error_body",
    "error_type",
    "message_object",
    "status_error_type",
    "stop_reason",
]

_dumps = orjson.dumps
_NONE: Events = ()

# Chat Completions' finish_reason → Anthropic's stop_reason.
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}

# Anthropic's error types; firsttoken's own (server_error, cancelled...) map onto them.
_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "billing_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "timeout_error",
        "api_error",
        "overloaded_error",
    }
)
_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def stop_reason(finish_reason: str) -> str:
    return _STOP_REASONS.get(finish_reason, "end_turn")


def error_type(code: str, type_: str) -> str:
    """An error after the 200 as Anthropic types it: its own types pass, a busy or absent
    engine is `overloaded_error`, a timeout `timeout_error`, anything else `api_error`."""
    if type_ in _TYPES:
        return type_
    if "overloaded" in code or "unavailable" in code or code == "server_shutdown":
        return "overloaded_error"
    if "timeout" in code:
        return "timeout_error"
    return "api_error"


def status_error_type(status: int) -> str:
    """An error before the first byte, typed by its HTTP status."""
    return _STATUS_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


# A `thread` that continues sends only the turn's new messages, and answering those alone
# would lose the conversation (the SDK's tool runner then calls its tool until its iteration
# limit). Refused with the code on which the SDK drops `thread` and sends the whole history.
THREAD_UNSUPPORTED = "thread_unsupported_request"
# Codes the SDK reads from `error.details.error_code`: to pick an error class, or a fallback.
_DETAILED = frozenset({THREAD_UNSUPPORTED})


def error_body(
    code: str,
    message: str,
    type_: str = "api_error",
    param: str | None = None,
    request_id: str | None = None,
) -> bytes:
    """`{"type": "error", "error": {"type", "message"}}`: the HTTP body of a refusal and the
    data of a stream's `event: error`. The signature of `formats.errors.error_body`; `type_` is
    one of Anthropic's (`error_type`, `status_error_type`), and the shape has no place for
    `param`."""
    error: dict[str, Any] = {"type": type_, "message": message}
    if code in _DETAILED:
        error["details"] = {"error_code": code}
    body: dict[str, Any] = {"type": "error", "error": error}
    if request_id:
        body["request_id"] = request_id
    return _dumps(body)


class Block(StrEnum):
    """The kinds of content block a stream opens (the value is the block's `type`)."""

    TEXT = "text"
    THINKING = "thinking"
    TOOL_USE = "tool_use"


def _signature(message_id: str, index: int) -> str:
    """A thinking block's `signature`: opaque to clients, which send it back as they got it."""
    digest = hashlib.sha256(f"firsttoken\x00{message_id}\x00{index}".encode()).digest()
    return base64.b64encode(digest).decode()


class MessagesRenderer:
    """Engine output → Anthropic stream events; one per stream (it tracks the open block).

    Text is the hot path: `token_template` frames a text run's `text_delta`s with the open
    block's index, so a token costs one %-format. Reasoning and tool-call fragments come as
    parts; a change of kind closes the open block and starts the next one.
    """

    __slots__ = ("_calls", "_index", "_open", "input_tokens", "message_id", "model")

    token_event = "content_block_delta"

    def __init__(self, message_id: str, model: str, input_tokens: int = 0) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self._index = -1  # the index of the last block started
        self._open: Block | None = None  # its kind while it is open
        # tool call index → (its block's index, its id): a new id at a known index is a new call
        self._calls: dict[int, tuple[int, str | None]] = {}

    def spec(self) -> dict[str, Any]:
        """What another instance needs to render this stream afresh (a takeover); it
        replays the events' deltas through the new renderer to reach this one's state."""
        return {
            "format": "messages",
            "message_id": self.message_id,
            "model": self.model,
            "input_tokens": self.input_tokens,
        }

    # -- the stream's ends -----------------------------------------------------------------

    def opening(self) -> Events:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [
            ("message_start", _dumps({"type": "message_start", "message": message})),
            ("ping", b'{"type":"ping"}'),
        ]

    def closing(self, finish_reason: str, usage: dict[str, Any]) -> Events:
        out = self._close()
        counts: dict[str, Any] = {"output_tokens": usage.get("completion_tokens", 0)}
        if isinstance(usage.get("prompt_tokens"), int):
            counts.update(cache_counts(usage))
        delta = {"stop_reason": stop_reason(finish_reason), "stop_sequence": None}
        out.append(
            ("message_delta", _dumps({"type": "message_delta", "delta": delta, "usage": counts}))
        )
        out.append(("message_stop", b'{"type":"message_stop"}'))
        return out

    def error(self, code: str, message: str, type_: str = "server_error") -> Events:
        return [("error", error_body(code, message, error_type(code, type_)))]

    # -- text ------------------------------------------------------------------------------

    def begin_text(self) -> Events:
        if self._open is Block.TEXT:
            return _NONE
        return self._start({"type": "text", "text": ""}, Block.TEXT)

    def token_template(self) -> tuple[bytes, bytes]:
        prefix = b'{"type":"content_block_delta","index":%d,"delta":{"type":"text_delta","text":'
        return prefix % self._index, b"}}"

    def token(self, text: str) -> bytes:
        prefix, suffix = self.token_template()
        return prefix + _dumps(text) + suffix

    # -- structured parts ------------------------------------------------------------------

    def part(self, delta: Delta) -> Events:
        out: list[tuple[str | None, bytes]] = []
        if delta.reasoning:
            if self._open is not Block.THINKING:
                block: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
                out += self._start(block, Block.THINKING)
            out.append(
                self._delta(self._index, {"type": "thinking_delta", "thinking": delta.reasoning})
            )
        text = delta.refusal + delta.text  # Messages has no refusal block: it is answer text
        if text:
            out += self.begin_text()
            out.append(self._delta(self._index, {"type": "text_delta", "text": text}))
        for call in delta.tool_calls:
            known = self._calls.get(call.index)
            # Some upstreams repeat the id on every fragment: only a new one starts a block.
            if known is None or (call.id is not None and call.id != known[1]):
                block = {
                    "type": "tool_use",
                    "id": call.id or "",
                    "name": call.name or "",
                    "input": {},
                }
                out += self._start(block, Block.TOOL_USE)
                known = self._calls[call.index] = (self._index, call.id)
            if call.arguments:
                piece = {"type": "input_json_delta", "partial_json": call.arguments}
                out.append(self._delta(known[0], piece))
        return out

    # -- blocks ----------------------------------------------------------------------------

    def _start(self, block: dict[str, Any], kind: Block) -> list[tuple[str | None, bytes]]:
        out = self._close()
        self._index += 1
        self._open = kind
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        out.append(("content_block_start", _dumps(start)))
        return out

    def _close(self) -> list[tuple[str | None, bytes]]:
        if self._open is None:
            return []
        out: list[tuple[str | None, bytes]] = []
        if self._open is Block.THINKING:
            # Anthropic signs a thinking block just before it closes.
            signature = {
                "type": "signature_delta",
                "signature": _signature(self.message_id, self._index),
            }
            out.append(self._delta(self._index, signature))
        stop = b'{"type":"content_block_stop","index":%d}' % self._index
        out.append(("content_block_stop", stop))
        self._open = None
        return out

    @staticmethod
    def _delta(index: int, delta: dict[str, Any]) -> tuple[str | None, bytes]:
        body = {"type": "content_block_delta", "index": index, "delta": delta}
        return "content_block_delta", _dumps(body)


def message_object(message_id: str, model: str, answer: ChatAnswer) -> dict[str, Any]:
    """A whole answer (non-streaming) as Anthropic's message object."""
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        signature = _signature(message_id, 0)
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": signature})
    text = answer.refusal + answer.content
    if text:
        content.append({"type": "text", "text": text})
    for call in answer.tool_calls:
        content.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)}
        )
    usage = answer.usage
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(answer.finish_reason),
        "stop_sequence": None,
        "usage": {
            **cache_counts(usage),
            "output_tokens": usage.get("completion_tokens", 0),
        },
    }


def cache_counts(usage: Mapping[str, Any]) -> dict[str, int]:
    """Chat Completions' prompt count in Anthropic's terms: `input_tokens` are the prompt's
    tokens that neither came from the prompt cache nor went into it, and the cache's reads
    and writes are counted apart (shown when there are any)."""
    prompt = usage.get("prompt_tokens", 0)
    details = usage.get("prompt_tokens_details")
    read = write = 0
    if isinstance(details, Mapping):
        read = details.get("cached_tokens") or 0
        write = details.get("cache_write_tokens") or 0
    counts = {"input_tokens": max(0, prompt - read - write)}
    if read or write:
        counts["cache_creation_input_tokens"] = write
        counts["cache_read_input_tokens"] = read
    return counts


def _input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments JSON as the `input` object; what is not a JSON object is
    kept under `"arguments"` rather than lost."""
    if not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}
