"""What every format's request models share: the synthetic engine's knobs, chunking options,
stop strings and the generation fields OpenAI and native bodies have in common."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
)

from firsttoken.engines.synthetic import MAX_KNOB_TOKENS

__all__ = [
    "MAX_STOP",
    "Coalesce",
    "CoalesceOptions",
    "Stop",
    "StreamOptions",
    "SyntheticKnobs",
    "SyntheticToolCall",
]


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do, so newer SDKs keep working.
    model_config = ConfigDict(extra="ignore")


class SyntheticToolCall(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    arguments: dict[str, Any] = Field(default_factory=dict)


class SyntheticKnobs(_Body):
    ttft_ms: Annotated[float, Field(ge=0, le=600_000)] | None = None
    itl_ms: Annotated[float, Field(ge=0, le=60_000)] | None = None
    fail_after: Annotated[int, Field(ge=0)] | None = None
    error_code: Annotated[str, Field(pattern=r"^[a-z0-9_]{1,64}$")] | None = None
    answer_tokens: Annotated[int, Field(ge=0, le=MAX_KNOB_TOKENS)] | None = None
    reasoning_tokens: Annotated[int, Field(ge=0, le=MAX_KNOB_TOKENS)] | None = None
    tool_call: SyntheticToolCall | None = None
    style: Literal["prose", "markdown", "hostile"] | None = None
    continue_any: bool | None = None  # continue any text, not only its own answer's start
    prefix_cache: bool | None = None  # a continuation of a conversation prefilled is fast


class CoalesceOptions(_Body):
    mode: Literal["off", "boundary"] = "boundary"
    max_wait_ms: Annotated[float, Field(ge=0, le=10_000)] | None = None
    max_bytes: Annotated[int, Field(ge=4, le=1_048_576)] | None = None


Coalesce = Literal["off", "boundary"] | CoalesceOptions | None


class StreamOptions(_Body):
    include_usage: bool = False
    coalesce: Coalesce = None
    meta: bool = False  # opt-in: SDKs would parse named events as chunks
    timestamps: bool = False  # `: t=<send time>` comments before each event


MAX_STOP = 4  # as OpenAI allows


def _stop(value: Any) -> Any:
    # One check with one message: a union would report "stop.str: Input should be a valid
    # string" for a list that is merely too long.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        if len(value) <= MAX_STOP:
            return value
        raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(value)}")
    raise ValueError(f"must be a string or a list of up to {MAX_STOP} strings")


Stop = Annotated[str | list[str] | None, BeforeValidator(_stop)]


class _Generation(_Body):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    seed: int | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: Stop = None
    synthetic: SyntheticKnobs | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
