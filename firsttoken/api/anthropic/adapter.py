"""The Anthropic Messages API: `POST /v1/messages`, streaming and not.

A request becomes the same `GenerationRequest` an OpenAI one does: its plain-text prompt, and
its translation to a Chat Completions body (what a relay forwards to an OpenAI-compatible
upstream). A streaming answer is rendered by `formats.anthropic.MessagesRenderer`; a whole one is
collected in the chat format, assembled, and reshaped into a message object.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from firsttoken.api.anthropic.protocol import (
    Base64Source,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from firsttoken.api.bodies import APIError
from firsttoken.api.gateway import gateway, retry_headers, trace_id
from firsttoken.api.pipeline import Ending, Format, Inputs, Plan
from firsttoken.config import Settings
from firsttoken.engines import EngineError
from firsttoken.formats.anthropic import (
    THREAD_UNSUPPORTED,
    MessagesRenderer,
    error_body,
    error_type,
    message_object,
    status_error_type,
)
from firsttoken.formats.render import ChatRenderer

__all__ = [
    "MESSAGES",
    "MessagesFormat",
    "chat_body",
    "chat_messages",
    "chat_tool_choice",
    "count_tokens",
    "prompt_text",
]


class MessagesFormat(Format[MessagesRequest]):
    """`POST /v1/messages`. A whole answer is collected in the chat format (which
    `assemble_chat` folds) and reshaped into a message object."""

    name = "anthropic"
    body = MessagesRequest
    trace_header = "request-id"  # what the SDK reads as the request's id

    def grace_s(self, settings: Settings) -> float:
        # Resumed like a Chat Completions stream (Last-Event-ID on the same kind of POST).
        return settings.openai_grace_s

    def check(self, body: MessagesRequest) -> None:
        if body.thread is not None:
            raise APIError(
                400,
                THREAD_UNSUPPORTED,
                "this server keeps no conversation state: send the whole conversation in "
                "`messages`, without `thread`",
                param="thread",
            )

    def inputs(self, body: MessagesRequest, raw: dict[str, Any] | None, model: str) -> Inputs:
        """The plain-text prompt, the limits, and the Chat Completions body a relay
        forwards."""
        chat = chat_body(body, model)
        messages = chat["messages"]
        options: dict[str, Any] = {
            "synthetic": body.synthetic.model_dump() if body.synthetic else None
        }
        prefill = _prefill(body)
        if prefill is not None:  # the answer continues it; the prompt is the rest
            options["continuation"] = prefill
        if _has_documents(body):
            options["documents"] = True  # what a relay turns into its own shape
        return Inputs(
            prompt_text(messages[:-1] if prefill is not None else messages),
            body.max_tokens,
            None,  # the Messages API has no seed
            body.temperature,
            tuple(body.stop_sequences or ()),
            tuple({"role": m["role"], "content": _text(m.get("content"))} for m in messages),
            chat,
            options,
        )

    def plan(self, body: MessagesRequest, model: str, stream_id: str, prompt_tokens: int) -> Plan:
        message_id = "msg_" + stream_id
        if body.stream:
            renderer = MessagesRenderer(message_id, model)
            renderer.input_tokens = prompt_tokens
            return Plan(renderer, Ending.STREAM)
        # A whole answer is collected in the chat format, which `assemble_chat` folds.
        chat = ChatRenderer("chatcmpl-" + stream_id, model, int(time.time()), True)
        return Plan(
            chat, Ending.WHOLE, fold=lambda answer: message_object(message_id, model, answer)
        )

    def refused(self, exc: APIError, trace: str) -> Response:
        """Anthropic's shape, with the same status, headers and log line."""
        plain = exc.response(trace)
        headers = {
            k: v for k, v in plain.headers.items() if k not in ("content-length", "content-type")
        }
        body = error_body(exc.code, exc.message, status_error_type(exc.status), request_id=trace)
        return Response(
            body, status_code=exc.status, media_type="application/json", headers=headers
        )

    def failed(self, exc: EngineError, trace: str, headers: Mapping[str, str]) -> Response:
        body = error_body(exc.code, exc.message, error_type(exc.code, exc.type), request_id=trace)
        return Response(
            body,
            status_code=exc.status or 500,
            media_type="application/json",
            headers={**headers, **retry_headers(exc)},
        )


MESSAGES = MessagesFormat()


async def count_tokens(request: Request) -> Response:
    """`POST /v1/messages/count_tokens` (the SDK's `messages.count_tokens`): `{"input_tokens"}`,
    the engine's count of the prompt `/v1/messages` would give it for the same body, so it
    equals that answer's `usage.input_tokens`. No stream, so no admission: only the key."""
    trace = trace_id(request)
    gw = gateway(request)
    try:
        body, model, _ = await gw.accept(request, CountTokensRequest)
    except APIError as exc:
        return MESSAGES.refused(exc, trace)
    count = {"input_tokens": gw.engine.prompt_tokens(MESSAGES.inputs(body, None, model).prompt)}
    headers = {"x-request-id": trace, "request-id": trace}
    return Response(orjson.dumps(count), media_type="application/json", headers=headers)


