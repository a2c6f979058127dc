"""What an answer used, in tokens: counted by its stream, or by its engine at the finish.

The stream counts what it framed (every text token and structured part); an engine that
counts for itself (an upstream's tokenizer, its cached prompt tokens) reports that at the
finish, and its count wins where it is a count. A stream taken over from another instance
adds what the instances before it generated (`with_carried`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from firsttoken.pricing import Usage

__all__ = ["Usage", "reported", "usage_of", "with_carried"]


def reported(prompt: int, completion: int, reasoning: int) -> dict[str, Any]:
    """The usage a stream's closing events report when its engine counted none."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def usage_of(
    counted: Mapping[str, Any] | None, prompt: int, completion: int, reasoning: int
) -> Usage:
    """The engine's own count (`counted`) where it gave one, else the stream's."""
    if counted is None:
        return Usage(prompt, completion, reasoning)
    return Usage(
        _count(counted.get("prompt_tokens"), prompt),
        _count(counted.get("completion_tokens"), completion),
        _count(_detail(counted, "completion_tokens_details", "reasoning_tokens"), reasoning),
        _count(_detail(counted, "prompt_tokens_details", "cached_tokens"), 0),
        _count(_detail(counted, "prompt_tokens_details", "cache_write_tokens"), 0),
    )


def with_carried(counted: Mapping[str, Any], carried: Usage) -> dict[str, Any]:
    """A taken-over stream's engine usage as the whole answer's: the original prompt once
    (the continuation's prompt held the text sent before), and every token before it."""
    out = dict(counted)
    out["prompt_tokens"] = carried.prompt
    out["completion_tokens"] = counted["completion_tokens"] + carried.completion
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    reasoning = _count(_detail(counted, "completion_tokens_details", "reasoning_tokens"), 0)
    if reasoning or carried.reasoning:
        details = out.get("completion_tokens_details")
        out["completion_tokens_details"] = {
            **(details if isinstance(details, Mapping) else {}),
            "reasoning_tokens": reasoning + carried.reasoning,
        }
    return out


def _count(value: object, otherwise: int) -> int:
    """A token count an engine reported, if it is one."""
    return (
        value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else otherwise
    )


def _detail(usage: Mapping[str, Any], details: str, name: str) -> object:
    part = usage.get(details)
    return part.get(name) if isinstance(part, Mapping) else None
