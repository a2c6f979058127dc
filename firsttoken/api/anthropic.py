"""The Anthropic Messages API: `POST /v1/messages`, streaming and not.

A request becomes the same `GenerationRequest` an OpenAI one does: its plain-text prompt, and
its translation to a Chat Completions body (what a relay forwards to an OpenAI-compatible
upstream). A streaming answer is rendered by `wire.anthropic.MessagesRenderer`; a whole one is
collected in the chat format, assembled, and reshaped into a message object, as
`openai._complete` does for its own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from firsttoken.admission.keys import ApiKey
from firsttoken.api.anthropic_protocol import (
    Base64Source,
    CountTokensRequest,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from firsttoken.api.bodies import APIError, read_model
from firsttoken.api.gateway import (
    Gateway,
    arrived_at,
    gateway,
    new_stream_id,
    retry_headers,
    trace_id,
    traceparent,
)
from firsttoken.core.collect import Collector
from firsttoken.core.stream import Stream
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.wire.anthropic import (
    MessagesRenderer,
    error_body,
    error_type,
    message_object,
    status_error_type,
)
from firsttoken.wire.render import ChatRenderer

__all__ = [
    "chat_body",
    "chat_messages",
    "chat_tool_choice",
    "count_tokens",
    "generation_request",
    "messages",
    "prompt_text",
]


async def messages(request: Request) -> Response:
    accepted_at = arrived_at(request)
    trace = trace_id(request)
    try:
        return await _serve(request, gateway(request), trace, accepted_at)
    except APIError as exc:
        return _refusal(exc, trace)


async def count_tokens(request: Request) -> Response:
    """`POST /v1/messages/count_tokens` (the SDK's `messages.count_tokens`): `{"input_tokens"}`,
    the engine's count of the prompt `/v1/messages` would give it for the same body, so it
    equals that answer's `usage.input_tokens`. No stream, so no admission: only the key."""
    trace = trace_id(request)
    gw = gateway(request)
    try:
        key = gw.admission.authenticate(request)
        s = gw.settings
        body = await read_model(request, CountTokensRequest, s.max_body_bytes, s.body_timeout_s)
        model = gw.model(body.model, key)
    except APIError as exc:
        return _refusal(exc, trace)
    prompt = generation_request(body, model, "count_tokens").prompt
    count = {"input_tokens": gw.engine.prompt_tokens(prompt)}
    headers = {"x-request-id": trace, "request-id": trace}
    return Response(orjson.dumps(count), media_type="application/json", headers=headers)


# A `thread` that continues sends only the turn's new messages, and answering those alone
# would lose the conversation (the SDK's tool runner then calls its tool until its iteration
# limit). Refused with the code on which the SDK drops `thread` and sends the whole history.
THREAD_UNSUPPORTED = "thread_unsupported_request"


async def _serve(request: Request, gw: Gateway, trace: str, accepted_at: float) -> Response:
    body, model, key = await gw.accept(request, MessagesRequest)
    if body.thread is not None:
        raise APIError(
            400,
            THREAD_UNSUPPORTED,
            "this server keeps no conversation state: send the whole conversation in "
            "`messages`, without `thread`",
            param="thread",
        )
    stream_id = new_stream_id()
    generation = generation_request(body, model, stream_id, key)
    ticket = await gw.admit(key, generation)
    message_id = "msg_" + stream_id
    renderer: MessagesRenderer | ChatRenderer
    if body.stream:
        renderer = MessagesRenderer(message_id, model)
    else:
        # A whole answer is collected in the chat format, which `assemble_chat` folds.
        renderer = ChatRenderer("chatcmpl-" + stream_id, model, int(time.time()), True)
    stream = gw.open_stream(
        generation,
        renderer,
        kind="anthropic",
        trace=trace,
        accepted_at=accepted_at,
        ticket=ticket,
        # A whole answer is read at once: chunking would be wasted on it.
        coalesce=None if body.stream else "off",
        meta=False,
        traceparent=traceparent(request),
        takeover=body.stream,
    )
    headers = {"x-request-id": trace, "request-id": trace, "x-stream-id": stream.id}
    if not isinstance(renderer, MessagesRenderer):
        return await _complete(gw, request, stream, message_id, headers)
    renderer.input_tokens = stream.prompt_tokens
    return gw.reader(
        stream,
        request,
        headers={"x-resume-token": stream.resume_token, "request-id": trace},
        start=True,
    )


async def _complete(
    gw: Gateway, request: Request, stream: Stream, message_id: str, headers: dict[str, str]
) -> Response:
    """A non-streaming answer: the same lifecycle, read by a collector into one message."""
    try:
        answer = await Collector(stream).answer(gw.registry, request)
    except EngineError as exc:
        return Response(
            error_body(error_type(exc.code, exc.type), exc.message, headers["x-request-id"]),
            status_code=exc.status or 500,
            media_type="application/json",
            headers={**headers, **retry_headers(exc)},
        )
    if answer is None:
        return Response(status_code=499)  # nobody is left to read it
    body = message_object(message_id, stream.request.model, answer)
    return Response(orjson.dumps(body), media_type="application/json", headers=headers)


def _refusal(exc: APIError, trace: str) -> Response:
    """An `APIError` before the first byte, in Anthropic's shape (same status, same headers,
    same log line)."""
    plain = exc.response(trace)
    headers = {
        k: v for k, v in plain.headers.items() if k not in ("content-length", "content-type")
    }
    details = {"error_code": exc.code} if exc.code == THREAD_UNSUPPORTED else None
    return Response(
        error_body(status_error_type(exc.status), exc.message, trace, details),
        status_code=exc.status,
        media_type="application/json",
        headers=headers,
    )


# -- the request, as the engines and a relay see it ---------------------------------------------


def generation_request(
    body: MessagesRequest, model: str, stream_id: str, key: ApiKey | None = None
) -> GenerationRequest:
    """The engine's request: the plain-text prompt, the limits, and the Chat Completions
    body a relay forwards; `key` (None: an open server's caller) gives its name, priority
    and weight."""
    key = key or ApiKey(name="")
    chat = chat_body(body, model)
    messages = chat["messages"]
    options: dict[str, Any] = {
        "synthetic": body.synthetic.model_dump() if body.synthetic else None
    }
    prefill = _prefill(body)
    if prefill is not None:  # the answer continues it; the prompt is the rest
        options["continuation"] = prefill
    return GenerationRequest(
        request_id=stream_id,
        prompt=prompt_text(messages[:-1] if prefill is not None else messages),
        model=model,
        max_tokens=body.max_tokens,
        seed=None,  # the Messages API has none
        temperature=body.temperature,
        stop=tuple(body.stop_sequences or ()),
        messages=tuple({"role": m["role"], "content": _text(m.get("content"))} for m in messages),
        body=chat,
        options=options,
        tenant=key.name,
        priority=key.priority,
        weight=key.weight,
    )


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
    parts = [_chat_part(b) for b in message.content if isinstance(b, TextBlock | ImageBlock)]
    if len(parts) == 1 and parts[0]["type"] == "text" and "cache_control" not in parts[0]:
        out.append({"role": "user", "content": parts[0]["text"]})
    elif parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _chat_part(block: TextBlock | ImageBlock) -> dict[str, Any]:
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
