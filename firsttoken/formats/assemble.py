"""Streamed Chat Completions chunks (or legacy Completions chunks) folded back into one
answer: what a non-streaming request returns, in any API's shape (every API collects the same
chat-format log)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatAnswer", "ChatFold", "assemble_chat"]


@dataclass(slots=True)
class ToolCall:
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class ChatAnswer:
    content: str = ""
    reasoning: str = ""
    refusal: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    usage: dict[str, Any] = field(default_factory=dict)
    # The chunks' `logprobs`, their lists joined in order (`content`, `refusal`; a
    # completion's `tokens`, `token_logprobs`, ...); None when no chunk had any.
    logprobs: dict[str, list[Any]] | None = None

    def message(self) -> dict[str, Any]:
        """The Chat Completions `choices[0].message`."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.refusal:
            message["refusal"] = self.refusal
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        elif message["content"] is None:
            message["content"] = ""
        return message


class ChatFold:
    """Chunks folded into one answer as they arrive: nothing of a chunk is kept but its
    pieces of text, and `size` counts them (UTF-8 bytes) for a whole answer's byte cap."""

    __slots__ = (
        "_arguments",
        "_calls",
        "_content",
        "_logprobs",
        "_reasoning",
        "_refusal",
        "answer",
        "size",
    )

    def __init__(self) -> None:
        self.answer = ChatAnswer()
        self.size = 0
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._refusal: list[str] = []
        self._calls: dict[int, ToolCall] = {}
        self._arguments: dict[int, list[str]] = {}
        self._logprobs: dict[str, list[Any]] | None = None

    def add(self, chunk: Mapping[str, Any]) -> None:
        answer = self.answer
        if chunk.get("usage"):
            answer.usage = dict(chunk["usage"])
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            piece = delta.get("content") if "delta" in choice else choice.get("text")
            if piece:
                self._keep(self._content, piece)
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if thought:
                self._keep(self._reasoning, thought)
            if delta.get("refusal"):
                self._keep(self._refusal, delta["refusal"])
            for fragment in delta.get("tool_calls") or ():
                index = fragment.get("index", 0)
                call = self._calls.setdefault(index, ToolCall())
                function = fragment.get("function") or {}
                call.id = fragment.get("id") or call.id
                call.name = function.get("name") or call.name
                self._keep(self._arguments.setdefault(index, []), function.get("arguments") or "")
            logprobs = choice.get("logprobs")
            if logprobs:
                self._keep_logprobs(logprobs)
            answer.finish_reason = choice.get("finish_reason") or answer.finish_reason

    def _keep_logprobs(self, logprobs: Mapping[str, Any]) -> None:
        kept = self._logprobs
        if kept is None:
            kept = self._logprobs = {}
        for name, values in logprobs.items():
            if isinstance(values, list):
                kept.setdefault(name, []).extend(values)

    def _keep(self, pieces: list[str], piece: str) -> None:
        pieces.append(piece)
        # Characters are bytes for ASCII; only text with more pays for the encode.
        self.size += len(piece) if piece.isascii() else len(piece.encode())

    def done(self) -> ChatAnswer:
        answer = self.answer
        answer.content = "".join(self._content)
        answer.reasoning = "".join(self._reasoning)
        answer.refusal = "".join(self._refusal)
        answer.logprobs = self._logprobs
        answer.tool_calls = [
            ToolCall(call.id, call.name, "".join(self._arguments.get(index, ())))
            for index, call in sorted(self._calls.items())
        ]
        return answer


def assemble_chat(chunks: Iterable[Mapping[str, Any]]) -> ChatAnswer:
    fold = ChatFold()
    for chunk in chunks:
        fold.add(chunk)
    return fold.done()
