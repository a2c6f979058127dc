"""What an engine produces, one step at a time: `Delta` and its tool-call fragments.

A floor of its own, below the wire: the engines make deltas, the core passes them on, and the
wire's renderers turn them into bytes, so none of those rooms imports another for them.
`firsttoken.generation` names them too, beside the rest of the engine interface.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Delta", "ToolCallDelta"]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of one tool call: the first carries `id` and `name`, the rest pieces of
    the arguments' JSON text, to be concatenated in order."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Delta:
    """One step of generation for one request; the last one carries `finish_reason`.

    Most deltas are a token of answer text. The rest are structured: reasoning text, tool-call
    fragments, a refusal, and what an upstream sent that has no field here (`extra`: passed
    through to Chat Completions clients as it came). Each delta counts as one token.
    """

    text: str = ""
    finish_reason: str | None = None
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    refusal: str = ""
    logprobs: Any = None  # the chunk's logprobs object, as the upstream sent it
    extra: Mapping[str, Any] | None = None
    usage: Mapping[str, Any] | None = None  # on the last delta: the engine's own count
    # Not a token: news about the stream for native readers' `event: meta` (a splice).
    meta: Mapping[str, Any] | None = None

    @property
    def structured(self) -> bool:
        """More than answer text: goes through `Sink.push_delta`, not the token path."""
        return bool(
            self.reasoning
            or self.tool_calls
            or self.refusal
            or self.logprobs
            or self.extra
            or self.meta
        )
