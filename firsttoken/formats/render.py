"""Renderers: engine output → the data payloads of each API's events.

The per-token payload is a precomputed prefix + the JSON-escaped token + a suffix: no dict is
built and no full document is serialised per token.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Self

import orjson

from firsttoken.delta import Delta, ToolCallDelta
from firsttoken.formats.errors import error_body

__all__ = ["ChatRenderer", "CompletionRenderer", "Events", "NativeRenderer", "chat_tool_call"]

DONE = b"[DONE]"
_dumps = orjson.dumps
Events = Sequence[tuple[str | None, bytes]]  # (event name or None, data payload)
_NONE: Events = ()


def chat_tool_call(call: ToolCallDelta) -> dict[str, Any]:
    """A tool-call fragment as Chat Completions streams it (`delta.tool_calls[i]`)."""
    function: dict[str, Any] = {"arguments": call.arguments}
    if call.name is not None:
        function = {"name": call.name, "arguments": call.arguments}
    out: dict[str, Any] = {"index": call.index}
    if call.id is not None:
        out["id"] = call.id
        out["type"] = "function"
    out["function"] = function
    return out


class _OpenAIRenderer:
    """Every chunk is the stream's head (`{"id":...,"model":...`, kept as its JSON bytes, not
    a dict and a token prefix: a waiting stream holds ~140 bytes here) and a tail: `choices`
    and, at the end, `usage`."""

    __slots__ = ("_head", "include_usage")
    object: str
    token_event: str | None = None
    _token_open: bytes  # after the head: up to a token's JSON string
    _token_close: bytes  # after the string: the chunk's end

    def __init__(self, chunk_id: str, model: str, created: int, include_usage: bool) -> None:
        head = {"id": chunk_id, "object": self.object, "created": created, "model": model}
        self._head = _dumps(head)[:-1]  # the JSON object without its closing brace
        self.include_usage = include_usage

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return self._head + b',"choices":[' + _dumps(choice) + b"]}"

    def spec(self) -> dict[str, Any]:
        """What another instance needs to render the rest of this stream (a takeover)."""
        return {"format": self.object, "head": self._head.decode(), "usage": self.include_usage}

    @classmethod
    def _from_spec(cls, spec: dict[str, Any]) -> Self:
        renderer = cls.__new__(cls)
        renderer._head = spec["head"].encode()
        renderer.include_usage = bool(spec["usage"])
        return renderer

    def token(self, text: str) -> bytes:
        return self._head + self._token_open + _dumps(text) + self._token_close

    def token_template(self) -> tuple[bytes, bytes]:
        """The bytes around a token's JSON string (the stream frames them once)."""
        return self._head + self._token_open, self._token_close

    def begin_text(self) -> Events:
        return _NONE

    def closing(self, finish_reason: str, usage: dict[str, Any]) -> Events:
        out: list[tuple[str | None, bytes]] = [(None, self._chunk(self._final(finish_reason)))]
        if self.include_usage:
            out.append((None, self._head + b',"choices":[],"usage":' + _dumps(usage) + b"}"))
        out.append((None, DONE))
        return out

    def _final(self, finish_reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def error(self, code: str, message: str, type_: str = "server_error") -> Events:
        return [("error", error_body(code, message, type_))]


class ChatRenderer(_OpenAIRenderer):
    __slots__ = ()
    object = "chat.completion.chunk"
    _token_open = b',"choices":[{"index":0,"delta":{"content":'
    _token_close = b'},"logprobs":null,"finish_reason":null}]}'

    def opening(self) -> Events:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [(None, self._chunk(choice))]

    def _final(self, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}

    def part(self, delta: Delta) -> Events:
        fields: dict[str, Any] = dict(delta.extra) if delta.extra else {}
        if delta.reasoning:
            fields["reasoning_content"] = delta.reasoning
        if delta.text:
            fields["content"] = delta.text
        if delta.refusal:
            fields["refusal"] = delta.refusal
        if delta.tool_calls:
            fields["tool_calls"] = [chat_tool_call(call) for call in delta.tool_calls]
        choice = {"index": 0, "delta": fields, "logprobs": delta.logprobs, "finish_reason": None}
        return [(None, self._chunk(choice))]


class CompletionRenderer(_OpenAIRenderer):
    __slots__ = ()
    object = "text_completion"
    _token_open = b',"choices":[{"index":0,"text":'
    _token_close = b',"logprobs":null,"finish_reason":null}]}'

    def opening(self) -> Events:
        return ()

    def _final(self, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}

    def part(self, delta: Delta) -> Events:
        # Legacy completions carry text only: reasoning and tool calls have no field here.
        if not delta.text:
            return _NONE
        choice = {"index": 0, "text": delta.text, "logprobs": delta.logprobs}
        return [(None, self._chunk({**choice, "finish_reason": None}))]


class NativeRenderer:
    """`data: {"token": ...}` per token (or, binary, `event: token` with base64 UTF-8);
    `data: {"reasoning": ...}`, `data: {"tool_call": {"index", "id", "name", "arguments"}}`
    (id and name on a call's first fragment) and `data: {"refusal": ...}` for the rest; a
    closing `event: meta` with finish and usage."""

    __slots__ = ("binary", "token_event")

    def __init__(self, binary: bool = False) -> None:
        self.binary = binary
        self.token_event = "token" if binary else None

    def opening(self) -> Events:
        return ()

    def spec(self) -> dict[str, Any]:
        return {"format": "native", "binary": self.binary}

    def token(self, text: str) -> bytes:
        if self.binary:
            return base64.b64encode(text.encode())
        return b'{"token":' + _dumps(text) + b"}"

    def token_template(self) -> tuple[bytes, bytes] | None:
        return None if self.binary else (b'{"token":', b"}")

    def begin_text(self) -> Events:
        return _NONE

    def part(self, delta: Delta) -> Events:
        out: list[tuple[str | None, bytes]] = []
        if delta.reasoning:
            out.append((None, b'{"reasoning":' + _dumps(delta.reasoning) + b"}"))
        for call in delta.tool_calls:
            fields: dict[str, Any] = {"index": call.index}
            if call.id is not None:
                fields["id"] = call.id
            if call.name is not None:
                fields["name"] = call.name
            fields["arguments"] = call.arguments
            out.append((None, _dumps({"tool_call": fields})))
        if delta.refusal:
            out.append((None, b'{"refusal":' + _dumps(delta.refusal) + b"}"))
        if delta.text:
            out.append((self.token_event, self.token(delta.text)))
        return out

    def closing(self, finish_reason: str, usage: dict[str, Any]) -> Events:
        meta = {
            "finish_reason": finish_reason,
            "tokens": usage["completion_tokens"],
            "remaining": 0,
            "usage": usage,
        }
        return [("meta", _dumps(meta)), (None, DONE)]

    def error(self, code: str, message: str, type_: str = "server_error") -> Events:
        return [("error", error_body(code, message, type_))]
