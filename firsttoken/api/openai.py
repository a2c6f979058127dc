"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from firsttoken.api.bodies import APIError
from firsttoken.api.gateway import (
    Gateway,
    arrived_at,
    gateway,
    new_stream_id,
    retry_headers,
    trace_id,
    traceparent,
)
from firsttoken.api.protocol import ChatCompletionRequest, CompletionRequest
from firsttoken.core.collect import Collector
from firsttoken.core.stream import Stream
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.wire.render import ChatRenderer, CompletionRenderer

__all__ = ["chat_completions", "completions", "models"]


async def models(request: Request) -> Response:
    gw = gateway(request)
    try:
        key = gw.admission.authenticate(request)
    except APIError as exc:
        return exc.response(trace_id(request))
    data = [_model_object(m) for m in gw.models_for(key)]
    return JSONResponse({"object": "list", "data": data})


async def model(request: Request) -> Response:
    """`GET /v1/models/{id}` (the openai SDK's `models.retrieve`): the model, or 404
    `model_not_found` naming the ones served. Ids may hold slashes (`org/name`)."""
    gw = gateway(request)
    try:
        key = gw.admission.authenticate(request)
        served = gw.model(request.path_params["model_id"], key)
    except APIError as exc:
        return exc.response(trace_id(request))
    return JSONResponse(_model_object(served))


def _model_object(model_id: str) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "firsttoken"}


async def chat_completions(request: Request) -> Response:
    return await _serve(request, ChatCompletionRequest)


async def completions(request: Request) -> Response:
    return await _serve(request, CompletionRequest)


async def _serve(
    request: Request, kind: type[ChatCompletionRequest | CompletionRequest]
) -> Response:
    accepted_at = arrived_at(request)
    gw = gateway(request)
    trace = trace_id(request)
    try:
        body, raw, model, key = await gw.accept_raw(request, kind)
        chat = isinstance(body, ChatCompletionRequest)
        prompt = body.prompt() if isinstance(body, ChatCompletionRequest) else body.prompt
        stream_id = new_stream_id()
        generation = GenerationRequest(
            request_id=stream_id,
            prompt=prompt,
            model=model,
            max_tokens=body.token_limit(),
            seed=body.seed,
            temperature=body.temperature,
            stop=body.stop_strings(),
            messages=tuple({"role": m.role, "content": m.text()} for m in body.messages)
            if isinstance(body, ChatCompletionRequest)
            else None,
            options=_options(body),
            body=raw,
            tenant=key.name,
            priority=key.priority,
            weight=key.weight,
        )
        ticket = await gw.admit(key, generation)
    except APIError as exc:
        return exc.response(trace)
    chunk_id = ("chatcmpl-" if chat else "cmpl-") + stream_id
    created = int(time.time())
    # Usage always, for the non-streaming answer to carry it.
    include_usage = not body.stream or bool(
        body.stream_options and body.stream_options.include_usage
    )
    renderer = (ChatRenderer if chat else CompletionRenderer)(
        chunk_id, model, created, include_usage
    )
    options = body.stream_options if body.stream else None
    # A whole answer is read at once: chunking and progress events would be wasted on it.
    coalesce = (options.coalesce if options else None) if body.stream else "off"
    stream = gw.open_stream(
        generation,
        renderer,
        kind="openai",
        trace=trace,
        accepted_at=accepted_at,
        ticket=ticket,
        coalesce=coalesce,
        meta=bool(options and options.meta),
        traceparent=traceparent(request),
        takeover=body.stream,
    )
    if not body.stream:
        return await _complete(gw, request, stream, chunk_id, created, chat, trace)
    return gw.reader(
        stream,
        request,
        headers={"x-resume-token": stream.resume_token},
        start=True,
        timestamps=bool(options and options.timestamps),
    )


def _options(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    options: dict[str, Any] = {
        "synthetic": body.synthetic.model_dump() if body.synthetic else None
    }
    if isinstance(body, ChatCompletionRequest) and body.continue_final_message:
        options["continuation"] = body.continuation()  # engines that continue natively
    return options


async def _complete(
    gw: Gateway,
    request: Request,
    stream: Stream,
    chunk_id: str,
    created: int,
    chat: bool,
    trace: str,
) -> Response:
    """A non-streaming answer: the same lifecycle, read by a collector into one body."""
    try:
        answer = await Collector(stream).answer(gw.registry, request)
    except EngineError as exc:
        status = exc.status or 500
        return APIError(status, exc.code, exc.message, headers=retry_headers(exc)).response(trace)
    if answer is None:
        return Response(status_code=499)  # nobody is left to read it
    choice: dict[str, object] = {"index": 0}
    if chat:
        choice["message"] = answer.message()
    else:
        choice["text"] = answer.content
    choice.update(logprobs=None, finish_reason=answer.finish_reason)
    usage, obj = answer.usage, "chat.completion" if chat else "text_completion"
    body = {
        "id": chunk_id,
        "object": obj,
        "created": created,
        "model": stream.request.model,
        "choices": [choice],
        "usage": usage,
    }
    return Response(
        orjson.dumps(body),
        media_type="application/json",
        headers={"x-request-id": trace, "x-stream-id": stream.id},
    )
