"""ONE path for every API request: authenticate → read → validate → admit → open → write or fold.

Each API format is an adapter beside it (`api/<format>/adapter.py`, a `Format`): its request
model, how its body becomes the engine's `GenerationRequest`, its renderer, how a whole
answer is folded into its JSON body, and its error shape. The pipeline owns the order of the
steps and the three ways an answer leaves (`Ending`); a format owns only what differs.

    serve(request, format)
      gateway.accept_raw    authenticate the key, read and validate the body, resolve the model
      format.check          the format's own refusals of a valid body (Anthropic's `thread`)
      format.inputs         the body as the engine's inputs → one `GenerationRequest` (`generation`)
      gateway.admit         the key's slots, rate and token budget: a `Ticket`, or a 4xx/5xx
      format.plan           renderer, chunking, progress events, the ending, the fold
      gateway.open_stream   the `Stream`, with its format's resume grace (`format.grace_s`)
      STREAM  gateway.reader: this connection reads the stream as it is produced
      WHOLE   a `Collector` reads it to the end; `plan.fold` makes the answer's body
      HANDLE  the stream starts now, `format.handle` answers where to read it (native)

Every refusal before the first byte is the format's (`Format.refused`, `Format.failed`); the
OpenAI shape is the default. Cost: the steps are the handlers' own work; the adapters' calls,
`Inputs` and `Plan` add ~25 Python calls a stream to the ~1,200 it takes (cProfile over 1,200
streamed chat requests, against the four handlers this replaced), under 1% of its CPU.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any, Generic, NamedTuple, TypeVar

import orjson
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from firsttoken.admission.gate import Admitted
from firsttoken.admission.keys import ANONYMOUS, ApiKey
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
from firsttoken.api.protocol import Coalesce
from firsttoken.config import Settings
from firsttoken.core.collect import Collector
from firsttoken.core.sender import EventStreamResponse
from firsttoken.core.stream import Renderer, Stream
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.formats.assemble import ChatAnswer
from firsttoken.wire.exchange import client_gone

__all__ = ["Answer", "Ending", "Format", "Inputs", "Plan", "serve"]

B = TypeVar("B", bound=BaseModel)
# What a request is answered with: a body, or an event stream its connection reads.
Answer = Response | EventStreamResponse

# An open server's caller (no keys file): no name, default priority and weight.


class Ending(Enum):
    """How an answer leaves the pipeline."""

    STREAM = "stream"  # an event stream, written to this request's connection as it is made
    WHOLE = "whole"  # one JSON body, folded from the stream by a collector
    HANDLE = "handle"  # started now, and answered with where to read it (native streams)


class Inputs(NamedTuple):
    """What a format's body gives the engine: the `GenerationRequest`'s fields that depend on
    the format (the pipeline adds the stream's id, the model and the key)."""

    prompt: str
    max_tokens: int | None
    seed: int | None
    temperature: float | None
    stop: tuple[str, ...]
    messages: tuple[Mapping[str, str], ...] | None
    body: Mapping[str, Any] | None  # the request as a Chat Completions body (a relay's)
    options: Mapping[str, Any]


@dataclass(slots=True)
class Plan:
    """What a format decides for one admitted request."""

    renderer: Renderer
    ending: Ending
    coalesce: Coalesce = None  # the request's chunking (None: the server's)
    meta: bool = False  # progress events (`event: meta`)
    timestamps: bool = False  # `: t=<send time>` comments before each event
    # WHOLE: the answer's JSON body from what the collector assembled.
    fold: Callable[[ChatAnswer], Mapping[str, Any]] | None = None


class Format(Generic[B]):
    """One API format, as the pipeline asks of it (a thin shell per format: the subclasses
    in `api/<format>/adapter.py`)."""

    name: str  # the API format's name, a stream's `format`: its log lines, its rebuild elsewhere
    body: type[B]  # the request model
    # A header of the format's own that carries the trace id too (Anthropic's `request-id`).
    trace_header: str | None = None

    def grace_s(self, settings: Settings) -> float:
        """How long the stream outlives its last reader, waiting for a resume."""
        raise NotImplementedError

    def grace_for(self, body: B, settings: Settings) -> float:
        """`grace_s`, where a request may ask for its own (a background response)."""
        return self.grace_s(settings)

    def check(self, body: B) -> None:
        """Refuse (raise `APIError`) a valid body this server does not serve."""

    async def prepare(self, request: Request, key: ApiKey, body: B) -> B:
        """The body completed from what is stored (Responses' `previous_response_id`), and
        what storing it would take of the key's caps checked: before admission."""
        return body

    async def opened(self, request: Request, key: ApiKey, body: B, stream: Stream) -> None:
        """The request's stream is open: keep what the format stores beside it."""

    async def folded(self, request: Request, key: ApiKey, body: B, answer: Any) -> None:
        """A whole answer's body, folded, as it is sent."""

    def inputs(self, body: B, raw: dict[str, Any] | None, model: str) -> Inputs:
        """The body as the engine's inputs; `raw` is the body as the client sent it."""
        raise NotImplementedError

    def plan(self, body: B, model: str, stream_id: str, prompt_tokens: int) -> Plan:
        """The answer's renderer and ending, once the request is admitted (`prompt_tokens`:
        its prompt as admission counted it)."""
        raise NotImplementedError

    def handle(self, stream: Stream, model: str, trace: str) -> Response:
        """`Ending.HANDLE`: the answer that says where to read the started stream."""
        raise NotImplementedError

    def generation(
        self,
        body: B,
        model: str,
        stream_id: str,
        key: ApiKey | None = None,
        raw: dict[str, Any] | None = None,
    ) -> GenerationRequest:
        """The engine's request for `body`, before admission; `key` (None: an open server's
        caller) gives its name, priority and weight."""
        return engine_request(self.inputs(body, raw, model), model, stream_id, key or ANONYMOUS)

    # -- the error shape: OpenAI's unless a format has its own ------------------------------

    def refused(self, exc: APIError, trace: str) -> Response:
        """A refusal before anything was started (authentication, body, model, admission)."""
        return exc.response(trace)

    def failed(self, exc: EngineError, trace: str, headers: Mapping[str, str]) -> Response:
        """A whole answer (or a handle's start) that failed before its first byte; `headers`
        are the answer's own (its ids), which the OpenAI shape leaves to the log line."""
        status = exc.status or 500
        return APIError(status, exc.code, exc.message, headers=retry_headers(exc)).response(trace)


def engine_request(
    i: Inputs,
    model: str,
    stream_id: str,
    key: ApiKey,
    admitted: Admitted | None = None,
    trace: str = "",
    traceparent: str | None = None,
    linked_traceparent: str | None = None,
) -> GenerationRequest:
    """The engine's request: the format's inputs, the key's name, priority and weight, and,
    once admitted, the answer's limit, the prompt's count and the trace. Built once a stream:
    a copy of a request costs ~1 µs."""
    max_tokens = i.max_tokens
    prompt_tokens = None
    if admitted is not None:
        prompt_tokens = admitted.prompt_tokens
        if admitted.max_tokens is not None:
            max_tokens = admitted.max_tokens
    return GenerationRequest(
        request_id=stream_id,
        prompt=i.prompt,
        model=model,
        max_tokens=max_tokens,
        seed=i.seed,
        temperature=i.temperature,
        stop=i.stop,
        messages=i.messages,
        body=i.body,
        options=i.options,
        tenant=key.name,
        priority=key.priority,
        weight=key.weight,
        traceparent=traceparent,
        prompt_tokens=prompt_tokens,
        trace_id=trace,
        linked_traceparent=linked_traceparent,
    )


async def serve(request: Request, format: Format[Any]) -> Answer:
    """Carry one request from its head to its writer (or its fold)."""
    accepted_at = arrived_at(request)
    gw = gateway(request)
    trace = trace_id(request)
    try:
        body, raw, model, key = await gw.accept_raw(request, format.body)
        format.check(body)
        body = await format.prepare(request, key, body)
        stream_id = new_stream_id()
        inputs = format.inputs(body, raw, model)
        ticket = await gw.admit(
            key, inputs.prompt, inputs.max_tokens, model, stream_id, inputs.options, trace
        )
        # The client's trace context goes to the upstream with --trust-trace-headers; else
        # the stream's span only links to it.
        parent = traceparent(request)
        trusted = gw.settings.trust_trace_headers
        generation = engine_request(
            inputs,
            model,
            stream_id,
            key,
            ticket.admitted,
            trace,
            parent if trusted else None,
            None if trusted else parent,
        )
        plan = format.plan(body, model, stream_id, ticket.admitted.prompt_tokens)
        ending = plan.ending
        stream = gw.open_stream(
            generation,
            plan.renderer,
            format=format.name,
            grace_s=format.grace_for(body, gw.settings),
            trace=trace,
            accepted_at=accepted_at,
            ticket=ticket,
            # A whole answer is read at once: chunking and progress would be wasted on it.
            coalesce=plan.coalesce if ending is not Ending.WHOLE else "off",
            meta=plan.meta and ending is not Ending.WHOLE,
            takeover=ending is not Ending.WHOLE,  # nobody could resume a whole answer
        )
        await format.opened(request, key, body, stream)
    except APIError as exc:
        return format.refused(exc, trace)
    if ending is Ending.STREAM:
        headers = {"x-resume-token": stream.resume_token}
        if format.trace_header is not None:
            headers[format.trace_header] = trace
        return gw.reader(stream, request, headers=headers, start=True, timestamps=plan.timestamps)
    if ending is Ending.WHOLE:
        return await _fold(
            gw, format, request, stream, plan, trace, partial(format.folded, request, key, body)
        )
    return await _start(gw, format, stream, model, trace)


async def _fold(
    gw: Gateway,
    format: Format[Any],
    request: Request,
    stream: Stream,
    plan: Plan,
    trace: str,
    folded: Callable[[Any], Awaitable[None]],
) -> Response:
    """A whole answer: the same lifecycle, read by a collector, folded into one body."""
    headers = {"x-request-id": trace}
    if format.trace_header is not None:
        headers[format.trace_header] = trace
    headers["x-stream-id"] = stream.id
    try:
        answer = await Collector(stream).answer(gw.registry, partial(client_gone, request.receive))
    except EngineError as exc:
        return format.failed(exc, trace, headers)
    if answer is None:
        return Response(status_code=499)  # nobody is left to read it
    assert plan.fold is not None
    body = plan.fold(answer)
    await folded(body)
    return Response(orjson.dumps(body), media_type="application/json", headers=headers)


async def _start(
    gw: Gateway, format: Format[Any], stream: Stream, model: str, trace: str
) -> Response:
    """A stream read later, by its handle: started now, with no reader yet."""
    failed = await gw.registry.start(stream)
    if failed is not None:
        # Failed before its id was handed out: nobody could read the error event.
        gw.registry.forget(stream)
        return format.failed(failed, trace, {"x-stream-id": stream.id})
    return format.handle(stream, model, trace)
