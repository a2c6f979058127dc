"""The splice: what a client was sent of an answer, whether another target may continue it,
and the request that asks it to.

The continuation is the conversation plus one assistant message holding exactly the text
already sent. Each target kind is asked its own way (vLLM/SGLang: `continue_final_message`;
Anthropic: an assistant prefill; a completion: its prompt grown by the text, with
`continue_final_text` naming it; our own engines natively), and the engines translate the one
shape built here. An answer is never spliced inside a tool call or an open reasoning block:
a target cannot be asked to finish someone else's half-written JSON or thought.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from firsttoken.generation import Delta, GenerationRequest

__all__ = ["Transcript", "continuation", "spliced_usage"]


class Transcript:
    """What the client has been sent of one answer, over every leg so far."""

    __slots__ = ("_parts", "last", "text_tokens", "tokens", "tool_calls")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.tokens = 0  # every delta sent, reasoning included (what max_tokens counts)
        self.text_tokens = 0  # answer-text deltas: the continuation's prefix
        self.last: str | None = None  # "text" | "reasoning" | "tool" | "refusal"
        self.tool_calls = False

    def add(self, delta: Delta) -> None:
        if delta.meta is not None or not (delta.text or delta.structured):
            return  # a bare finish, a meta event: nothing the client reads as a token
        self.tokens += 1
        if delta.tool_calls:
            self.tool_calls = True
            self.last = "tool"
        elif delta.refusal:
            self.last = "refusal"
        elif delta.text:
            self._parts.append(delta.text)
            self.text_tokens += 1
            self.last = "text"
        elif delta.reasoning:
            self.last = "reasoning"

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def why_not(self) -> str | None:
        """Why this answer cannot be continued elsewhere now; None if it can."""
        if self.tool_calls:
            return "the answer holds a tool call"
        if self.last == "reasoning":
            return "the answer was cut inside its reasoning"
        if self.last == "refusal":
            return "the answer is a refusal"
        if not self.text_tokens:
            return "nothing of the answer's text was sent"
        return None


def continuation(request: GenerationRequest, transcript: Transcript) -> GenerationRequest | None:
    """The request that continues `request` after what `transcript` holds; None when its
    token limit is already spent (the answer is complete at `length`)."""
    text = transcript.text
    limit = request.max_tokens
    remaining = None if limit is None else limit - transcript.tokens
    if remaining is not None and remaining <= 0:
        return None
    options = dict(request.options)
    body: dict[str, Any] | None = dict(request.body) if request.body is not None else None
    messages = request.messages
    # A client's own prefill (continue_final_message, an Anthropic prefill,
    # continue_final_text) is the answer's start: what continues is it plus what was sent.
    prefill = request.options.get("continuation")
    sent = text
    if isinstance(prefill, str):
        text = prefill + text
    if messages is not None or (body is not None and "messages" in body):
        assistant = {"role": "assistant", "content": text}
        if messages is not None:
            messages = (*_unless_prefill(messages, prefill), assistant)
        if body is not None:
            listed = list(body.get("messages") or ())
            body["messages"] = [*_unless_prefill(listed, prefill), assistant]
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        prompt = request.prompt
    else:
        # A plain completion continues by itself: a relay's prompt grows by what was sent
        # (the body's here, the bare prompt's in the relay), and `continue_final_text` says
        # where the seam is, for an upstream whose answer is a function of the prompt (a
        # firsttoken server's synthetic engine); our own engines keep the prompt and read
        # `options["continuation"]`, as for a chat.
        prompt = request.prompt
        if body is not None and isinstance(body.get("prompt"), str):
            body["prompt"] = body["prompt"] + sent
            body["continue_final_text"] = text
    options["continuation"] = text
    if body is not None and remaining is not None:
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(key), int):
                body[key] = max(1, body[key] - transcript.tokens)
    return replace(
        request,
        prompt=prompt,
        max_tokens=remaining,
        messages=messages,
        body=body,
        options=options,
    )


def _unless_prefill(messages: Sequence[Any], prefill: object) -> Sequence[Any]:
    """The messages less a final assistant one that is the client's prefill."""
    last = messages[-1] if messages else None
    if isinstance(prefill, str) and isinstance(last, Mapping) and last.get("role") == "assistant":
        return messages[:-1]
    return messages


def spliced_usage(
    usage: Mapping[str, Any] | None, before_tokens: int, before_text_tokens: int
) -> dict[str, Any] | None:
    """The last leg's usage as the whole answer's: its prompt held the original prompt plus
    the prefix (counted once, as the original prompt), and every token sent before it is the
    answer's too. None when the leg gave no usage (the stream then counts its own)."""
    if not usage:
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    out = dict(usage)
    out["prompt_tokens"] = max(0, prompt - before_text_tokens)
    out["completion_tokens"] = completion + before_tokens
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out
