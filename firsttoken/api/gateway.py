"""The steps the pipeline (`api/pipeline.py`) takes for every request, each one place:
`accept` (the key, the body, `model`: which model the request gets), `admit`, `open_stream`,
`reader`; over the app's parts they read (settings, the engine, the stream registry, the
metrics, admission). What moves a stream between instances is `api/takeover.py`'s."""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from firsttoken.admission import Admission, ApiKey, Ticket, sets_own_latency
from firsttoken.admission.admin import AdminKey
from firsttoken.api.bodies import APIError, read_json, validate
from firsttoken.api.protocol import Coalesce, CoalesceOptions
from firsttoken.api.takeover import Takeover
from firsttoken.config import Settings
from firsttoken.core.chunking import CoalescePolicy
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.sender import EventStreamResponse
from firsttoken.core.stream import SELF_RESUMING, BaseStream, Renderer, Stream
from firsttoken.engines import Engine, EngineError, GenerationRequest
from firsttoken.formats.errors import echo
from firsttoken.telemetry.log import log_event
from firsttoken.telemetry.metrics import Metrics, key_label
from firsttoken.wire.compression import StreamCompressor, negotiate
from firsttoken.wire.connection import ARRIVED_KEY

__all__ = [
    "Gateway",
    "arrived_at",
    "gateway",
    "new_stream_id",
    "retry_headers",
    "trace_id",
    "traceparent",
]

B = TypeVar("B", bound=BaseModel)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


def retry_headers(error: EngineError) -> dict[str, str]:
    """`Retry-After` for an answer refused before its first byte with 429 or 503: the engine's
    own wait when it reached us, else 1 s. A collected answer's error comes back from the
    stream's log with its status only; 1 s is the queue's own wait, and the least a route with
    no target available asks."""
    if error.status not in (429, 503):
        return {}
    wait = error.retry_after_s if error.retry_after_s is not None else 1.0
    return {"retry-after": str(max(1, math.ceil(wait)))}


