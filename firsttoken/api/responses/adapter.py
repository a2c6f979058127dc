"""The OpenAI Responses API: `POST /v1/responses`, streaming typed events or one response.

A Responses request becomes the same `GenerationRequest` every API makes: a plain-text
prompt, and `body`, the request as a Chat Completions body (what a relay to an
OpenAI-compatible upstream forwards):

| Responses                                 | Chat Completions                                    |
|-------------------------------------------|-----------------------------------------------------|
| `instructions`                            | first message, role `system`                        |
| `input` (a string)                        | one `user` message                                  |
| message, `input_text`/`output_text`       | message, `text` parts (assistant: a string)         |
| `input_image` (`image_url`, `detail`)     | `image_url` part `{url, detail}`                    |
| `input_file`                              | `file` part `{file_data, file_id, filename}`        |
| `function_call` item                      | assistant `tool_calls[]` (consecutive ones merge)   |
| `function_call_output` item               | message, role `tool`, `tool_call_id`                |
| `reasoning` item                          | dropped (Chat Completions takes no reasoning input) |
| `tools[]` `{type: function, name, ...}`   | `{type: function, function: {name, ...}}`           |
| `tool_choice` `{type: function, name}`    | `{type: function, function: {name}}`                |
| `max_output_tokens`                       | `max_completion_tokens`                             |
| `text.format` (json_object / json_schema) | `response_format`                                   |
| `text.verbosity`, `reasoning.effort`      | `verbosity`, `reasoning_effort`                     |
| `top_logprobs`, `include` (logprobs)      | `logprobs: true`, `top_logprobs`                    |
| `stream`                                  | `stream: true`, `stream_options.include_usage`      |

A streaming request is read through `ResponsesRenderer`; a whole one runs the same stream
with a `ChatRenderer`, is assembled as a chat answer and converted into a Response.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from firsttoken.admission.keys import ApiKey
from firsttoken.api.gateway import gateway
from firsttoken.api.pipeline import Ending, Format, Inputs, Plan
from firsttoken.api.responses import conversation
from firsttoken.api.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputFile,
    InputImage,
    MessageItem,
    ReasoningItem,
    RefusalPart,
    ResponsesRequest,
)
from firsttoken.config import Settings
from firsttoken.core.stream import Stream
from firsttoken.formats.render import ChatRenderer
from firsttoken.formats.responses import ResponsesRenderer, response_from_answer, response_object

__all__ = [
    "RESPONSES",
    "ResponsesFormat",
    "chat_body",
    "chat_messages",
    "chat_tool_choice",
    "response_base",
    "transcript",
]


class ResponsesFormat(Format[ResponsesRequest]):
    """`POST /v1/responses`."""

    name = "responses"
    body = ResponsesRequest

    def grace_s(self, settings: Settings) -> float:
        # Resumed like a Chat Completions stream (Last-Event-ID on the same kind of POST).
        return settings.openai_grace_s

    def grace_for(self, body: ResponsesRequest, settings: Settings) -> float:
        # A background response runs with no reader until it ends, or --responses-ttl-s.
        return settings.responses_ttl_s if body.background else settings.openai_grace_s

    async def prepare(
        self, request: Request, key: ApiKey, body: ResponsesRequest
    ) -> ResponsesRequest:
        # `previous_response_id`'s conversation prepended; the key's stored-response caps.
        return await conversation.prepare(request, key, body)

    async def opened(
        self, request: Request, key: ApiKey, body: ResponsesRequest, stream: Stream
    ) -> None:
        if body.store is False:
            return
        if body.stream:
            # The first event does not wait on the shared store (a Redis coming back from a
            # restart held it ~1 s): the input is stored beside the stream, within moments.
            gateway(request).registry.spawn_task(
                conversation.keep_input_later, request, key, body, stream
            )
        else:  # its whole answer is kept with it (`folded`): the input must be there first
            await conversation.keep_input(request, key, body, stream)

    async def folded(
        self, request: Request, key: ApiKey, body: ResponsesRequest, answer: Any
    ) -> None:
        if body.store is not False:
            await conversation.keep_answer(request, key, body, answer)

    def inputs(self, body: ResponsesRequest, raw: dict[str, Any] | None, model: str) -> Inputs:
        lines = transcript(body)
        return Inputs(
            "\n".join(f"{role}: {text}" for role, text in lines),
            body.max_output_tokens,
            body.seed,
            body.temperature,
            (),
            tuple({"role": role, "content": text} for role, text in lines),
            chat_body(body, model),
            {"synthetic": body.synthetic.model_dump() if body.synthetic else None},
        )

    def plan(self, body: ResponsesRequest, model: str, stream_id: str, prompt_tokens: int) -> Plan:
        created = int(time.time())
        base = response_base(body, "resp_" + stream_id, model, created)
        if body.stream or body.background:
            options = body.stream_options
            # No progress events: SDKs would parse a named meta event as a response event.
            # A background response that is not streamed is answered with its handle, the
            # Response as it starts, and read later by id (`stored.py`).
            return Plan(
                ResponsesRenderer(base, stream_id),
                Ending.STREAM if body.stream else Ending.HANDLE,
                coalesce=options.coalesce if options else None,
            )
        # A whole answer runs the same stream as chat chunks, folded into one Response.
        chat = ChatRenderer("chatcmpl-" + stream_id, model, created, True)
        return Plan(
            chat, Ending.WHOLE, fold=lambda answer: response_from_answer(base, stream_id, answer)
        )

    def handle(self, stream: Stream, model: str, trace: str) -> Response:
        """A background response, started: the Response as it stands (queued or in
        progress), which `GET /v1/responses/{id}` reads on."""
        renderer = stream.renderer
        assert isinstance(renderer, ResponsesRenderer)
        response = response_object(renderer.base, "queued", [])
        if stream.first_token_at is not None:
            response["status"] = "in_progress"
        return JSONResponse(response, headers={"x-stream-id": stream.id, "x-request-id": trace})


RESPONSES = ResponsesFormat()
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for them


# -- the request, converted ---------------------------------------------------------------


def transcript(req: ResponsesRequest) -> list[tuple[str, str]]:
    """The conversation as (role, plain text) lines, the way `ChatCompletionRequest.prompt`
    renders a chat: instructions as `system`, a call as `assistant: name(arguments)`, its
    output as `tool`. Images, files and reasoning have no text here."""
    lines: list[tuple[str, str]] = []
    if req.instructions is not None:
        lines.append(("system", req.instructions))
    if isinstance(req.input, str):
        lines.append(("user", req.input))
        return lines
    for item in req.input:
        if isinstance(item, MessageItem):
            lines.append((item.role, _text(item.content)))
        elif isinstance(item, FunctionCallItem):
            lines.append(("assistant", f"{item.name}({item.arguments})"))
        elif isinstance(item, FunctionCallOutputItem):
            lines.append(("tool", _text(item.output)))
    return lines


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        part.refusal if isinstance(part, RefusalPart) else getattr(part, "text", "")
        for part in content
    )


def chat_body(req: ResponsesRequest, model: str) -> dict[str, Any]:
    """The request as a Chat Completions body (streaming, with usage)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": chat_messages(req),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "metadata", "store", "user"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.seed is not None:
        body["seed"] = req.seed
    if req.service_tier is not None:
        body["service_tier"] = req.service_tier
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": tool.model_dump(exclude={"type"}, exclude_none=True),
            }
            for tool in req.tools
        ]
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.top_logprobs is not None or LOGPROBS in (req.include or ()):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    text = req.text
    if text is not None:
        if text.verbosity is not None:
            body["verbosity"] = text.verbosity
        fmt = text.format
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema: dict[str, Any] = {
                "name": fmt.name,
                "schema": fmt.schema_,
                "description": fmt.description,
            }
            if fmt.strict is not None:
                schema["strict"] = fmt.strict
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {k: v for k, v in schema.items() if v is not None},
            }
    if req.synthetic is not None:
        body["synthetic"] = req.synthetic.model_dump(exclude_none=True)
    return body


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice["type"] == "function":
        return {"type": "function", "function": {"name": choice["name"]}}
    tools = [{"type": "function", "function": {"name": t["name"]}} for t in choice["tools"]]
    return {"type": "allowed_tools", "allowed_tools": {"mode": choice["mode"], "tools": tools}}


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as Chat Completions messages."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    for item in req.input:
        if isinstance(item, MessageItem):
            messages.append(_chat_message(item))
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one turn, several calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else _text(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            assert isinstance(item, ReasoningItem)  # no Chat Completions input for it
    return messages


def _chat_message(item: MessageItem) -> dict[str, Any]:
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    if item.role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": None}
        text = "".join(getattr(p, "text", "") for p in item.content)
        refusal = "".join(p.refusal for p in item.content if isinstance(p, RefusalPart))
        message["content"] = text or (None if refusal else "")
        if refusal:
            message["refusal"] = refusal
        return message
    parts: list[dict[str, Any]] = []
    for part in item.content:
        if isinstance(part, InputImage):
            image = {"url": part.image_url}
            if part.detail is not None:
                image["detail"] = part.detail
            parts.append({"type": "image_url", "image_url": image})
        elif isinstance(part, InputFile):
            fields = part.model_dump(
                include={"file_data", "file_id", "filename"}, exclude_none=True
            )
            parts.append({"type": "file", "file": fields})
        elif isinstance(part, RefusalPart):
            parts.append({"type": "text", "text": part.refusal})
        else:
            parts.append({"type": "text", "text": part.text})
    return {"role": item.role, "content": parts}


def response_base(
    req: ResponsesRequest, response_id: str, model: str, created_at: int
) -> dict[str, Any]:
    """The response object's fixed fields: its id, and what the request set (echoed, with
    the API's defaults where it set nothing)."""
    tools = [
        {"type": "function", "description": None, "parameters": None, "strict": None}
        | tool.model_dump(exclude_none=True)
        for tool in req.tools or ()
    ]
    reasoning = req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None}
    text: dict[str, Any] = {"format": {"type": "text"}}
    if req.text is not None:
        text = req.text.model_dump(exclude_none=True, by_alias=True)
        text.setdefault("format", {"type": "text"})
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": bool(req.background),
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": reasoning,
        # Kept unless `store: false` (OpenAI's default): a stream's events and its input, a
        # whole answer's Response and its input (`conversation.py`).
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": text,
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": tools,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }
