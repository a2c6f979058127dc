"""The OpenAI Responses API on the wire: the typed event stream and the response object.

A Responses stream is a sequence of typed events (`response.created`, output items opened
and closed around their deltas, `response.completed` with the whole response), each with a
`sequence_number` that counts from 0. The response object at the end repeats every output
item, so the renderer keeps the text it has sent: every token goes through `token`.

Output items, in the order the engine produces them:
- reasoning → a `reasoning` item with one `reasoning_text` content part
  (`response.reasoning_text.delta` / `.done`: raw reasoning, as open-weight models stream it;
  no summary is made up);
- answer text → a `message` item with an `output_text` part (a refusal is a `refusal` part);
- a tool-call fragment → a `function_call` item (`response.function_call_arguments.delta`).

The same item builders make the non-streaming answer from a `ChatAnswer`, with the same ids,
so a streamed response and a whole one look alike.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson

from firsttoken.delta import Delta, ToolCallDelta
from firsttoken.formats.assemble import ChatAnswer
from firsttoken.formats.render import Events

__all__ = [
    "ResponsesRenderer",
    "function_call_item",
    "message_item",
    "reasoning_item",
    "response_from_answer",
    "response_object",
    "response_usage",
]

_dumps = orjson.dumps
_NONE: Events = ()

# finish_reason → (status, incomplete_details.reason)
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def item_id(prefix: str, key: str, index: int) -> str:
    """An output item's id: its kind, the response's key and its place in the output."""
    return f"{prefix}_{key}_{index}"


def output_text(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def token_logprobs(logprobs: Any) -> list[Any]:
    """A chat chunk's `logprobs` as the Responses API lists them: the same entries (`token`,
    `logprob`, `bytes`, `top_logprobs`) under no `content` key."""
    content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
    return list(content) if isinstance(content, list) else []


def message_item(
    id_: str, parts: list[dict[str, Any]], status: str = "completed"
) -> dict[str, Any]:
    return {"id": id_, "type": "message", "status": status, "role": "assistant", "content": parts}


def reasoning_item(id_: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": id_, "type": "reasoning", "status": status, "summary": [], "content": content}


def function_call_item(
    id_: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": id_,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def response_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """Chat Completions usage → Responses usage."""
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    details = usage.get("completion_tokens_details") or {}
    prompt_details = usage.get("prompt_tokens_details") or {}
    cached = prompt_details.get("cached_tokens") or 0
    written = prompt_details.get("cache_write_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
        "total_tokens": int(usage.get("total_tokens") or prompt + completion),
    }


def response_object(
    base: Mapping[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage: Mapping[str, Any] | None = None,
    *,
    finish_reason: str | None = None,
    error: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The response as of now: `base` (id, model, created_at and what the request set)
    with its status, output items, usage, and why it ended short, if it did."""
    body = dict(base)
    body["status"] = status
    body["output"] = output
    body["usage"] = None if usage is None else response_usage(usage)
    body["error"] = None if error is None else dict(error)
    body["incomplete_details"] = None
    if status == "incomplete":
        body["incomplete_details"] = {
            "reason": _INCOMPLETE.get(finish_reason or "", "max_output_tokens")
        }
    if status in ("completed", "incomplete"):
        body["completed_at"] = int(time.time())
    return body


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason in _INCOMPLETE else "completed"


def response_from_answer(base: Mapping[str, Any], key: str, answer: ChatAnswer) -> dict[str, Any]:
    """A whole (non-streaming) answer as a Response: reasoning, message, function calls,
    with the ids a stream of the same answer gives its items."""
    status = _status(answer.finish_reason)
    output: list[dict[str, Any]] = []
    if answer.reasoning:
        output.append(reasoning_item(item_id("rs", key, len(output)), answer.reasoning))
    if answer.content or answer.refusal:
        parts = []
        if answer.refusal:
            parts.append({"type": "refusal", "refusal": answer.refusal})
        if answer.content:
            logprobs = answer.logprobs.get("content") if answer.logprobs else None
            parts.append(output_text(answer.content, logprobs))
        output.append(message_item(item_id("msg", key, len(output)), parts))
    for call in answer.tool_calls:
        index = len(output)
        call_id = call.id or item_id("call", key, index)
        output.append(
            function_call_item(item_id("fc", key, index), call_id, call.name, call.arguments)
        )
    if status == "incomplete" and output:
        output[-1]["status"] = "incomplete"  # the item the limit cut short, as a stream says
    return response_object(base, status, output, answer.usage, finish_reason=answer.finish_reason)


class _Item:
    """An open output item: its place, its id, and what it has received so far."""

    __slots__ = ("call", "id", "index", "kind", "logprobs", "part", "parts", "texts")

    def __init__(self, kind: str, id_: str, index: int) -> None:
        self.kind = kind  # "message" | "reasoning" | "function_call"
        self.id = id_
        self.index = index
        self.parts: list[dict[str, Any]] = []  # a message's finished content parts
        self.part: str | None = None  # the open content part's type
        self.texts: list[str] = []  # the open part's text, or the call's arguments
        self.logprobs: list[Any] = []  # the open output_text part's, when the engine sent any
        self.call: ToolCallDelta | None = None  # a function call's first fragment


