"""What every request needs: settings, the engine, the stream registry, the metrics; and the
steps the pipeline (`api/pipeline.py`) takes through them, each one place: `accept` (the key,
the body, `model`: which model the request gets), `admit`, `open_stream`, `reader`."""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel
from starlette.requests import Request

from firsttoken.admission import Admission, ApiKey, Ticket, sets_own_latency
from firsttoken.admission.admin import AdminKey
from firsttoken.api.bodies import APIError, read_json, validate
from firsttoken.api.protocol import Coalesce, CoalesceOptions
from firsttoken.config import Settings
from firsttoken.core.chunking import CoalescePolicy
from firsttoken.core.registry import StreamRegistry
from firsttoken.core.stream import SELF_RESUMING, Outcome, Renderer, Stream, Usage
from firsttoken.core.writer import EventStreamResponse
from firsttoken.engines import Engine, EngineError, GenerationRequest
from firsttoken.resume import Claim, Orphaned
from firsttoken.routing.splice import Transcript, continuation
from firsttoken.telemetry.metrics import Metrics, key_label, log_event
from firsttoken.wire.anthropic import MessagesRenderer
from firsttoken.wire.compression import StreamCompressor, negotiate
from firsttoken.wire.connection import ARRIVED_KEY
from firsttoken.wire.errors import echo
from firsttoken.wire.rebuild import decode, rebuild, replay
from firsttoken.wire.render import ChatRenderer, CompletionRenderer, NativeRenderer
from firsttoken.wire.responses import ResponsesRenderer
from firsttoken.wire.sse import EventDecoder

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
# Every streaming format: another instance rebuilds its renderer (`wire/rebuild.py`).
_TAKEOVER_RENDERERS = (
    NativeRenderer,
    ChatRenderer,
    CompletionRenderer,
    ResponsesRenderer,
    MessagesRenderer,
)


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

    async def admit(self, key: ApiKey, generation: GenerationRequest) -> Ticket:
        """Admit the request once its prompt and limits are known: the key's token budget
        holds its prompt (counted here, once) plus its `max_tokens`."""
        prompt_tokens = self.engine.prompt_tokens(generation.prompt)
        ticket = await self.admission.admit(
            key, prompt_tokens, generation.max_tokens, generation.model
        )
        ticket.prompt_tokens = prompt_tokens
        ticket.request_id = generation.request_id  # the ledger's record of it
        return ticket

    def open_stream(
        self,
        generation: GenerationRequest,
        renderer: Renderer,
        *,
        kind: str,
        grace_s: float,
        trace: str,
        accepted_at: float,
        ticket: Ticket,
        coalesce: Coalesce,
        meta: bool,
        traceparent: str | None = None,
        takeover: bool = True,
    ) -> Stream:
        """A new stream with this server's resume, backpressure and chunking settings, for
        the request as admitted (`Ticket.max_tokens`, the prompt's count); `grace_s` is how
        long it outlives its last reader (its format's choice). `traceparent`
        (the client's) goes with the request, to its span and its upstream, with
        --trust-trace-headers; else the span only links to it. With a shared store, what
        another instance needs to continue it goes with it (`takeover`: False for a whole
        answer, which nobody could resume)."""
        s = self.settings
        limit = generation.max_tokens if ticket.max_tokens is None else ticket.max_tokens
        trusted = s.trust_trace_headers
        generation = generation.admitted(
            limit,
            ticket.prompt_tokens,
            trace,
            traceparent if trusted else None,
            None if trusted else traceparent,
        )
        self._check(generation, ticket)
        try:
            stream = Stream(
                generation,
                renderer,
                kind=kind,
                trace_id=trace,
                grace_s=grace_s,
                prompt_tokens=ticket.prompt_tokens,
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
        ticket.trace_id = trace
        ticket.own_latency = sets_own_latency(generation.options)
        stream.coalesce = self.coalesce_policy(coalesce)
        if meta:
            stream.meta_interval_s = s.meta_interval_ms / 1000
        if takeover and self.registry.store.replicates:
            stream.handover = self._handover(stream, generation)
            # A drain hands over only what its readers resume by themselves (SELF_RESUMING);
            # the handover still lets a reader elsewhere take over any stream of a dead owner.
            stream.movable = stream.handover is not None and kind in SELF_RESUMING
        return stream

    def _handover(self, stream: Stream, generation: GenerationRequest) -> bytes | None:
        """The stream's request, key, format and settings, as another instance rebuilds it
        (`reopen`); None when it cannot be taken over (over --takeover-max-bytes)."""
        renderer = stream.renderer
        if not isinstance(renderer, _TAKEOVER_RENDERERS):
            return None
        g = generation
        coalesce = stream.coalesce
        spec = {
            "request": {
                "prompt": g.prompt,
                "model": g.model,
                "max_tokens": g.max_tokens,
                "seed": g.seed,
                "temperature": g.temperature,
                "stop": g.stop,
                "messages": g.messages,
                "body": g.body,
                "options": g.options,
                "tenant": g.tenant,
            },
            "renderer": renderer.spec(),
            "prompt_tokens": stream.prompt_tokens,
            "grace_s": stream.grace_s,
            "coalesce": None
            if coalesce is None
            else {"max_wait_s": coalesce.max_wait_s, "max_bytes": coalesce.max_bytes},
            "meta_interval_s": stream.meta_interval_s,
            "held": self.admission.held(stream.ticket) if stream.ticket is not None else {},
            # Which of the name's secrets it was admitted with: a rotation's old one may go
            # while the stream runs, and a takeover must then refuse it as its owner would.
            "key_sha256": stream.ticket.key.digest.hex() if stream.ticket is not None else "",
        }
        try:
            handover = orjson.dumps(spec)
        except TypeError:  # an option no JSON can hold: the stream stays where it is
            return None
        return handover if len(handover) <= self.settings.takeover_max_bytes else None

    async def reopen(
        self, claim: Claim, mirror: Stream
    ) -> tuple[Stream, GenerationRequest | None, int]:
        """A stream another instance started, as it was there (`_handover`), with the events
        the store holds in its log, admitted here under its key (the entry of the secret it
        was started with); the request that continues it from the text those events carry
        (a splice: None when its max_tokens is spent), and the tokens generated before. What
        the registry continues when it takes the stream over.

        Billed here: all of the answer that the owners before did not bill (`Claim.billed`,
        left by one handed over; nothing by one SIGKILLed), priced at the route's target;
        also when the stream cannot go on here (the EngineError raised): its client got
        those tokens."""
        spec = orjson.loads(claim.handover)
        before = _billed(claim.billed)
        # First what the owner held (its slot is this stream's to take), settled with what
        # it billed; then, continued, ours for the rest of the answer.
        await self.admission.settle_taken(
            spec.get("held", {}), before.prompt + before.completion, owner_billed=bool(claim.billed)
        )
        try:
            return await self._rebuild(spec, claim, mirror, before)
        except EngineError:
            await self._bill_refused(spec, claim, mirror, before)
            raise

    async def _bill_refused(
        self, spec: dict[str, Any], claim: Claim, mirror: Stream, before: Usage
    ) -> None:
        """A taken-over stream that ends here refused: what its owners generated and did not
        bill (all of it after a SIGKILL), billed to its key as an `error` record."""
        made = sum(tokens for _, _, tokens in claim.events)
        await self._bill_unbilled(spec, mirror.id, mirror.trace_id, made, before, Outcome.ERROR)

    async def bill_orphaned(self, orphaned: Orphaned) -> None:
        """A stream of a dead instance that no reader took over, ended in the store by this
        instance's sweep (`RedisStore._sweep`): what its clients received (the tokens the
        store holds) and its owners did not bill, billed as an `orphaned` record, priced at
        the route's target; what its first owner held is settled, as a takeover does."""
        spec = orjson.loads(orphaned.handover)
        before = _billed(orphaned.billed)
        used = max(spec["prompt_tokens"], before.prompt) + max(orphaned.tokens, before.completion)
        await self.admission.settle_taken(
            spec.get("held", {}), used, owner_billed=bool(orphaned.billed)
        )
        await self._bill_unbilled(
            spec, orphaned.id, orphaned.trace_id, orphaned.tokens, before, Outcome.ORPHANED
        )

    async def _bill_unbilled(
        self,
        spec: dict[str, Any],
        stream_id: str,
        trace_id: str,
        made: int,
        before: Usage,
        outcome: Outcome,
    ) -> None:
        """Bill to the stream's key what its owners generated (`made` tokens) beyond what
        they billed (`before`), as one record of `outcome`: nothing when that is no token."""
        usage = Usage(
            max(0, spec["prompt_tokens"] - before.prompt), max(0, made - before.completion)
        )
        if not usage.completion:  # nothing generated, or all of it billed already
            return
        r = spec["request"]
        name = r["tenant"]
        key = self.admission.taken_key(name, spec.get("key_sha256", ""))
        key = key or self.admission.taken_key(name) or ApiKey(name=name)  # its secret gone
        ticket = self.admission.taken_ticket(key, r["model"])
        ticket.request_id = f"{stream_id}:{secrets.token_hex(4)}"
        ticket.trace_id = trace_id
        ticket.prompt_tokens = spec["prompt_tokens"]
        await ticket.release(outcome, usage)

    async def _rebuild(
        self, spec: dict[str, Any], claim: Claim, mirror: Stream, before: Usage
    ) -> tuple[Stream, GenerationRequest | None, int]:
        r = spec["request"]
        key = self.admission.taken_key(r["tenant"], spec.get("key_sha256", ""))
        if key is None:
            raise EngineError(
                "key_revoked", f"the API key {r['tenant']!r} it was started with is gone"
            )
        if r["model"] not in self.engine.models:
            raise EngineError("model_not_found", f"this instance does not serve {r['model']!r}")
        generation = GenerationRequest(
            request_id=mirror.id,
            prompt=r["prompt"],
            model=self.engine.models[self.engine.models.index(r["model"])],
            max_tokens=r["max_tokens"],
            seed=r["seed"],
            temperature=r["temperature"],
            stop=tuple(r["stop"]),
            messages=tuple(r["messages"]) if r["messages"] is not None else None,
            body=r["body"],
            options=r["options"],
            tenant=key.name,
            priority=key.priority,
            weight=key.weight,
        )
        s = self.settings
        stream = Stream(
            generation,
            rebuild(spec["renderer"]),
            kind=mirror.kind,
            trace_id=mirror.trace_id,
            grace_s=spec["grace_s"],
            prompt_tokens=spec["prompt_tokens"],
            max_events=s.resume_max_events,
            accepted_at=time.perf_counter(),
            window=s.stream_buffer_events,
        )
        stream.resume_token = ""  # only its digest travels
        stream.token_digest = mirror.token_digest
        if spec["coalesce"] is not None:
            stream.coalesce = CoalescePolicy(**spec["coalesce"])
        stream.meta_interval_s = spec["meta_interval_s"]
        stream.movable = mirror.kind in SELF_RESUMING
        transcript = _replay(stream, claim.events, spec["renderer"]["format"])
        why = transcript.why_not() if transcript.tokens else None
        if why is not None:
            raise EngineError("cannot_continue", why)
        following = continuation(generation, transcript) if transcript.tokens else generation
        remaining = following.max_tokens if following is not None else 0
        stream.billed_before = before
        try:
            ticket = await self.admission.admit(key, 0, remaining, generation.model)
        except APIError as exc:
            raise EngineError(exc.code, exc.message) from None
        stream.ticket = ticket
        # The ledger's record of the part billed here (an owner handed over recorded its own).
        ticket.request_id = f"{mirror.id}:{secrets.token_hex(4)}"
        self.admission.taken_legs(ticket, generation.model)
        ticket.trace_id = mirror.trace_id
        ticket.prompt_tokens = spec["prompt_tokens"]
        ticket.own_latency = sets_own_latency(generation.options)
        if following is not None:  # what the key's budget left it, as a new request's
            limit = following.max_tokens if ticket.max_tokens is None else ticket.max_tokens
            following = following.admitted(
                limit, spec["prompt_tokens"], mirror.trace_id, None, None
            )
        return stream, following, transcript.tokens

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

    def reader(self, stream: Stream, request: Request, **options: Any) -> EventStreamResponse:
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
        if found is not None and (key is None or key.may_use(found)):
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
    return request.app.state.gateway


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


def _billed(raw: bytes) -> Usage:
    """`Claim.billed` ("prompt completion reasoning"; b"": nothing billed yet)."""
    try:
        prompt, completion, reasoning = (int(n) for n in raw.split())
    except ValueError:  # none left: a SIGKILLed owner's
        return Usage()
    return Usage(prompt, completion, reasoning)


def _replay(stream: Stream, events: list[tuple[int, bytes, int]], format: str) -> Transcript:
    """Fill a taken-over stream's log with the events the store held, and read back what they
    carry: the answer's text to continue from, the tokens generated (its `carried` usage,
    billed where they were made), and its renderer's state (`wire/rebuild.py`)."""
    log = stream.log
    decoder = EventDecoder()
    parsed: list[tuple[str | None, bytes]] = []
    completion = 0
    for _, wire, tokens in events:
        log.append(wire, tokens)
        completion += tokens
        parsed += [(e.event, (e.data or "").encode()) for e in decoder.feed(wire)]
    deltas = list(decode(format, iter(parsed)))
    assert stream.renderer is not None
    replay(stream.renderer, deltas)  # type: ignore[arg-type]
    transcript = Transcript()
    for delta in deltas:
        transcript.add(delta)
    transcript.tokens = completion  # a coalesced event carries several tokens
    reasoning = sum(1 for d in deltas if d.reasoning)
    stream.tokens_generated = completion
    stream.reasoning_tokens = reasoning
    stream.carried = Usage(stream.prompt_tokens, completion, reasoning)
    if completion:
        stream.first_token_at = stream.accepted_at  # its first token was the other instance's
    return transcript