@dataclass(slots=True)
class Gateway:
    """The request's steps, over the parts app.py built (one of each per app, read by the
    handlers through `gateway(request)`). What moves a stream between instances is
    `takeover`'s; what the server reads of the usage ledger, `usage_store`."""

    settings: Settings
    engine: Engine
    registry: StreamRegistry
    metrics: Metrics
    admission: Admission
    admin: AdminKey = field(default_factory=lambda: AdminKey(None))
    # The engine's models by name, built once per model list (not two scans a request).
    _served: tuple[tuple[str, ...], dict[str, str]] | None = field(
        default=None, init=False, repr=False
    )
    # A stream that moves between instances (`api/takeover.py`): what travels with each
    # new stream when the store replicates, and what another instance makes of it.
    takeover: Takeover = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.takeover = Takeover(self.settings, self.engine, self.admission)

    @property
    def usage_store(self) -> str:
        """Where the usage ledger keeps its records, as log lines name it (no password)."""
        return self.admission.ledger.store.shown

    async def accept(self, request: Request, kind: type[B]) -> tuple[B, str, ApiKey]:
        """Authenticate, read and validate the body, resolve the model."""
        body, _, model, key = await self.accept_raw(request, kind)
        return body, model, key

    async def accept_raw(
        self, request: Request, kind: type[B]
    ) -> tuple[B, dict[str, Any], str, ApiKey]:
        """`accept`, with the body as the client sent it (what a relay forwards)."""
        key = self.admission.authenticate(request)
        raw = await read_json(request, self.settings.max_body_bytes, self.settings.body_timeout_s)
        if self.admission.keys is not None:
            # The body may have taken up to --body-timeout-s: a reload may have revoked the key.
            key = self.admission.recheck(key)
        body = validate(kind, raw)
        model = self.model(getattr(body, "model", None), key)
        return body, raw, model, key

    async def admit(
        self,
        key: ApiKey,
        prompt: str,
        max_tokens: int | None,
        model: str,
        stream_id: str,
        options: Mapping[str, Any],
        trace: str,
    ) -> Ticket:
        """Admit the request once its prompt and limits are known: the key's token budget
        holds its prompt (counted here, once) plus its `max_tokens`."""
        return await self.admission.admit(
            key,
            self.engine.prompt_tokens(prompt),
            max_tokens,
            model,
            request_id=stream_id,  # the ledger's record of it
            trace_id=trace,
            own_latency=sets_own_latency(options),
        )

    def open_stream(
        self,
        generation: GenerationRequest,
        renderer: Renderer,
        *,
        format: str,
        grace_s: float,
        trace: str,
        accepted_at: float,
        ticket: Ticket,
        coalesce: Coalesce,
        meta: bool,
        takeover: bool = True,
    ) -> Stream:
        """A new stream with this server's resume, backpressure and chunking settings, for
        the request as admitted (`Ticket.admitted`: its answer's limit, the prompt's count);
        `grace_s` is how long it outlives its last reader (its format's choice). `traceparent`
        (the client's) goes with the request, to its span and its upstream, with
        --trust-trace-headers; else the span only links to it. With a shared store, what
        another instance needs to continue it goes with it (`takeover`: False for a whole
        answer, which nobody could resume)."""
        s = self.settings
        admitted = ticket.admitted
        self._check(generation, ticket)
        try:
            stream = Stream(
                generation,
                renderer,
                format=format,
                trace_id=trace,
                grace_s=grace_s,
                prompt_tokens=admitted.prompt_tokens,
                max_events=s.resume_max_events,
                accepted_at=accepted_at,
                window=s.stream_buffer_events,
            )
        except Exception as exc:  # admitted, but no stream to end: give the ticket back here
            self.registry.unstarted(ticket)
            log_event(
                "stream.open_failed",
                logging.ERROR,
                trace_id=trace,
                key=key_label(ticket.key.name),
                error=repr(exc),
            )
            raise APIError(500, "internal_error", "the stream could not be set up") from None
        stream.ticket = ticket
        stream.coalesce = self.coalesce_policy(coalesce)
        if meta:
            stream.meta_interval_s = s.meta_interval_ms / 1000
        if takeover and self.registry.store.replicates:
            stream.handover = self.takeover.handover(stream, generation, ticket)
            # A drain hands over only what its readers resume by themselves (SELF_RESUMING);
            # the handover still lets a reader elsewhere take over any stream of a dead owner.
            stream.movable = stream.handover is not None and format in SELF_RESUMING
        return stream

    def _check(self, generation: GenerationRequest, ticket: Ticket) -> None:
        """Refuse before the first byte what the engine can tell at once it would fail (a
        continuation that does not start its answer), as a 4xx with the ticket given back."""
        try:
            self.engine.check(generation)
        except EngineError as exc:
            ticket.client_fault = exc.client_fault
            self.registry.unstarted(ticket)
            param = None
            if exc.code == "invalid_continuation":  # where the text continued came from
                param = "messages" if generation.messages is not None else "continue_final_text"
            raise APIError(exc.status or 400, exc.code, exc.message, param=param) from None

    def reader(self, stream: BaseStream, request: Request, **options: Any) -> EventStreamResponse:
        """A connection reading `stream`, with this server's heartbeat, send timeout and
        compression."""
        return EventStreamResponse(
            stream,
            self.registry,
            self.metrics,
            heartbeat_s=self.settings.heartbeat_s,
            send_timeout_s=self.settings.send_timeout_s,
            compressor=self.compressor(request),
            **options,
        )

    def coalesce_policy(self, requested: Coalesce) -> CoalescePolicy | None:
        """The request's chunking, else the server's; None is one event per token."""
        s = self.settings
        if requested is None:
            requested = s.coalesce  # type: ignore[assignment]
        if requested == "off":
            return None
        options = requested if isinstance(requested, CoalesceOptions) else CoalesceOptions()
        if options.mode == "off":
            return None
        wait_ms = options.max_wait_ms if options.max_wait_ms is not None else s.coalesce_max_wait_ms
        max_bytes = options.max_bytes if options.max_bytes is not None else s.coalesce_max_bytes
        return CoalescePolicy(max_wait_s=wait_ms / 1000, max_bytes=max_bytes)

    def compressor(self, request: Request) -> StreamCompressor | None:
        if self.settings.stream_compression != "on":
            return None
        encoding = negotiate(request.headers.get("accept-encoding", ""))
        return StreamCompressor(encoding) if encoding else None

    def models_for(self, key: ApiKey | None) -> tuple[str, ...]:
        """The models (routes) `key` may use: those its `routes` allow, of those served."""
        models = self.engine.models
        if key is None or key.routes is None:
            return models
        return tuple(m for m in models if key.may_use(m))

    def model(self, requested: str | None, key: ApiKey | None = None) -> str:
        """The served model `requested` names (None: the first `key` may use), or 404
        `model_not_found`: also for a route the key may not use, which it is not told
        exists (OpenAI's answer for a model you cannot see)."""
        models = self.engine.models
        served = self._served
        if served is None or served[0] is not models:  # a reload swapped the routes
            served = self._served = (models, {m: m for m in models})
        # The engine's own string, shared: the body's copy would stay with every stream.
        found = served[1].get(requested) if requested is not None else None
        if found is not None and (key is None or key.routes is None or key.may_use(found)):
            return found
        allowed = self.models_for(key)
        if requested is None and allowed:
            return allowed[0]
        shown = ", ".join(allowed[:20]) or "none to this key"
        if len(allowed) > 20:
            shown += f" and {len(allowed) - 20} more"
        raise APIError(
            404,
            "model_not_found",
            f"the model {echo(requested or '')} does not exist or you do not have access "
            f"to it; this server serves: {shown} (GET /v1/models lists them)",
            param="model",
        )


def gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway  # set by app.py; Starlette's state is untyped
    return gw


def arrived_at(request: Request) -> float:
    """The clock of every latency metric: the request's first byte, as a client counts it."""
    return request.scope.get(ARRIVED_KEY) or time.perf_counter()


def trace_id(request: Request) -> str:
    """With --trust-trace-headers the caller's X-Request-Id or W3C traceparent's trace id;
    otherwise (the default) one made here: a client's id would let it join, or pick, the
    trace of someone else's requests."""
    if gateway(request).settings.trust_trace_headers:
        given = request.headers.get("x-request-id")
        if given and _REQUEST_ID.match(given):
            return given
        parent = traceparent(request)
        if parent is not None:
            return parent[3:35]
    return os.urandom(16).hex()  # a uuid4's 128 bits, without building a UUID


def traceparent(request: Request) -> str | None:
    """The client's W3C trace context, when it is a valid one (version 00's layout, neither
    id all zeros): continued by the stream's span and passed on to an upstream."""
    header = request.headers.get("traceparent")
    if header is None:
        return None
    parent = _TRACEPARENT.match(header)
    if parent is None or parent.group(1) == _ZERO_TRACE or parent.group(2) == _ZERO_SPAN:
        return None
    return header if header[:2] != "ff" else None  # version ff is invalid


def new_stream_id() -> str:
    # 128 random bits: stream ids cannot be guessed or enumerated.
    return secrets.token_hex(16)
