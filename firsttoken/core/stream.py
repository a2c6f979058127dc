"""One `Stream` per answer, and the registry that starts, stops and expires them.

A stream is the engine's sink: a step engine calls `push` for each token from inside its
step, and the stream renders the event, appends it to its log, and the log hands it to the
caught-up readers, which write it to their sockets, all in that one call. Engines that can
only be iterated (the relay, llama.cpp, the cache) are pulled by one task per stream instead.

Generation can outlive a dropped connection for the resume grace window, and stops the moment
the stream is stopped: by the cancel endpoint, or when the last reader leaves and the grace
runs out. Stopping is synchronous (the engine hears `cancel()` before its next step), and
ending is one path (`_end`) whatever the outcome.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, NamedTuple, Protocol

import orjson

from firsttoken.core.chunking import Chunk, CoalescePolicy, Coalescer
from firsttoken.eventlog import EventLog
from firsttoken.generation import Delta, EngineError, Generation, GenerationRequest
from firsttoken.resume import StreamRecord, token_digest
from firsttoken.wire.sse import DATA_FRAME, encode_event, event_id_of, ids_from, token_frame

__all__ = ["AdmissionTicket", "Outcome", "Renderer", "Stream", "Usage"]

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


class Renderer(Protocol):
    """Turns engine output into the data payloads of one API's events.

    Each method returns the data payloads (bytes) and the event name (None for `data:` only);
    the stream frames them with their sequence id and appends them to the log. `token` is the
    hot path: a precomputed prefix + the JSON-escaped text + a suffix.
    """

    def opening(self) -> Sequence[tuple[str | None, bytes]]: ...

    @property
    def token_event(self) -> str | None:
        """The event name of token events (None: plain `data:`)."""
        ...

    def begin_text(self) -> Sequence[tuple[str | None, bytes]]:
        """What goes before answer text that follows something else (or nothing): e.g. a
        content block's start. Empty for formats without blocks."""
        ...

    def token(self, text: str) -> bytes: ...

    def token_template(self) -> tuple[bytes, bytes] | None:
        """The bytes around a text token's JSON string, for the stream to frame once per
        text run; None when every token must go through `token` (a renderer that keeps
        the text)."""
        ...

    def part(self, delta: Delta) -> Sequence[tuple[str | None, bytes]]:
        """A structured delta's events: reasoning, tool-call fragments, refusal."""
        ...

    def closing(
        self, finish_reason: str, usage: dict[str, Any]
    ) -> Sequence[tuple[str | None, bytes]]: ...

    def error(
        self, code: str, message: str, type_: str = "server_error"
    ) -> Sequence[tuple[str | None, bytes]]:
        """The events that end a failed stream (at least an `event: error`)."""
        ...


class Usage(NamedTuple):
    """What one answer used, in tokens: what its key is billed and counted for."""

    prompt: int = 0
    completion: int = 0  # reasoning included, as OpenAI counts it
    reasoning: int = 0
    cached: int = 0  # prompt tokens the upstream read from its cache (part of `prompt`)
    cache_write: int = 0  # prompt tokens the upstream wrote to its cache (part of `prompt`)


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