# -- the request, as the engines and a relay see it ---------------------------------------------


def prompt_text(messages: list[dict[str, Any]]) -> str:
    """The plain rendering of chat messages, one `role: text` line each, as
    `ChatCompletionRequest.prompt()` renders them."""
    return "\n".join(f"{m['role']}: {_text(m.get('content'))}" for m in messages)


def chat_body(body: MessagesRequest, model: str | None = None) -> dict[str, Any]:
    """The request as a Chat Completions body."""
    chat: dict[str, Any] = {
        "model": model or body.model,
        "messages": chat_messages(body),
        "max_tokens": body.max_tokens,
        "stream": True,
    }
    if body.temperature is not None:
        chat["temperature"] = body.temperature
    if body.top_p is not None:
        chat["top_p"] = body.top_p
    if body.top_k is not None:
        chat["top_k"] = body.top_k  # not OpenAI's, but vLLM and llama.cpp read it
    if body.stop_sequences:
        chat["stop"] = list(body.stop_sequences)
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({"description": tool.description} if tool.description else {}),
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
    if body.tool_choice is not None:
        chat["tool_choice"] = chat_tool_choice(body.tool_choice)
        if body.tool_choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    user = (body.metadata or {}).get("user_id")
    if isinstance(user, str):
        chat["user"] = user
    if body.synthetic is not None:
        chat["synthetic"] = body.synthetic.model_dump(exclude_none=True)
    if _prefill(body) is not None:
        # vLLM's (and firsttoken's) way to continue the final assistant message.
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    return chat


def _prefill(body: MessagesRequest) -> str | None:
    """The text of a final assistant message (a prefill: the answer continues it), or None.
    A final turn with tool uses is not a prefill."""
    last = body.messages[-1]
    if last.role != "assistant":
        return None
    if isinstance(last.content, str):
        return last.content
    if any(isinstance(b, ToolUseBlock) for b in last.content):
        return None
    return "".join(b.text for b in last.content if isinstance(b, TextBlock))


def _has_documents(body: MessagesRequest) -> bool:
    return any(
        isinstance(block, DocumentBlock)
        for message in body.messages
        if not isinstance(message.content, str)
        for block in message.content
    )


def chat_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return choice.type  # "auto" | "none"


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """Messages → Chat Completions messages: the system prompt first; a user's tool results
    become `tool` messages (before the rest of that turn, as they answer the calls just
    made); an assistant's tool uses become its `tool_calls`; thinking is not forwarded."""
    out: list[dict[str, Any]] = []
    if isinstance(body.system, list) and any(b.cache_control for b in body.system):
        out.append({"role": "system", "content": [_chat_part(b) for b in body.system]})
    elif body.system:
        out.append({"role": "system", "content": body.system_text()})
    for message in body.messages:
        out.extend(_chat_message(message))
    return out


def _chat_message(message: MessageParam) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        texts = [b.text for b in message.content if isinstance(b, TextBlock)]
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": orjson.dumps(b.input).decode()},
            }
            for b in message.content
            if isinstance(b, ToolUseBlock)
        ]
        assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            assistant["tool_calls"] = calls
        elif assistant["content"] is None:
            assistant["content"] = ""
        return [assistant]
    out: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
        for b in message.content
        if isinstance(b, ToolResultBlock)
    ]
    parts = [
        _chat_part(b)
        for b in message.content
        if isinstance(b, TextBlock | ImageBlock | DocumentBlock)
    ]
    if len(parts) == 1 and parts[0]["type"] == "text" and "cache_control" not in parts[0]:
        out.append({"role": "user", "content": parts[0]["text"]})
    elif parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _chat_part(block: TextBlock | ImageBlock | DocumentBlock) -> dict[str, Any]:
    if isinstance(block, DocumentBlock):
        # No Chat Completions shape holds all of it: the block rides whole, for an Anthropic
        # target to send on as it came and an OpenAI-compatible one to turn into a `file`
        # part (`engines/relay.py`).
        return {"type": "document", "document": block.model_dump(exclude_none=True)}
    if isinstance(block, TextBlock):
        if block.cache_control is not None:  # reaches an Anthropic target as it was sent
            return {"type": "text", "text": block.text, "cache_control": block.cache_control}
        return {"type": "text", "text": block.text}
    source = block.source
    if isinstance(source, Base64Source):
        url = f"data:{source.media_type};base64,{source.data}"
    else:
        url = source.url
    return {"type": "image_url", "image_url": {"url": url}}


def _text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        part.get("text") or ""
        for part in content  # type: ignore[attr-defined]
        if isinstance(part, Mapping) and part.get("type") == "text"
    )