class ResponsesRenderer:
    """One stream's Responses events (stateful: it numbers events and keeps the output)."""

    __slots__ = ("_prefix", "base", "key", "open", "output", "seq")
    token_event = "response.output_text.delta"

    def __init__(self, base: Mapping[str, Any], key: str) -> None:
        self.base = dict(base)
        self.key = key
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items, by output_index
        self.open: _Item | None = None
        self._prefix = b""

    def spec(self) -> dict[str, Any]:
        """What another instance needs to render this stream afresh (a takeover); it
        replays the events' deltas through the new renderer to reach this one's state."""
        return {"format": "responses", "base": self.base, "key": self.key}

    # -- the Renderer protocol -------------------------------------------------------------

    def opening(self) -> Events:
        response = response_object(self.base, "in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def begin_text(self) -> Events:
        item = self.open
        if item is not None and item.kind == "message" and item.part == "output_text":
            return _NONE
        out = self._open_message()
        item = self.open
        assert item is not None
        if item.part is not None:
            out.extend(self._close_part(item))
        out.extend(self._open_part(item, "output_text"))
        self._prefix = (
            b'{"type":"response.output_text.delta","item_id":'
            + _dumps(item.id)
            + b',"output_index":%d,"content_index":%d,"delta":' % (item.index, len(item.parts))
        )
        return out

    def token(self, text: str) -> bytes:
        item = self.open
        assert item is not None and item.part == "output_text"
        item.texts.append(text)
        seq = self.seq
        self.seq = seq + 1
        return self._prefix + _dumps(text) + b',"logprobs":[],"sequence_number":%d}' % seq

    def token_template(self) -> None:
        return None  # every token goes through `token`: the closing events repeat the text

    def part(self, delta: Delta) -> Events:
        out: list[tuple[str | None, bytes]] = []
        if delta.reasoning:
            out.extend(self._reasoning(delta.reasoning))
        for call in delta.tool_calls:
            out.extend(self._tool_call(call))
        if delta.refusal:
            out.extend(self._refusal(delta.refusal))
        if delta.text:
            out.extend(self.begin_text())
            if delta.logprobs:
                out.append((self.token_event, self._scored(delta.text, delta.logprobs)))
            else:
                out.append((self.token_event, self.token(delta.text)))
        return out

    def _scored(self, text: str, logprobs: Any) -> bytes:
        """A token whose engine sent its logprobs (the client asked for them): `token`'s
        event with them in it, kept for the part's done events."""
        item = self.open
        assert item is not None and item.part == "output_text"
        item.texts.append(text)
        scored = token_logprobs(logprobs)
        item.logprobs.extend(scored)
        seq = self.seq
        self.seq = seq + 1
        return (
            self._prefix
            + _dumps(text)
            + b',"logprobs":%s,"sequence_number":%d}'
            % (
                _dumps(scored),
                seq,
            )
        )

    def closing(self, finish_reason: str, usage: dict[str, Any]) -> Events:
        status = _status(finish_reason)
        out = self._close(status)  # the item a limit cut short is incomplete too
        response = response_object(
            self.base, status, self.output, usage, finish_reason=finish_reason
        )
        out.append(self._event(f"response.{status}", response=response))
        return out

    def error(self, code: str, message: str, type_: str = "server_error") -> Events:
        """`response.failed` (what arrived, with the error), then `event: error`: its
        top-level `error` object makes the SDK raise, after the text it has yielded."""
        output = list(self.output)
        item = self.open
        if item is not None:
            output.append(self._item(item, "incomplete"))
        status = "cancelled" if type_ == "cancelled" else "failed"
        error = {"code": code, "message": message}
        response = response_object(self.base, status, output, error=error)
        return [
            self._event("response.failed", response=response),
            self._event(
                "error",
                code=code,
                message=message,
                param=None,
                error={"code": code, "message": message, "type": type_, "param": None},
            ),
        ]

    # -- items -----------------------------------------------------------------------------

    def _event(self, type_: str, **fields: Any) -> tuple[str, bytes]:
        seq = self.seq
        self.seq = seq + 1
        return type_, _dumps({"type": type_, **fields, "sequence_number": seq})

    def _open_item(self, kind: str, prefix: str) -> _Item:
        index = len(self.output)
        item = _Item(kind, item_id(prefix, self.key, index), index)
        self.open = item
        return item

    def _open_message(self) -> list[tuple[str | None, bytes]]:
        if self.open is not None and self.open.kind == "message":
            return []
        out = self._close("completed")
        item = self._open_item("message", "msg")
        out.append(self._added(item))
        return out

    def _added(self, item: _Item) -> tuple[str, bytes]:
        return self._event(
            "response.output_item.added",
            output_index=item.index,
            item=self._item(item, "in_progress", added=True),
        )

    def _reasoning(self, text: str) -> list[tuple[str | None, bytes]]:
        out: list[tuple[str | None, bytes]] = []
        item = self.open
        if item is None or item.kind != "reasoning":
            out = self._close("completed")
            item = self._open_item("reasoning", "rs")
            out.append(self._added(item))
            item.part = "reasoning_text"
            out.append(self._part_event("response.content_part.added", item, ""))
        item.texts.append(text)
        out.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                delta=text,
            )
        )
        return out

    def _tool_call(self, call: ToolCallDelta) -> list[tuple[str | None, bytes]]:
        out: list[tuple[str | None, bytes]] = []
        item = self.open
        known = item.call if item is not None and item.kind == "function_call" else None
        if (
            item is None
            or known is None
            or known.index != call.index
            or (call.id is not None and known.id is not None and call.id != known.id)
        ):
            # A new call. (Some upstreams repeat the id on every fragment: same id, same call.)
            out = self._close("completed")
            item = self._open_item("function_call", "fc")
            item.call = call
            out.append(self._added(item))
        elif known.name is None and call.name is not None:  # a name that came late
            item.call = ToolCallDelta(known.index, known.id or call.id, call.name)
        if call.arguments:
            item.texts.append(call.arguments)
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.index,
                    delta=call.arguments,
                )
            )
        return out

    def _refusal(self, text: str) -> list[tuple[str | None, bytes]]:
        out = self._open_message()
        item = self.open
        assert item is not None
        if item.part != "refusal":
            if item.part is not None:
                out.extend(self._close_part(item))
            out.extend(self._open_part(item, "refusal"))
        item.texts.append(text)
        out.append(
            self._event(
                "response.refusal.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=len(item.parts),
                delta=text,
            )
        )
        return out

    def _open_part(self, item: _Item, kind: str) -> list[tuple[str | None, bytes]]:
        item.part = kind
        item.texts = []
        return [self._part_event("response.content_part.added", item, "")]

    def _part(self, item: _Item, text: str) -> dict[str, Any]:
        if item.part == "output_text":
            return output_text(text, item.logprobs)
        if item.part == "refusal":
            return {"type": "refusal", "refusal": text}
        return {"type": "reasoning_text", "text": text}

    def _part_event(self, type_: str, item: _Item, text: str) -> tuple[str, bytes]:
        index = 0 if item.kind == "reasoning" else len(item.parts)
        return self._event(
            type_,
            item_id=item.id,
            output_index=item.index,
            content_index=index,
            part=self._part(item, text),
        )

    def _close_part(self, item: _Item) -> list[tuple[str | None, bytes]]:
        """The open content part's done events (a message's: it joins `item.parts`)."""
        text = "".join(item.texts)
        index = 0 if item.kind == "reasoning" else len(item.parts)
        common = {"item_id": item.id, "output_index": item.index, "content_index": index}
        if item.part == "output_text":
            done = self._event(
                "response.output_text.done", **common, text=text, logprobs=item.logprobs
            )
        elif item.part == "refusal":
            done = self._event("response.refusal.done", **common, refusal=text)
        else:
            done = self._event("response.reasoning_text.done", **common, text=text)
        out: list[tuple[str | None, bytes]] = [done]
        out.append(self._part_event("response.content_part.done", item, text))
        if item.kind == "message":
            item.parts.append(self._part(item, text))
            item.part = None
            item.texts = []
            item.logprobs = []
        return out

    def _close(self, status: str) -> list[tuple[str | None, bytes]]:
        """Close the open item, if any: its done events, and it joins the output."""
        item = self.open
        if item is None:
            return []
        out: list[tuple[str | None, bytes]] = []
        if item.kind == "function_call":
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=item.index,
                    arguments="".join(item.texts),
                )
            )
        elif item.part is not None:
            out.extend(self._close_part(item))
        done = self._item(item, status)
        out.append(self._event("response.output_item.done", output_index=item.index, item=done))
        self.output.append(done)
        self.open = None
        return out

    def _item(self, item: _Item, status: str, added: bool = False) -> dict[str, Any]:
        """The item as it stands: empty when just added, whole when done."""
        if item.kind == "function_call":
            call = item.call
            assert call is not None
            call_id = call.id or item_id("call", self.key, item.index)
            arguments = "" if added else "".join(item.texts)
            return function_call_item(item.id, call_id, call.name or "", arguments, status)
        if item.kind == "reasoning":
            return reasoning_item(item.id, None if added else "".join(item.texts), status)
        parts = list(item.parts)
        if item.part is not None and not added:  # an item cut short: its open part too
            parts.append(self._part(item, "".join(item.texts)))
        return message_item(item.id, parts, status)
