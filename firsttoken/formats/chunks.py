"""An OpenAI-style streamed chunk (Chat Completions' `chat.completion.chunk`, legacy
completions' `text_completion`) read back as the delta it carries: the one decoder for what
an upstream sends the relay (`engines/relay.py`) and for a stream's own events that another
instance replays when it takes the stream over (`formats/rebuild.py`).

Whatever a chunk carries is kept: text, reasoning (`reasoning_content`, or vLLM's older
`reasoning`), refusal, tool-call fragments, the choice's `logprobs`, and any other field of
its delta as `extra`, all in one delta, as `ChatRenderer.part` writes them into one chunk.
On the relay this runs once per token: the usual chunk (text alone) is checked at once.
"""

from __future__ import annotations

from typing import Any

import orjson

from firsttoken.delta import Delta, ToolCallDelta

__all__ = ["BadChunk", "chunk_delta"]

# Delta fields with a place in `Delta`; any other field is passed through as it came.
_KNOWN = frozenset(("role", "content", "reasoning_content", "reasoning", "tool_calls", "refusal"))
_PLAIN = frozenset(("content", "role"))  # a chunk of answer text alone


class BadChunk(ValueError):
    """A chunk of the wrong shape (its message says which, with the chunk's start)."""


def chunk_delta(obj: dict[str, Any], chat: bool) -> tuple[Delta | None, str | None]:
    """One streamed chunk (`chat`: a Chat Completions one, else a legacy completion's) as a
    delta (None when it carries nothing: the role chunk, a usage-only chunk, a bare finish)
    and its finish reason; `BadChunk` for one of the wrong shape."""
    choices = obj.get("choices")
    if not choices:
        return None, None
    try:
        choice = choices[0]
        finish = choice.get("finish_reason")
        logprobs = choice.get("logprobs")
        if not chat:
            text = choice.get("text")
            _check(obj, isinstance(text, str | None) and isinstance(finish, str | None))
            return (Delta(text, logprobs=logprobs) if text else None), finish
        fields = choice.get("delta") or {}
        text = fields.get("content")
        if (
            type(text) is str
            and not logprobs
            and fields.keys() <= _PLAIN
            and (finish is None or type(finish) is str)
        ):
            return (Delta(text) if text else None), finish  # the usual chunk, checked at once
        reasoning = fields.get("reasoning_content") or fields.get("reasoning")
        refusal = fields.get("refusal")
        _check(
            obj,
            isinstance(fields, dict)
            and all(isinstance(v, str | None) for v in (text, reasoning, refusal, finish)),
        )
        calls = tuple(_tool_call(obj, c) for c in fields.get("tool_calls") or ())
        extra = {k: v for k, v in fields.items() if k not in _KNOWN and v is not None}
    except (AttributeError, IndexError, KeyError, TypeError):
        raise _wrong_shape(obj) from None
    if not (text or reasoning or refusal or calls or extra or logprobs):
        return None, finish
    delta = Delta(text or "", None, reasoning or "", calls, refusal or "", logprobs, extra or None)
    return delta, finish


def _tool_call(obj: dict[str, Any], call: Any) -> ToolCallDelta:
    function = call.get("function") or {}
    index, arguments = call.get("index", 0), function.get("arguments") or ""
    _check(obj, isinstance(index, int) and isinstance(arguments, str))
    return ToolCallDelta(index, call.get("id"), function.get("name"), arguments)


def _check(obj: dict[str, Any], ok: bool) -> None:
    if not ok:
        raise _wrong_shape(obj)


def _wrong_shape(obj: dict[str, Any]) -> BadChunk:
    return BadChunk(f"a chunk of the wrong shape: {orjson.dumps(obj)[:200]!r}")
