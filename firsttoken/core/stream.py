"""One `Stream` per answer generated here: the engine's sink, and what its readers read.

A stream is the engine's sink: a step engine calls `push` for each token from inside its
step, and the stream frames the event (`Framer`), appends it to its log, and the log hands it
to the caught-up readers, which write it to their sockets, all in that one call. Engines that
can only be iterated (the relay, llama.cpp, the cache) are pulled by one task per stream
instead.

Generation can outlive a dropped connection for the resume grace window, and stops the moment
the stream is stopped: by the cancel endpoint, or when the last reader leaves and the grace
runs out. Stopping is synchronous (the engine hears `cancel()` before its next step), and
ending is one path (`_end`) whatever the outcome.

Readers read a `BaseStream`: a `Stream`, or a `Mirror` (core/mirror.py) of a stream another
instance generates, whose events come from the shared store instead of an engine.
"""

from __future__ import annotations

import hmac
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, Protocol

import orjson

from firsttoken.core.chunking import CoalescePolicy
from firsttoken.core.framer import SHOWS_META, Framer
from firsttoken.core.usage import Usage, reported, usage_of, with_carried
from firsttoken.eventlog import EventLog
from firsttoken.formats.sse import event_id_of
from firsttoken.generation import Delta, EngineError, Generation, GenerationRequest
from firsttoken.resume import EventStore, StreamRecord, token_digest

__all__ = [
    "AdmissionTicket",
    "BaseStream",
    "Keeper",
    "Outcome",
    "Renderer",
    "Stream",
    "Usage",
]

_dumps = orjson.dumps


