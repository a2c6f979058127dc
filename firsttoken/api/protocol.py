"""Wire-format models: request bodies as clients send them (OpenAI and native)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from firsttoken.engines.synthetic import MAX_KNOB_TOKENS

__all__ = [
    "MAX_STOP",
    "ChatCompletionRequest",
    "ChatMessage",
    "Coalesce",
    "CoalesceOptions",
    "CompletionRequest",
    "NativeStreamRequest",
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


class _ContentPart(_Body):
    # text, image_url, input_audio, file...: engines that read text take the text parts;
    # a relay forwards every part as it came.
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, as they came
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


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


class _OpenAIGeneration(_Generation):
    # The body as the client sent it (what a relay forwards) stays beside the model
    # (`Gateway.accept_raw`): a wrap validator and a private attribute to keep it here cost
    # ~4 µs a request.
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1

    def token_limit(self) -> int | None:
        # Newer SDKs send only max_completion_tokens; when both come, the smaller wins.
        limits = [x for x in (self.max_tokens, self.max_completion_tokens) if x is not None]
        return min(limits) if limits else None


class ChatCompletionRequest(_OpenAIGeneration):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # vLLM's way to continue an answer: the final assistant message is its start, and the
    # engine writes the rest (no new assistant turn is opened).
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _continues(self) -> ChatCompletionRequest:
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise ValueError(
                "continue_final_message needs add_generation_prompt: false (as vLLM asks)"
            )
        if self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    def continuation(self) -> str | None:
        """The text the answer continues, when it continues one."""
        return self.messages[-1].text() if self.continue_final_message else None

    def prompt(self) -> str:
        """The conversation as `role: text` lines; a message being continued is not in it
        (the answer to the rest is what continues it)."""
        messages = self.messages[:-1] if self.continue_final_message else self.messages
        return "\n".join(f"{m.role}: {m.text()}" for m in messages)


class CompletionRequest(_OpenAIGeneration):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        return value if isinstance(value, str) else value[0]


class NativeStreamRequest(_Generation):
    prompt: str
    coalesce: Coalesce = None
    meta: bool = True
    binary: bool = False  # `event: token` with base64 UTF-8 bytes instead of JSON text
