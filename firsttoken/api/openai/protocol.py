"""The OpenAI request models: Chat Completions and (legacy) Completions bodies."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from firsttoken.api.protocol import StreamOptions, _Body, _Generation

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest"]


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
    # Our way to continue a completion (what `continue_final_message` is for a chat): the
    # prompt ends with this text, the start of its own answer, and the engine writes the
    # rest. A plain completion server reads the prompt, grown by that text, and continues
    # it; the synthetic engine, whose answer is a function of the prompt, needs the seam.
    continue_final_text: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        return value if isinstance(value, str) else value[0]

    @field_validator("continue_final_text")
    @classmethod
    def _continues(cls, text: str | None, info: ValidationInfo) -> str | None:
        prompt = info.data.get("prompt")  # validated first; absent if it failed
        if text is not None and isinstance(prompt, str) and not prompt.endswith(text):
            raise ValueError("must be the end of the prompt")
        return text

    def continued(self) -> str:
        """The prompt less the text it continues: what the answer answers."""
        prompt: str = self.prompt  # type: ignore[assignment]  # validated to one string
        text = self.continue_final_text
        return prompt[: len(prompt) - len(text)] if text else prompt
