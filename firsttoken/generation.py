"""The engine interface: the one thing the server knows about whatever generates tokens."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Protocol

# The deltas are the floor every room shares (the wire renders them, the core logs them):
# defined below the wire, named here too, where an engine looks for its interface.
from firsttoken.delta import Delta, ToolCallDelta

__all__ = [
    "DEFAULT_ANSWER_TOKENS",
    "ENDPOINTS",
    "TARGET_FAULTS",
    "BaseEngine",
    "Delta",
    "EmbeddingRequest",
    "Embeddings",
    "Engine",
    "EngineError",
    "Generation",
    "GenerationRequest",
    "Sink",
    "StepEngine",
    "ToolCallDelta",
    "from_stored",
    "not_embedding",
    "stored_request",
]


# The answer a request that names no max_tokens is taken to ask for: what admission reserves
# of a key's token budget and what the routes' fair queue charges it. One that runs longer is
# billed in full when it ends.
DEFAULT_ANSWER_TOKENS = 1024

# An upstream's 4xx that says the target is set up wrong (its key, its model name, its URL),
# not that the request is: another target may serve it, health counts it, and the client is
# not told it was its own fault. Every relay kind agrees (docs/engines.md, "Whose fault").
TARGET_FAULTS = frozenset({401, 403, 404})


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """One request as an engine gets it. Built by keyword only: `max_tokens` and `seed` (both
    `int | None`), and the three strings that open it, are each other's type; by position a
    swap would pass unnoticed. `stored_request` / `from_stored` are its JSON (a takeover's).
    """

    request_id: str
    prompt: str
    model: str
    max_tokens: int | None = None
    seed: int | None = None
    temperature: float | None = None
    stop: tuple[str, ...] = ()
    # Chat requests keep their messages ({"role", "content"} with string content) for engines
    # that apply their own chat template; `prompt` is the plain rendering.
    messages: tuple[Mapping[str, str], ...] | None = None
    # The request as a Chat Completions body, every field the client sent (tools, content
    # parts, response_format...), whatever API it came in by: what a relay forwards.
    body: Mapping[str, Any] | None = None
    # Engine-specific extras, e.g. the synthetic engine's per-request timing and faults.
    options: Mapping[str, Any] = field(default_factory=dict)
    # The API key's name that asked ("" on an open server), for engines that keep state per
    # caller: the answer cache keys its entries by it unless `--cache-scope shared`.
    tenant: str = ""
    # The key's place in a full target's queue (the keys file's `priority` and `weight`):
    # admission hands them down with the request.
    priority: int = 0
    weight: float = 1.0
    # The W3C trace context an upstream gets (`traceparent`): the client's own, or, with
    # --otlp-endpoint, the span of the upstream leg (the routes set it per leg).
    traceparent: str | None = None
    # The prompt's count as admission took it (once per request: a large prompt costs the
    # event loop to count), for whoever needs it after; None: not counted yet.
    prompt_tokens: int | None = None
    # The stream's trace id (its X-Request-Id): what an engine's log lines about it carry.
    trace_id: str = ""
    # A client's own traceparent that the gateway does not continue (no
    # --trust-trace-headers): the stream's span links to it instead.
    linked_traceparent: str | None = None

    def admitted(
        self,
        max_tokens: int | None,
        prompt_tokens: int,
        trace_id: str,
        traceparent: str | None,
        linked_traceparent: str | None,
    ) -> GenerationRequest:
        """This request as admitted: its answer's limit, its prompt's count, its trace."""
        request = _copy(self)
        _set_max_tokens(request, max_tokens)
        _set_prompt_tokens(request, prompt_tokens)
        _set_trace_id(request, trace_id)
        _set_traceparent(request, traceparent)
        _set_linked_traceparent(request, linked_traceparent)
        return request

    def without_inputs(self) -> GenerationRequest:
        """This request less what only its engine reads (prompt, messages, raw body, options):
        what a stream keeps once the engine has the request. A waiting stream would otherwise
        hold ~2 KiB of parsed body for its whole life."""
        request = _copy(self)
        _set_prompt(request, "")
        _set_messages(request, None)
        _set_body(request, None)
        _set_options(request, _NO_OPTIONS)
        return request


_NO_OPTIONS: Mapping[str, Any] = MappingProxyType({})

# The request is frozen to everyone else; a copy sets its slots directly, only ever on the
# fresh object. `without_inputs` runs once a stream: spelled out, one slot setter a field,
# a copy takes ~1.0 µs, where a loop over the fields takes ~2.3, the keyword constructor
# (a frozen dataclass sets each field through `object.__setattr__`) ~3.0 and
# `dataclasses.replace` ~3.9 (`timeit`, CPython 3.11). `tests/unit/test_base.py`
# checks that it copies every field.
_SET: dict[str, Callable[[GenerationRequest, Any], None]] = {
    f.name: GenerationRequest.__dict__[f.name].__set__ for f in fields(GenerationRequest)
}
_new = object.__new__
_set_request_id = _SET["request_id"]
_set_prompt = _SET["prompt"]
_set_model = _SET["model"]
_set_max_tokens = _SET["max_tokens"]
_set_seed = _SET["seed"]
_set_temperature = _SET["temperature"]
_set_stop = _SET["stop"]
_set_messages = _SET["messages"]
_set_body = _SET["body"]
_set_options = _SET["options"]
_set_tenant = _SET["tenant"]
_set_priority = _SET["priority"]
_set_weight = _SET["weight"]
_set_traceparent = _SET["traceparent"]
_set_prompt_tokens = _SET["prompt_tokens"]
_set_trace_id = _SET["trace_id"]
_set_linked_traceparent = _SET["linked_traceparent"]


def _copy(r: GenerationRequest) -> GenerationRequest:
    c: GenerationRequest = _new(GenerationRequest)
    _set_request_id(c, r.request_id)
    _set_prompt(c, r.prompt)
    _set_model(c, r.model)
    _set_max_tokens(c, r.max_tokens)
    _set_seed(c, r.seed)
    _set_temperature(c, r.temperature)
    _set_stop(c, r.stop)
    _set_messages(c, r.messages)
    _set_body(c, r.body)
    _set_options(c, r.options)
    _set_tenant(c, r.tenant)
    _set_priority(c, r.priority)
    _set_weight(c, r.weight)
    _set_traceparent(c, r.traceparent)
    _set_prompt_tokens(c, r.prompt_tokens)
    _set_trace_id(c, r.trace_id)
    _set_linked_traceparent(c, r.linked_traceparent)
    return c


def stored_request(request: GenerationRequest) -> dict[str, Any]:
    """What another instance needs of `request` to continue its stream (a takeover, a
    background response read elsewhere), as JSON: the inverse of `from_stored`. The field
    names are the stored format: instances of two versions take over each other's streams
    in a rolling deploy, so a name never changes, and a new field is optional to read."""
    return {
        "prompt": request.prompt,
        "model": request.model,
        "max_tokens": request.max_tokens,
        "seed": request.seed,
        "temperature": request.temperature,
        "stop": request.stop,
        "messages": request.messages,
        "body": request.body,
        "options": request.options,
        "tenant": request.tenant,
    }


def from_stored(
    stored: Mapping[str, Any],
    *,
    request_id: str,
    model: str,
    tenant: str,
    priority: int,
    weight: float,
) -> GenerationRequest:
    """The request `stored_request` stored, as `request_id` here: `model` as this instance
    names it, and the key it is admitted under here (its name, priority and weight)."""
    messages = stored["messages"]
    return GenerationRequest(
        request_id=request_id,
        prompt=stored["prompt"],
        model=model,
        max_tokens=stored["max_tokens"],
        seed=stored["seed"],
        temperature=stored["temperature"],
        stop=tuple(stored["stop"]),
        messages=tuple(messages) if messages is not None else None,
        body=stored["body"],
        options=stored["options"],
        tenant=tenant,
        priority=priority,
        weight=weight,
    )


class EngineError(Exception):
    """Generation failed; `code` and `message` go to the client as they are."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool = False,
        type_: str = "server_error",
        status: int | None = None,
        client_fault: bool = False,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.type = type_  # the error object's "type": whose doing it was
        # The HTTP status an upstream answered with (a whole answer passes a 4xx through).
        self.status = status
        # The request's own doing (an upstream's 4xx, a client-set fault, a bad
        # continuation): it says nothing about the engine, so health and the breaker ignore it.
        self.client_fault = client_fault
        self.retry_after_s = retry_after_s  # an upstream's Retry-After, when it sent one
        # An upstream's own error text, as it came (bounded): for the server's log only.
        self.upstream_said: str | None = None
        # The route's target that failed (set by the routes, e.g. the loser of a hedged pair).
        self.target: str | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """`POST /v1/embeddings`, as the engine gets it: the inputs (each a text, or token ids),
    and the client's body as sent (what a relay forwards: `dimensions`, `encoding_format`,
    `user`...), with `model` the name the engine knows. `endpoint` says which of OpenAI's
    one-body-in, one-body-out endpoints it is (`ENDPOINTS`): each goes the same way."""

    request_id: str
    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    body: Mapping[str, Any]
    tenant: str = ""
    trace_id: str = ""
    endpoint: str = "embeddings"


# The endpoints an `EmbeddingRequest` may name, and their paths under an upstream's /v1.
ENDPOINTS = {
    "embeddings": "/embeddings",
    "moderations": "/moderations",
    "images": "/images/generations",
}


@dataclass(frozen=True, slots=True)
class Embeddings:
    """The answer: the OpenAI `list` object as the client gets it (its `model` the one the
    client asked for), what its inputs counted, and the route's target that answered."""

    body: dict[str, Any]
    prompt_tokens: int
    target: str | None = None


class Engine(Protocol):
    """An async iterator of deltas per request, abort by id, and a count of tokens made.

    Every method a caller uses is here: nobody asks an engine with `getattr` what it can do.
    `BaseEngine` holds the defaults of those only some engines have (up-front checks, an
    upstream's model list, steps)."""

    @property
    def models(self) -> tuple[str, ...]: ...

    @property
    def tokens_generated(self) -> int: ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]: ...

    async def abort(self, request_id: str) -> None: ...

    def prompt_tokens(self, prompt: str) -> int: ...

    def counters(self) -> Mapping[str, int]:
        """Engine-specific counters for /metrics (e.g. the relay's `failovers`)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def check(self, request: GenerationRequest) -> None:
        """Raise EngineError for what this engine would refuse before it sends anything (an
        in-process engine's bad continuation): the API answers it as a 4xx."""
        ...

    async def fetch_models(self) -> tuple[str, ...] | None:
        """Ask the engine now what it serves: a remote engine's GET /models, None when its
        upstream did not answer (the routes' active health check)."""
        ...

    @property
    def listed(self) -> tuple[str, ...] | None:
        """What the engine's upstream listed when last asked; None: no upstream, or no
        answer."""
        ...

    def as_step_engine(self) -> StepEngine | None:
        """This engine, when it runs its requests in steps and writes into their sinks itself;
        None: it offers `generate()` only, and a task per request pulls it."""
        ...

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        """The inputs' embeddings; EngineError `embeddings_not_served` (404) from an engine
        that has none."""
        ...

    def has_prompt(self, request_id: str) -> bool:
        """Whether the engine has taken the running request's prompt (a routed one: it holds
        its target's slot, not waiting in the queue): a client that leaves before the first
        token is billed the prompt, as an upstream bills it, when it has. Asked as the
        stream ends."""
        ...


class BaseEngine:
    """The defaults of `Engine`'s capabilities that only some engines have: an engine
    subclasses it and overrides what it does otherwise."""

    listed: tuple[str, ...] | None = None  # no upstream to list models

    def check(self, request: GenerationRequest) -> None:
        return None  # nothing it can tell before it runs

    async def fetch_models(self) -> tuple[str, ...] | None:
        return ()  # no upstream to ask: an in-process engine is up while the process is

    def as_step_engine(self) -> StepEngine | None:
        return None

    def has_prompt(self, request_id: str) -> bool:
        return True  # no queue of its own: a started request's prompt is being read

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        raise not_embedding(request.model, request.endpoint)


def not_embedding(model: str, endpoint: str = "embeddings") -> EngineError:
    return EngineError(
        f"{endpoint}_not_served",
        f"model {model!r} is served here for text, not for {endpoint}",
        type_="invalid_request_error",
        status=404,
        client_fault=True,
    )


class Sink(Protocol):
    """Where a step engine delivers one request's output: a stream.

    Called synchronously from the engine's step (no await, no task wakeup per token).
    """

    def push(self, text: str, finish: str | None = None) -> bool:
        """One token; the last one carries the finish reason (and ends the request). False
        asks the engine to pause this request until `resume()`."""
        ...

    def push_delta(self, delta: Delta) -> bool:
        """A structured delta (reasoning, tool-call fragment, refusal...); as `push`."""
        ...

    def finish(self, reason: str) -> None: ...

    def fail(self, error: EngineError) -> None: ...


class Generation(Protocol):
    """A step engine's handle on one running request."""

    def resume(self) -> None:
        """Go on after `Sink.push` returned False."""
        ...

    def cancel(self) -> None:
        """Stop now: the sink hears nothing more, and the request's slot is free."""
        ...


class StepEngine(Engine, Protocol):
    """An engine that runs its requests in steps and writes each step's tokens into the
    requests' sinks itself (the synthetic engine on one shared clock, the batching scheduler).
    Engines that only offer `generate()` are pulled by a task per request instead."""

    def open(self, request: GenerationRequest, sink: Sink) -> Generation: ...