class Outcome(StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    DISCONNECTED = "disconnected"
    ERROR = "error"
    # Not an end of the answer: another instance goes on with it (a hand-over at shutdown,
    # or a takeover this instance learned of late). Counted apart from the others.
    MOVED = "moved"
    # Only in the ledger: what a dead instance's stream delivered, billed by the survivor that
    # swept it (no reader came back to take it over; `RedisStore._sweep`). No stream ends so.
    ORPHANED = "orphaned"


# Formats whose readers resume by themselves (`Last-Event-ID`: an EventSource, the native
# client): their streams may move to another instance under them. Any other format's reader
# holds one connection for one answer (the OpenAI and Anthropic SDKs): a drain finishes its
# stream on that connection, and it is never let go without the format's error event.
SELF_RESUMING = frozenset({"native"})

Events = Sequence[tuple[str | None, bytes]]


class Renderer(Protocol):
    """Turns engine output into the data payloads of one API's events.

    Each method returns the data payloads (bytes) and the event name (None for `data:` only);
    the stream's framer frames them with their sequence id and appends them to the log.
    `token` is the hot path: a precomputed prefix + the JSON-escaped text + a suffix.
    """

    def opening(self) -> Events: ...

    @property
    def token_event(self) -> str | None:
        """The event name of token events (None: plain `data:`)."""
        ...

    def begin_text(self) -> Events:
        """What goes before answer text that follows something else (or nothing): e.g. a
        content block's start. Empty for formats without blocks."""
        ...

    def token(self, text: str) -> bytes: ...

    def token_template(self) -> tuple[bytes, bytes] | None:
        """The bytes around a text token's JSON string, for the stream to frame once per
        text run; None when every token must go through `token` (a renderer that keeps
        the text)."""
        ...

    def part(self, delta: Delta) -> Events:
        """A structured delta's events: reasoning, tool-call fragments, refusal."""
        ...

    def closing(self, finish_reason: str, usage: dict[str, Any]) -> Events: ...

    def error(self, code: str, message: str, type_: str = "server_error") -> Events:
        """The events that end a failed stream (at least an `event: error`)."""
        ...


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class AdmissionTicket(Protocol):
    """What admission hands a stream: told of its first token and of its end."""

    client_fault: bool  # set when the stream's error was the request's own doing

    @property
    def key(self) -> _Named:
        """The API key it was admitted for (its name goes into log lines)."""
        ...

    def first_token(self, ttft_s: float) -> None: ...

    def seam(self, meta: Mapping[str, Any]) -> None: ...

    def prompt_read(self) -> None:
        """Its client left before the first token, after an engine read the prompt: which
        target did is asked now, while the route still knows (its prompt is billed there)."""
        ...

    async def release(self, outcome: Outcome, usage: Usage | None = None) -> None: ...


class Keeper(Protocol):
    """The registry, as a stream generated here tells it that its last reader left."""

    def unread(self, stream: Stream) -> None: ...


class BaseStream(ABC):
    """What a reader reads: a stream's identity, its event log, and who reads it. A
    `Stream` (generated here) or a `Mirror` (read here from the shared store)."""

    __slots__ = (
        "_abandon_epoch",
        "_digest",
        "delivered_seq",
        "format",
        "generation",
        "id",
        "last_content_at",
        "log",
        "outcome",
        "readers",
        "request",
        "tokens_sent",
        "trace_id",
    )

    def __init__(
        self, request: GenerationRequest, format: str, trace_id: str, log: EventLog
    ) -> None:
        self.id = request.request_id
        self.request = request
        self.format = format  # the API format: "native" | "openai" | "responses" | "anthropic"
        self.trace_id = trace_id
        self.log = log
        self._digest: str | None = None  # sha256 of the resume token: made when needed
        self.delivered_seq = 0  # highest seq written to any reader: later writes are replays
        self.tokens_sent = 0
        self.last_content_at = 0.0
        self.readers = 0
        self._abandon_epoch = 0
        self.outcome: Outcome | None = None
        # What produces its events: the engine's request here, a tail of the store for a
        # mirror. Cancelled to stop.
        self.generation: Generation | None = None

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    @property
    def token_digest(self) -> str:
        digest = self._digest
        assert digest is not None  # a Stream makes it from its token; a Mirror is given it
        return digest

    @token_digest.setter
    def token_digest(self, digest: str) -> None:
        self._digest = digest  # a mirror, or a stream taken over, knows only the digest

    def check_token(self, token: str | None) -> bool:
        if token is None:
            return False
        return hmac.compare_digest(token_digest(token), self.token_digest)

    @abstractmethod
    def error_events(self, code: str, message: str) -> Events:
        """The events that tell its readers it ended here with `code` (a reader let go)."""

    @abstractmethod
    def stop(self, reason: Outcome, error: EngineError | None = None) -> None:
        """Stop what produces its events (no-op once ended)."""

    @abstractmethod
    def move(self) -> None:
        """Let its readers go, to come back to another instance with Last-Event-ID."""

    @abstractmethod
    async def cancel(self, store: EventStore) -> str:
        """Stop its generation, wherever that runs (`store`: where another instance hears
        of it); returns the outcome, or "cancelling"."""

    @abstractmethod
    def last_reader_left(self, keeper: Keeper) -> None:
        """Its last reader left: a stream's grace starts (`keeper.unread`), a mirror's tail
        stops."""


class Stream(BaseStream):
    """A generation and its event log; the engine's sink for this request."""

    # Slots: ten thousand waiting streams each save the ~1.2 KiB of an instance dict.
    __slots__ = (
        "_frame",
        "_framer",
        "_text",
        "accepted_at",
        "billed_before",
        "carried",
        "coalesce",
        "counted",
        "error_code",
        "error_status",
        "finish_reason",
        "first_generated_at",
        "first_token_at",
        "grace_s",
        "handover",
        "last_meta_at",
        "logged_finish",
        "meta_interval_s",
        "movable",
        "on_end",
        "on_first_token",
        "prompt_tokens",
        "reasoning_tokens",
        "renderer",
        "resume_token",
        "ticket",
        "tokens_generated",
    )

    def __init__(
        self,
        request: GenerationRequest,
        renderer: Renderer,
        *,
        format: str,
        trace_id: str,
        grace_s: float,
        prompt_tokens: int,
        max_events: int,
        accepted_at: float,
        window: int | None = None,
    ) -> None:
        log = EventLog(max_events, window)
        super().__init__(request, format, trace_id, log)
        self.renderer = renderer
        self._framer = Framer(renderer, log, shows_meta=format in SHOWS_META)
        self.grace_s = grace_s
        self.prompt_tokens = prompt_tokens
        self.resume_token = secrets.token_urlsafe(24)
        self.accepted_at = accepted_at
        self.first_token_at: float | None = None
        self.tokens_generated = 0
        self.reasoning_tokens = 0
        self.counted: Mapping[str, Any] | None = None  # the engine's own usage, at the finish
        self.error_code: str | None = None
        self.error_status: int | None = None  # an upstream's HTTP status, for a whole answer
        self.finish_reason: str | None = None  # set by `finish`
        self.logged_finish = False
        self.ticket: AdmissionTicket | None = None
        self.coalesce: CoalescePolicy | None = None  # None: one event per token
        self.meta_interval_s: float | None = None  # None: no progress events
        self.last_meta_at = 0.0
        self.first_generated_at: float | None = None
        self.on_end: Callable[[Stream], None] | None = None  # the registry's bookkeeping
        self.on_first_token: Callable[[Stream, float], None] | None = None
        # The hot path's per-token frame: the text run's template while nothing else
        # watches its tokens (`Framer.hot`); None otherwise.
        self._frame: bytes | None = None
        # What takes a text token in the current run (the framer's `text` or `coalesce`);
        # None between runs: the next text token enters one.
        self._text: Callable[[str], None] | None = None
        # Redis mode: what another instance needs to continue this stream (`StreamRecord`),
        # until the store has it; and whether another instance can continue it.
        self.handover: bytes | None = None
        self.movable = False
        # Taken over: what the instances before generated, and what of it they billed (a
        # SIGKILLed owner billed none: this instance bills the rest, `registry._own_usage`).
        self.carried: Usage | None = None
        self.billed_before: Usage | None = None

    @property
    def token_digest(self) -> str:
        if self._digest is None:
            self._digest = token_digest(self.resume_token)
        return self._digest

    @token_digest.setter
    def token_digest(self, digest: str) -> None:
        self._digest = digest  # taken over: only the digest came with it

    @property
    def id_base(self) -> int:
        """What the ids of the events it makes add to their seq: 0, unless another instance
        made its first events (`number_as`, a takeover)."""
        return self._framer.id_base

    def check_token(self, token: str | None) -> bool:
        if token is None:
            return False
        if not self.resume_token:  # taken over: only the digest came with it
            return hmac.compare_digest(token_digest(token), self.token_digest)
        return hmac.compare_digest(token.encode(), self.resume_token.encode())

    def record(self) -> StreamRecord:
        return StreamRecord(
            self.id,
            self.format,
            self.token_digest,
            self.trace_id,
            self.request.model,
            self.handover,
            self.request.tenant,
        )

    # -- the engine's sink -----------------------------------------------------------------

    def begin(self) -> None:
        """Append the opening events; called once, before the engine starts."""
        self._framer.opening(self.coalesce)

    def _enter_text(self) -> Callable[[str], None]:
        """Answer text starts (or starts again after reasoning or a tool call): what takes
        its tokens from now on, and the hot path's frame when nothing else watches them."""
        framer = self._framer
        if self.meta_interval_s is not None:  # progress events watch the text
            framer.on_text = self._progress  # a cycle, broken by `Framer.close`
        self._text = text = framer.enter_text()
        if framer.hot():
            self._frame = framer.template  # from now on, tokens take the hot path
        return text

    def number_as(self, fence: int) -> None:
        """Number the events made from now on as the owner of `fence` (a takeover): their
        ids say which instance made them (`formats.sse.ids_from`)."""
        framer = self._framer
        framer.number_as(fence)
        if self._frame is not None:
            self._frame = framer.template

    def has_event(self, seq: int, event_id: int) -> bool:
        """Whether this stream's event `seq` carries `event_id`, as kept here or as it will
        be numbered: a reader back with the id of its last event reads on only from the same
        event (`resume.Resumed`). True where it cannot tell (no longer kept)."""
        log = self.log
        if seq > log.last_seq:
            return not log.closed and event_id == seq + self._framer.id_base
        wire = log.wire(seq)
        if wire is None:
            return True
        return event_id_of(wire) in (event_id, None)

    def push(self, text: str, finish: str | None = None) -> bool:
        """One token from the engine (the last one with its finish reason). Returns False
        when the readers are a window behind: the engine pauses this request until the log
        calls `generation.resume()`."""
        frame = self._frame
        if frame is not None and finish is None and self.outcome is None:
            # The hot path: one template, one append (the log hands it to the writers).
            self.tokens_generated += 1
            log = self.log
            log.append(frame % (log.last_seq + 1, _dumps(text)), 1)
            if log.has_room():  # _room(), inlined: this runs once per token
                return True
            if self.generation is not None:
                log.on_room = self.generation.resume
            return False
        if self.outcome is not None:
            return False
        first = self.first_token_at is None
        if first:
            self.first_token_at = time.perf_counter()
        if finish is not None:
            # The last token and the closing events leave in one write.
            self.log.cork()
            try:
                self.push(text)
                self.finish(finish)
            finally:
                self.log.uncork()
            if first:
                self._first_token()
            return False
        self.tokens_generated += 1
        take = self._text
        if take is None:
            take = self._enter_text()
        take(text)
        if first:
            self._first_token()  # reported once the token is on its way
        return self._room()

    def push_delta(self, delta: Delta) -> bool:
        """Any delta: answer text goes to `push`, a bare finish to `finish`. A structured one
        (reasoning, a tool-call fragment, a refusal...) is never merged with text, and it
        ends the text run, so the next text token re-enters it."""
        if not delta.structured:
            if delta.text:
                return self.push(delta.text, delta.finish_reason)
            if delta.finish_reason is not None:
                self.finish(delta.finish_reason, delta.usage)
            return self.outcome is None
        if self.outcome is not None:
            return False
        if delta.meta is not None:
            if self.ticket is not None:  # a splice or hand-off: where the next leg begins
                self.ticket.seam(delta.meta)
            # News about the stream (a splice), not a token: the formats that show it.
            if self._framer.meta(delta.meta):
                self._text = None
                self._frame = None
            return self._room()
        first = self.first_token_at is None
        if first:
            self.first_token_at = time.perf_counter()
        if delta.finish_reason is None:
            self._part(delta)
        else:
            self.log.cork()  # the last delta and the closing events leave in one write
            try:
                self._part(delta)
                self.finish(delta.finish_reason, delta.usage)
            finally:
                self.log.uncork()
        if first:
            self._first_token()  # reported once the delta is on its way
        return self.outcome is None and self._room()

    def _part(self, delta: Delta) -> None:
        self._text = None
        self._frame = None
        self.tokens_generated += 1
        if delta.reasoning:
            self.reasoning_tokens += 1
        self._framer.part(delta)

    def finish(self, reason: str, counted: Mapping[str, Any] | None = None) -> None:
        """The answer is complete; `counted` is the engine's own usage, when it has one
        (an upstream's tokenizer counts better than our deltas do)."""
        if self.outcome is not None:
            return
        self.finish_reason = reason
        usage = reported(self.prompt_tokens, self.tokens_generated, self.reasoning_tokens)
        if counted and isinstance(counted.get("completion_tokens"), int):
            if self.carried is not None:  # the engine counted only what it made here
                counted = with_carried(counted, self.carried)
            usage = dict(counted)
            self.counted = counted
        self._framer.closing(reason, usage)
        self._end(Outcome.COMPLETED, None)

    def usage(self) -> Usage:
        """What the answer used: the engine's own count when it gave one at the finish (an
        upstream's tokenizer, its cached prompt tokens), else this stream's. A stream cut
        before its finish counts what was generated until then."""
        return usage_of(
            self.counted, self.prompt_tokens, self.tokens_generated, self.reasoning_tokens
        )

    def fail(self, error: EngineError) -> None:
        if self.outcome is not None:
            return
        self._framer.flush()  # keep what arrived, even before an error
        self._end(Outcome.ERROR, error)

    def move(self) -> None:
        """Stop generating here without ending the answer: another instance goes on with it
        from what the shared store holds. Readers get what the log has, then their connection
        ends without a last event, and they come back with Last-Event-ID."""
        if self.outcome is not None:
            return
        if self.generation is not None:
            self.generation.cancel()
        framer = self._framer
        framer.flush()
        framer.close()
        self.outcome = Outcome.MOVED
        self.log.on_room = None
        self.log.close()
        if self.on_end is not None:
            self.on_end(self)
        self.generation = None

    def stop(self, reason: Outcome, error: EngineError | None = None) -> None:
        """Stop generation now; readers still attached learn why (no-op once ended)."""
        if self.outcome is not None:
            return
        if self.generation is not None:
            self.generation.cancel()
        self._framer.flush()
        if error is None:
            code, message, type_ = _STOPPED.get(reason, _STOPPED_ANY)
            error = EngineError(code, message, type_=type_)
        self._end(reason, error)

    async def cancel(self, store: EventStore) -> str:
        self.stop(Outcome.CANCELLED)  # synchronous: the stream has ended when it returns
        return self.outcome.value if self.outcome else "cancelling"

    def error_events(self, code: str, message: str) -> Events:
        return self.renderer.error(code, message)

    def last_reader_left(self, keeper: Keeper) -> None:
        keeper.unread(self)

    # -- internals -------------------------------------------------------------------------

    def _room(self) -> bool:
        """Whether the engine may go on; if not, the log resumes it when readers catch up."""
        log = self.log
        if log.has_room():
            return True
        generation = self.generation
        if generation is not None:
            log.on_room = generation.resume
        return False

    def _first_token(self) -> None:
        """TTFT is the engine's: from the request's first byte to its first token
        (`first_token_at`, stamped as it arrived), whenever (or whether) a reader is there to
        take it. Reported (metric, shedding guard, log line) after the token was written."""
        first_token_at = self.first_token_at
        if self.on_first_token is not None and first_token_at is not None:
            self.on_first_token(self, first_token_at - self.accepted_at)

    def _end(self, outcome: Outcome, error: EngineError | None) -> None:
        self._framer.close()
        self.outcome = outcome
        if error is not None:
            self.error_code = error.code
            self.error_status = error.status  # before the event: a collector reads it there
            self._framer.error(error.code, error.message, error.type)
            if error.client_fault and self.ticket is not None:
                self.ticket.client_fault = True
        self.log.on_room = None
        self.log.close()
        if self.on_end is not None:
            self.on_end(self)
        # The generation holds the stream as its sink: without this cycle a finished stream
        # goes with its last reference, not at the next full garbage collection.
        self.generation = None

    def _progress(self) -> None:
        """After each text event, with progress events (`meta_interval_s`): one every
        interval, counting from the first."""
        now = time.perf_counter()
        if self.first_generated_at is None:
            self.first_generated_at = now
        elif self.meta_interval_s is not None and now - self.last_meta_at >= self.meta_interval_s:
            self.last_meta_at = now
            self._framer.append("meta", _progress(self, now))


# A stream stopped by its reader's doing is not a server error: the type says whose it was.
_STOPPED_ANY = ("stopped", "the stream was stopped", "server_error")
_STOPPED = {
    Outcome.CANCELLED: ("cancelled", "the stream was cancelled", "cancelled"),
    Outcome.DISCONNECTED: (
        "stream_abandoned",
        "no reader came back within the grace window",
        "abandoned",
    ),
}


def _progress(stream: Stream, now: float) -> bytes:
    tokens = stream.tokens_generated
    limit = stream.request.max_tokens
    first = stream.first_generated_at or now
    elapsed = now - first
    return orjson.dumps(
        {
            "tokens": tokens,
            "remaining": None if limit is None else max(0, limit - tokens),
            "speed": round((tokens - 1) / elapsed, 1) if elapsed > 0 and tokens > 1 else None,
            "elapsed_ms": round((now - stream.accepted_at) * 1000, 1),
        }
    )
