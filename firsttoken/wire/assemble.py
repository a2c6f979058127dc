"""Streamed Chat Completions chunks (or legacy Completions chunks) folded back into one
answer: what a non-streaming request returns, in any API's shape (every API collects the same
chat-format log)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatAnswer", "assemble_chat"]


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


def assemble_chat(chunks: Iterable[Mapping[str, Any]]) -> ChatAnswer:
    answer = ChatAnswer()
    content: list[str] = []
    reasoning: list[str] = []
    refusal: list[str] = []
    calls: dict[int, ToolCall] = {}
    arguments: dict[int, list[str]] = {}
    for chunk in chunks:
        if chunk.get("usage"):
            answer.usage = dict(chunk["usage"])
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            piece = delta.get("content") if "delta" in choice else choice.get("text")
            if piece:
                content.append(piece)
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if thought:
                reasoning.append(thought)
            if delta.get("refusal"):
                refusal.append(delta["refusal"])
            for fragment in delta.get("tool_calls") or ():
                index = fragment.get("index", 0)
                call = calls.setdefault(index, ToolCall())
                function = fragment.get("function") or {}
                call.id = fragment.get("id") or call.id
                call.name = function.get("name") or call.name
                arguments.setdefault(index, []).append(function.get("arguments") or "")
            answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
    answer.content = "".join(content)
    answer.reasoning = "".join(reasoning)
    answer.refusal = "".join(refusal)
    for index in sorted(calls):
        calls[index].arguments = "".join(arguments[index])
        answer.tool_calls.append(calls[index])
    return answer
