"""A renderer rebuilt on another instance (a takeover): from what travelled with the stream
(`spec()`), and brought to the state the stream's events leave it in.

Each format's events read back as the deltas they rendered (`decode`): the answer's text to
continue from, and, replayed through the new renderer (`replay`), its state: the Responses
API numbers its events and keeps every item's text for its closing events, Messages keeps its
open block. The renderers are deterministic in what they are given (ids come from the spec), so
the replay reaches the state the first instance's renderer had, and the rest of the stream
renders as it would have there.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import orjson

from firsttoken.delta import Delta, ToolCallDelta
from firsttoken.formats.anthropic import MessagesRenderer, error_type
from firsttoken.formats.anthropic import error_body as anthropic_error_body
from firsttoken.formats.chunks import chunk_delta
from firsttoken.formats.errors import error_body
from firsttoken.formats.render import (
    DONE,
    ChatRenderer,
    CompletionRenderer,
    Events,
    NativeRenderer,
)
from firsttoken.formats.responses import ResponsesRenderer

__all__ = ["Rebuilt", "decode", "error_events", "rebuild", "replay"]

Rebuilt = NativeRenderer | ChatRenderer | CompletionRenderer | ResponsesRenderer | MessagesRenderer


def rebuild(spec: dict[str, Any]) -> Rebuilt:
    """The renderer a stream had on the instance that started it, fresh (`replay` brings it
    to where the stream is)."""
    match spec.get("format"):
        case "native":
            return NativeRenderer(binary=bool(spec.get("binary")))
        case ChatRenderer.object:
            return ChatRenderer._from_spec(spec)
        case CompletionRenderer.object:
            return CompletionRenderer._from_spec(spec)
        case "responses":
            return ResponsesRenderer(spec["base"], spec["key"])
        case "messages":
            return MessagesRenderer(spec["message_id"], spec["model"], spec["input_tokens"])
    raise ValueError(f"no renderer for {spec.get('format')!r}")


def error_events(format: str, code: str, message: str) -> Events:
    """The events that end a stream of `format` (a `Stream.format`) with an error, without its
    renderer: what a reader here of another instance's stream (a mirror) is told when this
    instance lets it go. Responses' `error` event carries no `sequence_number` then (the
    renderer that counts them is the owner's)."""
    type_ = "server_error"
    match format:
        case "anthropic":
            return [("error", anthropic_error_body(code, message, error_type(code, type_)))]
        case "responses":
            error = {"code": code, "message": message, "type": type_, "param": None}
            body = {"type": "error", "code": code, "message": message, "param": None}
            return [("error", orjson.dumps({**body, "error": error}))]
    return [("error", error_body(code, message, type_))]


def replay(renderer: Rebuilt, deltas: list[Delta]) -> None:
    """Render `deltas` again, as the stream rendered them, for the state they leave (their
    events are in the log already, and are not written twice)."""
    renderer.opening()
    for delta in deltas:
        if delta.structured:
            renderer.part(delta)
        else:
            renderer.begin_text()  # once per text run: the rest answer nothing
            renderer.token(delta.text)


def decode(format: str, events: Iterator[tuple[str | None, bytes]]) -> Iterator[Delta]:
    """The deltas a stream's events carry, in order: what its renderer was given."""
    calls = 0  # formats that number tool calls by item, not by the call's index
    for event, data in events:
        if data == DONE or event in ("meta", "error"):
            continue
        delta = None
        if format == "native":
            delta = _native(event, data)
        elif format in (ChatRenderer.object, CompletionRenderer.object):
            delta = _openai(format, data)
        elif format == "responses":
            delta, calls = _responses(event, data, calls)
        elif format == "messages":
            delta, calls = _messages(event, data, calls)
        if delta is not None:
            yield delta


def _native(event: str | None, data: bytes) -> Delta | None:
    if event == "token":
        return Delta(base64.b64decode(data).decode())
    if event is not None:
        return None
    fields = orjson.loads(data)
    if "token" in fields:
        return Delta(fields["token"])
    if "reasoning" in fields:
        return Delta(reasoning=fields["reasoning"])
    if "refusal" in fields:
        return Delta(refusal=fields["refusal"])
    if "tool_call" in fields:
        call = fields["tool_call"]
        fragment = ToolCallDelta(
            call.get("index", 0), call.get("id"), call.get("name"), call.get("arguments", "")
        )
        return Delta(tool_calls=(fragment,))
    return None


def _openai(format: str, data: bytes) -> Delta | None:
    # The relay's own decoder (`formats/chunks.py`): what the renderer wrote, logprobs and all.
    delta, _ = chunk_delta(orjson.loads(data), chat=format == ChatRenderer.object)
    return delta


def _responses(event: str | None, data: bytes, calls: int) -> tuple[Delta | None, int]:
    if event == "response.output_text.delta":
        return Delta(orjson.loads(data)["delta"]), calls
    if event == "response.reasoning_text.delta":
        return Delta(reasoning=orjson.loads(data)["delta"]), calls
    if event == "response.refusal.delta":
        return Delta(refusal=orjson.loads(data)["delta"]), calls
    if event == "response.output_item.added":
        item = orjson.loads(data)["item"]
        if item.get("type") == "function_call":  # a call's first fragment: its id and name
            call = ToolCallDelta(calls, item.get("call_id"), item.get("name"), "")
            return Delta(tool_calls=(call,)), calls + 1
    if event == "response.function_call_arguments.delta":
        call = ToolCallDelta(calls - 1, None, None, orjson.loads(data)["delta"])
        return Delta(tool_calls=(call,)), calls
    return None, calls


def _messages(event: str | None, data: bytes, calls: int) -> tuple[Delta | None, int]:
    if event == "content_block_start":
        block = orjson.loads(data)["content_block"]
        if block.get("type") == "tool_use":
            call = ToolCallDelta(calls, block.get("id") or None, block.get("name") or None, "")
            return Delta(tool_calls=(call,)), calls + 1
        return None, calls
    if event != "content_block_delta":
        return None, calls
    piece = orjson.loads(data)["delta"]
    kind = piece.get("type")
    if kind == "text_delta":
        return Delta(piece["text"]), calls
    if kind == "thinking_delta":
        return Delta(reasoning=piece["thinking"]), calls
    if kind == "input_json_delta":
        call = ToolCallDelta(calls - 1, None, None, piece["partial_json"])
        return Delta(tool_calls=(call,)), calls
    return None, calls
