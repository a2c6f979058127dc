"""Anthropic Messages API request bodies (`POST /v1/messages`), as the `anthropic` SDK sends
them. Unknown fields are ignored, as in `api/protocol.py`; an unknown content block type is a
400, as Anthropic answers it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from firsttoken.api.protocol import SyntheticKnobs

__all__ = [
    "Base64Source",
    "CountTokensRequest",
    "DocumentBlock",
    "ImageBlock",
    "MessageParam",
    "MessagesRequest",
    "TextBlock",
    "TextSource",
    "ThinkingBlock",
    "ToolChoice",
    "ToolResultBlock",
    "ToolSpec",
    "ToolUseBlock",
    "UrlSource",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    # A prompt-cache marker: kept on its way to an Anthropic target (priced as cache there).
    cache_control: dict[str, Any] | None = None


class Base64Source(_Body):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(_Body):
    type: Literal["url"]
    url: str


class ImageBlock(_Body):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]


class TextSource(_Body):
    type: Literal["text"]
    media_type: str = "text/plain"
    data: str


class DocumentBlock(_Body):
    """A PDF (base64 or by URL) or a plain-text document. Kept whole on its way to an
    Anthropic target (citations, title, context, cache_control as sent)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["document"]
    source: Annotated[Base64Source | UrlSource | TextSource, Field(discriminator="type")]
    title: str | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = (
        None
    )
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextBlock))


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolSpec(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('a tool_choice of type "tool" needs the tool\'s name')
        return self


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None


class MessagesRequest(_Body):
    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    # Message threads (the SDK's tool runner sends them by default): refused, not ignored,
    # since a `continue` carries only the new turn's messages
    # (`formats.anthropic.THREAD_UNSUPPORTED`).
    thread: Any = None
    synthetic: SyntheticKnobs | None = None  # firsttoken's own, sent with `extra_body`

    def system_text(self) -> str:
        if self.system is None:
            return ""
        if isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens` (the answer's
    length is no input)."""

    max_tokens: Annotated[int, Field(ge=1)] = 1