class Stream:
    """A generation and its event log; the engine's sink for this request."""

    # Slots: ten thousand waiting streams each save the ~1.2 KiB of an instance dict.
    __slots__ = (
        "_abandon_epoch",
        "_coalescer",
        "_digest",
        "_flush_timer",
        "_frame",
        "_in_text",
        "_template",
        "_token_event",
        "accepted_at",
        "billed_before",
        "carried",
        "coalesce",
        "counted",
        "delivered_seq",
        "error_code",
        "error_status",
        "finish_reason",
        "first_generated_at",
        "first_token_at",
        "generation",
        "grace_s",
        "handover",
        "id",
        "id_base",
        "kind",
        "last_content_at",
        "last_meta_at",
        "log",
        "logged_finish",
        "meta_interval_s",
        "movable",
        "on_end",
        "on_first_token",
        "outcome",
        "prompt_tokens",
        "readers",
        "reasoning_tokens",
        "renderer",
        "request",
        "resume_token",
        "ticket",
        "tokens_generated",
        "tokens_sent",
        "trace_id",
    )

    def __init__(
        self,
        request: GenerationRequest,
        renderer: Renderer | None,
        *,
        kind: str,
        trace_id: str,
        grace_s: float,
        prompt_tokens: int,
        max_events: int,
        accepted_at: float,
        window: int | None = None,
    ) -> None:
        self.id = request.request_id
        self.request = request
        self.renderer = renderer
        self.kind = kind  # "native" | "openai"
        self.trace_id = trace_id
        self.grace_s = grace_s
        self.prompt_tokens = prompt_tokens
        self.resume_token = secrets.token_urlsafe(24)
        self._digest: str | None = None  # sha256 of the token: made when Redis needs it
        self.log = EventLog(max_events, window)
        self.accepted_at = accepted_at
        self.first_token_at: float | None = None
        self.last_content_at = 0.0
        self.delivered_seq = 0  # highest seq written to any reader: later writes are replays
        self.tokens_generated = 0
        self.reasoning_tokens = 0
        self.counted: Mapping[str, Any] | None = None  # the engine's own usage, at the finish
        self.tokens_sent = 0
        self.readers = 0
        self.outcome: Outcome | None = None
        self.error_code: str | None = None
        self.error_status: int | None = None  # an upstream's HTTP status, for a whole answer
        self.finish_reason: str | None = None  # set by `finish`
        self.logged_finish = False
        self.ticket: AdmissionTicket | None = None
        self.coalesce: CoalescePolicy | None = None  # None: one event per token
        self.meta_interval_s: float | None = None  # None: no progress events
        self.last_meta_at = 0.0
        self.first_generated_at: float | None = None
        self.generation: Generation | None = None
        self.on_end: Callable[[Stream], None] | None = None  # the registry's bookkeeping
        self.on_first_token: Callable[[Stream, float], None] | None = None
        self._template: bytes | None = None  # the hot path's, armed by the first token
        self._coalescer: Coalescer | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._token_event = renderer.token_event if renderer is not None else None
        self._frame: bytes | None = None  # the hot path's per-token template (see begin())
        self._in_text = False  # the last event was answer text (its template is current)
        self._abandon_epoch = 0
        # What the ids of the events it makes add to their seq: 0, unless another instance
        # made its first events (`number_as`, a takeover).
        self.id_base = 0
        # Redis mode: what another instance needs to continue this stream (`StreamRecord`),
        # until the store has it; and whether another instance can continue it.
        self.handover: bytes | None = None
        self.movable = False
        # Taken over: what the instances before generated, and what of it they billed (a
        # SIGKILLed owner billed none: this instance bills the rest, `registry._own_usage`).
        self.carried: Usage | None = None
        self.billed_before: Usage | None = None

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    @property
    def token_digest(self) -> str:
        if self._digest is None:
            self._digest = token_digest(self.resume_token)
        return self._digest

    @token_digest.setter
    def token_digest(self, digest: str) -> None:
        self._digest = digest  # a mirror knows only the digest

    def check_token(self, token: str | None) -> bool:
        if token is None:
            return False
        if not self.resume_token:  # taken over: only the digest came with it
            return hmac.compare_digest(token_digest(token), self.token_digest)
        return hmac.compare_digest(token.encode(), self.resume_token.encode())

    def record(self) -> StreamRecord:
        return StreamRecord(
            self.id,
            self.kind,
            self.token_digest,
            self.trace_id,
            self.request.model,
            self.handover,
            self.request.tenant,
        )

    # -- the engine's sink -----------------------------------------------------------------

    def begin(self) -> None:
        """Append the opening events; called once, before the engine starts."""
        assert self.renderer is not None
        if self.coalesce is not None:
            self._coalescer = Coalescer(self.coalesce)
        for name, data in self.renderer.opening():
            self._append(name, data)

    def _enter_text(self) -> None:
        """Answer text starts (or starts again after reasoning or a tool call): the
        renderer's opening for it, and the frame its tokens take from now on."""
        renderer = self.renderer
        assert renderer is not None
        for name, data in renderer.begin_text():
            self._append(name, data)
        self._in_text = True
        self._template = None
        template = renderer.token_template()
        if template is not None:
            # One %-format per token (or per coalesced chunk).
            self._template = token_frame(self._token_event, *template, self.id_base)
        if self._coalescer is None and self.meta_interval_s is None:
            self._frame = self._template  # from now on, tokens take the hot path

    def number_as(self, fence: int) -> None:
        """Number the events made from now on as the owner of `fence` (a takeover): their
        ids say which instance made them (`wire.sse.ids_from`)."""
        self.id_base = ids_from(fence)
        if self._template is not None and self.renderer is not None:
            template = self.renderer.token_template()
            framed = (
                None
                if template is None
                else token_frame(self._token_event, *template, self.id_base)
            )
            if self._frame is self._template:
                self._frame = framed
            self._template = framed

    def has_event(self, seq: int, event_id: int) -> bool:
        """Whether this stream's event `seq` carries `event_id`, as kept here or as it will
        be numbered: a reader back with the id of its last event reads on only from the same
        event (`resume.Resumed`). True where it cannot tell (no longer kept)."""
        log = self.log
        if seq > log.last_seq:
            return not log.closed and event_id == seq + self.id_base
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
        if not self._in_text:
            self._enter_text()
        if self._coalescer is None:
            self._emit(text, 1)
        else:
            self._coalesce(text)
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
            # News about the stream (a splice), not a token: native readers see it.
            if self.kind == "native":
                self._flush_pending()
                self._in_text = False
                self._frame = None
                self._append("meta", _dumps(delta.meta))
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
        self._flush_pending()
        self._in_text = False
        self._frame = None
        self.tokens_generated += 1
        if delta.reasoning:
            self.reasoning_tokens += 1
        assert self.renderer is not None
        events = self.renderer.part(delta)
        last = len(events) - 1
        for i, (name, data) in enumerate(events):
            self._append(name, data, 1 if i == last else 0)

    def finish(self, reason: str, counted: Mapping[str, Any] | None = None) -> None:
        """The answer is complete; `counted` is the engine's own usage, when it has one
        (an upstream's tokenizer counts better than our deltas do)."""
        if self.outcome is not None:
            return
        self.finish_reason = reason
        self._flush_pending()
        assert self.renderer is not None
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens_generated,
            "total_tokens": self.prompt_tokens + self.tokens_generated,
        }
        if self.reasoning_tokens:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        if counted and isinstance(counted.get("completion_tokens"), int):
            if self.carried is not None:  # the engine counted only what it made here
                counted = _with_carried(counted, self.carried)
            usage = dict(counted)
            self.counted = counted
        for name, data in self.renderer.closing(reason, usage):
            self._append(name, data)
        self._end(Outcome.COMPLETED, None)

    def usage(self) -> Usage:
        """What the answer used: the engine's own count when it gave one at the finish (an
        upstream's tokenizer, its cached prompt tokens), else this stream's. A stream cut
        before its finish counts what was generated until then."""
        counted = self.counted
        if counted is None:
            return Usage(self.prompt_tokens, self.tokens_generated, self.reasoning_tokens)
        return Usage(
            _count(counted.get("prompt_tokens"), self.prompt_tokens),
            _count(counted.get("completion_tokens"), self.tokens_generated),
            _count(
                _detail(counted, "completion_tokens_details", "reasoning_tokens"),
                self.reasoning_tokens,
            ),
            _count(_detail(counted, "prompt_tokens_details", "cached_tokens"), 0),
            _count(_detail(counted, "prompt_tokens_details", "cache_write_tokens"), 0),
        )

    def fail(self, error: EngineError) -> None:
        if self.outcome is not None:
            return
        self._flush_pending()  # keep what arrived, even before an error
        self._end(Outcome.ERROR, error)

    def move(self) -> None:
        """Stop generating here without ending the answer: another instance goes on with it
        from what the shared store holds. Readers get what the log has, then their connection
        ends without a last event, and they come back with Last-Event-ID."""
        if self.outcome is not None:
            return
        if self.generation is not None:
            self.generation.cancel()
        self._flush_pending()
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
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
        self._flush_pending()
        if error is None:
            code, message, type_ = _STOPPED.get(reason, _STOPPED_ANY)
            error = EngineError(code, message, type_=type_)
        self._end(reason, error)

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
        assert self.first_token_at is not None
        if self.on_first_token is not None:
            self.on_first_token(self, self.first_token_at - self.accepted_at)

    def _end(self, outcome: Outcome, error: EngineError | None) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self.outcome = outcome
        if error is not None:
            assert self.renderer is not None
            self.error_code = error.code
            self.error_status = error.status  # before the event: a collector reads it there
            for name, data in self.renderer.error(error.code, error.message, error.type):
                self._append(name, data)
            if error.client_fault and self.ticket is not None:
                self.ticket.client_fault = True
        self.log.on_room = None
        self.log.close()
        if self.on_end is not None:
            self.on_end(self)
        # The generation holds the stream as its sink: without this cycle a finished stream
        # goes with its last reference, not at the next full garbage collection.
        self.generation = None

    def _append(self, name: str | None, data: bytes, tokens: int = 0) -> None:
        log = self.log
        log.append(encode_event(log.last_seq + 1 + self.id_base, data, name), tokens)

    def _emit(self, text: str, tokens: int) -> None:
        log = self.log
        if self._template is not None:
            log.append(self._template % (log.last_seq + 1, _dumps(text)), tokens)
            if self.meta_interval_s is not None:
                self._maybe_meta()
            return
        assert self.renderer is not None
        data = self.renderer.token(text)
        if self._token_event is None:
            # JSON has no raw line breaks: the one-line frame needs no checks.
            log.append(DATA_FRAME % (log.last_seq + 1 + self.id_base, data), tokens)
        else:
            seq = log.last_seq + 1 + self.id_base
            log.append(encode_event(seq, data, self._token_event), tokens)
        if self.meta_interval_s is not None:
            self._maybe_meta()

    def _maybe_meta(self) -> None:
        now = time.perf_counter()
        if self.first_generated_at is None:
            self.first_generated_at = now
        elif self.meta_interval_s is not None and now - self.last_meta_at >= self.meta_interval_s:
            self.last_meta_at = now
            self._append("meta", _progress(self, now))

    def _coalesce(self, text: str) -> None:
        """Tokens go through the coalescer as they come. A pending chunk's deadline is one
        loop timer per stream, armed when a chunk opens and not cancelled when a boundary
        flushes it first: when it fires it flushes what is due or re-arms for what is pending."""
        coalescer = self._coalescer
        assert coalescer is not None
        now = time.perf_counter()
        chunks = coalescer.push(text, now)
        if chunks:
            self._emit_chunks(chunks)
        deadline = coalescer.deadline
        if deadline is not None and self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(max(0.0, deadline - now), self._flush_due)

    def _flush_due(self) -> None:
        self._flush_timer = None
        coalescer = self._coalescer
        if coalescer is None or self.outcome is not None:
            return
        now = time.perf_counter()
        self._emit_chunks(coalescer.due(now))
        deadline = coalescer.deadline
        if deadline is not None:  # a newer chunk opened after the one this timer was for
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(max(0.0, deadline - now), self._flush_due)

    def _flush_pending(self) -> None:
        if self._coalescer is not None:
            self._emit_chunks(self._coalescer.flush())

    def _emit_chunks(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            self._emit(chunk.text, chunk.tokens)


def _with_carried(counted: Mapping[str, Any], carried: Usage) -> dict[str, Any]:
    """A taken-over stream's engine usage as the whole answer's: the original prompt once
    (the continuation's prompt held the text sent before), and every token before it."""
    out = dict(counted)
    out["prompt_tokens"] = carried.prompt
    out["completion_tokens"] = counted["completion_tokens"] + carried.completion
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    reasoning = _count(_detail(counted, "completion_tokens_details", "reasoning_tokens"), 0)
    if reasoning or carried.reasoning:
        details = out.get("completion_tokens_details")
        out["completion_tokens_details"] = {
            **(details if isinstance(details, Mapping) else {}),
            "reasoning_tokens": reasoning + carried.reasoning,
        }
    return out


def _count(value: object, otherwise: int) -> int:
    """A token count an engine reported, if it is one."""
    return (
        value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else otherwise
    )


def _detail(usage: Mapping[str, Any], details: str, name: str) -> object:
    part = usage.get(details)
    return part.get(name) if isinstance(part, Mapping) else None


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
