"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from firsttoken.admission import Ticket
from firsttoken.api.errors import APIError
from firsttoken.api.gateway import Gateway, gateway, new_stream_id, trace_id
from firsttoken.api.protocol import ChatCompletionRequest, CompletionRequest
from firsttoken.api.render import ChatRenderer, CompletionRenderer
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.response import ARRIVED_KEY
from firsttoken.stream import Outcome

__all__ = ["chat_completions", "completions", "models"]


async def models(request: Request) -> Response:
    gw = gateway(request)
    try:
        gw.admission.authenticate(request)
    except APIError as exc:
        return exc.response(trace_id(request))
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "firsttoken"}
        for m in gw.engine.models
    ]
    return JSONResponse({"object": "list", "data": data})


async def chat_completions(request: Request) -> Response:
    return await _serve(request, ChatCompletionRequest)


async def completions(request: Request) -> Response:
    return await _serve(request, CompletionRequest)


async def _serve(
    request: Request, kind: type[ChatCompletionRequest | CompletionRequest]
) -> Response:
    # The clock of every latency metric: the request's first byte, as a client counts it.
    accepted_at = request.scope.get(ARRIVED_KEY) or time.perf_counter()
    gw = gateway(request)
    trace = trace_id(request)
    try:
        body, model, ticket = await gw.accept(request, kind)
    except APIError as exc:
        return exc.response(trace)
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
        options={"synthetic": body.synthetic.model_dump() if body.synthetic else None},
    )
    chunk_id = ("chatcmpl-" if chat else "cmpl-") + stream_id
    created = int(time.time())
    if not body.stream:
        return await _complete(gw, request, generation, ticket, chunk_id, created, chat, trace)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    renderer = (ChatRenderer if chat else CompletionRenderer)(
        chunk_id, model, created, include_usage
    )
    options = body.stream_options
    stream = gw.open_stream(
        generation,
        renderer,
        kind="openai",
        trace=trace,
        accepted_at=accepted_at,
        ticket=ticket,
        coalesce=options.coalesce if options else None,
        meta=bool(options and options.meta),
    )
    return gw.reader(
        stream,
        request,
        headers={"x-resume-token": stream.resume_token},
        start=True,
        timestamps=bool(options and options.timestamps),
    )


async def _complete(
    gw: Gateway,
    request: Request,
    generation: GenerationRequest,
    ticket: Ticket,
    chunk_id: str,
    created: int,
    chat: bool,
    trace: str,
) -> Response:
    """A non-streaming answer: generate it all, still stopping if the client goes away."""
    parts: list[str] = []
    finish: str | None = None
    error: EngineError | None = None
    metrics = gw.metrics
    metrics.active_streams += 1
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
            try:
                async for delta in gw.engine.generate(generation):
                    if delta.text:
                        parts.append(delta.text)
                    if delta.finish_reason:
                        finish = delta.finish_reason
                finish = finish or "stop"
            except EngineError as exc:
                error = exc
            tg.cancel_scope.cancel()
    finally:
        metrics.active_streams -= 1
        if error is not None:
            outcome = Outcome.ERROR
        elif finish is None:
            outcome = Outcome.DISCONNECTED
            with anyio.CancelScope(shield=True):
                await gw.engine.abort(generation.request_id)
        else:
            outcome = Outcome.COMPLETED
        metrics.streams[outcome.value] += 1
        with anyio.CancelScope(shield=True):
            await ticket.release(outcome, len(parts))
    if error is not None:
        return APIError(500, error.code, error.message).response(trace)
    if finish is None:
        return Response(status_code=499)  # nobody is left to read it
    completion_tokens = len(parts)
    metrics.tokens_sent += completion_tokens
    prompt_tokens = gw.engine.prompt_tokens(generation.prompt)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    text = "".join(parts)
    if chat:
        choice: dict[str, object] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body = {
        "id": chunk_id,
        "object": obj,
        "created": created,
        "model": generation.model,
        "choices": [choice],
        "usage": usage,
    }
    return Response(
        orjson.dumps(body),
        media_type="application/json",
        headers={"x-request-id": trace, "x-stream-id": generation.request_id},
    )


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
