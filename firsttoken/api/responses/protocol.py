"""Wire-format models of the OpenAI Responses API request (`POST /v1/responses`).

Unknown fields are ignored, as in `api/protocol.py`, so newer SDKs keep working; what this
server cannot honour (conversation objects, hosted tools, item references) is refused with a
clear 400 before the first byte, never silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from firsttoken.api.protocol import Coalesce, SyntheticKnobs, _Body
from firsttoken.formats.errors import echo

__all__ = [
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "InputFile",
    "InputImage",
    "InputText",
    "MessageItem",
    "OutputText",
    "ReasoningItem",
    "RefusalPart",
    "ResponsesRequest",
    "ResponsesStreamOptions",
]


class InputText(_Body):
    type: Literal["input_text"]
    text: str


class InputImage(_Body):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None

    @model_validator(mode="after")
    def _has_url(self) -> InputImage:
        if self.image_url is None:
            raise ValueError(
                "input_image needs image_url (a URL or a data: URL): file_id names a stored "
                "file, and this server keeps none"
            )
        return self


class InputFile(_Body):
    type: Literal["input_file"]
    file_data: str | None = None
    file_id: str | None = None
    file_url: str | None = None
    filename: str | None = None

    @model_validator(mode="after")
    def _has_data(self) -> InputFile:
        if self.file_url is not None or (self.file_data is None and self.file_id is None):
            raise ValueError("input_file needs file_data or file_id (file_url is not supported)")
        return self


class OutputText(_Body):
    """An assistant message's text, as a previous response returned it."""

    type: Literal["output_text"]
    text: str


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: str


_PARTS = ("input_text", "input_image", "input_file", "output_text", "refusal")


def _known_part(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(value, dict) and kind not in _PARTS:
        raise ValueError(
            f"unsupported content part type {echo(kind)}: this server takes {', '.join(_PARTS)}"
        )
    return value


ContentPart = Annotated[
    InputText | InputImage | InputFile | OutputText | RefusalPart,
    Field(discriminator="type"),
    BeforeValidator(_known_part),
]


class MessageItem(_Body):
    """A message: `{"role", "content"}` (the easy form, no `type`) or `type: "message"`."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Body):
    """A call the model made, sent back so the next turn sees it."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Body):
    """The caller's result for a function call (`call_id` names the call)."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[ContentPart]

    @field_validator("output")
    @classmethod
    def _text_only(cls, value: str | list[Any]) -> str | list[Any]:
        if not isinstance(value, str):
            for part in value:
                if not isinstance(part, InputText | OutputText):
                    raise ValueError(
                        f"a function call's output takes text parts only, not {echo(part.type)}"
                    )
        return value


class ReasoningItem(_Body):
    """A previous response's reasoning, sent back with its output: accepted and not
    forwarded (Chat Completions has no input field for it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type") or "message"
    return getattr(value, "type", "message")


def _known_item(value: Any) -> Any:
    if isinstance(value, dict):
        kind = value.get("type") or "message"
        if kind == "item_reference":
            raise ValueError(
                "item_reference needs stored responses, and this server keeps none: "
                "send the items themselves"
            )
        if kind not in _ITEMS:
            raise ValueError(
                f"unsupported input item type {echo(kind)}: this server takes {', '.join(_ITEMS)}"
            )
    return value


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
    BeforeValidator(_known_item),
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _function_tool(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "function":
        raise ValueError(
            f"unsupported tool type {echo(value.get('type'))}: "
            "this server takes function tools only"
        )
    return value


Tool = Annotated[FunctionTool, BeforeValidator(_function_tool)]


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict):
        kind = value.get("type")
        if kind == "function" and isinstance(value.get("name"), str):
            return value
        if kind == "allowed_tools" and value.get("mode") in ("auto", "required"):
            tools = value.get("tools")
            if isinstance(tools, list) and all(
                isinstance(t, dict)
                and t.get("type") == "function"
                and isinstance(t.get("name"), str)
                for t in tools
            ):
                return value
    raise ValueError(
        'must be "auto", "none", "required", {"type": "function", "name": ...} or '
        '{"type": "allowed_tools", "mode": ..., "tools": [function tools]}'
    )


ToolChoice = Annotated[str | dict[str, Any] | None, BeforeValidator(_tool_choice)]


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: str | None = None
    summary: str | None = None


class ResponsesStreamOptions(_Body):
    include_obfuscation: bool | None = None  # accepted; no obfuscation padding is sent
    coalesce: Coalesce = None  # firsttoken's chunking, as on Chat Completions


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    user: str | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" asks for logprobs
    service_tier: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    # firsttoken's extras (the SDK sends them with extra_body).
    seed: int | None = None
    synthetic: SyntheticKnobs | None = None

    # What `previous_response_id` prepended (`conversation.prepare`): the stored items, and
    # where the request's own items start in `input`.
    _earlier: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _own: int = PrivateAttr(0)

    @field_validator("conversation")
    @classmethod
    def _no_conversations(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "conversation objects are not kept here: continue a stored response with "
                "previous_response_id, or send the whole conversation in `input`"
            )
        return value

    @field_validator("background")
    @classmethod
    def _kept_if_background(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        # `store` is declared before `background`: validated already.
        if value and info.data.get("store") is False:
            raise ValueError(
                "background responses are read back by id (GET /v1/responses/{id}): "
                "they need store true (or unset)"
            )
        return value
