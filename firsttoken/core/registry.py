"""The registry: live and recently finished streams by id; it starts, stops and expires them.

It owns the one task group of the data plane: the pull tasks of iterator engines, the tails
of mirrors, ticket releases and the expiry sweep. Everything per token happens in `Stream`.

With a shared store (Redis) a stream outlives the instance that generates it: the registry's
`Takeovers` (core/takeovers.py) follow mirrors of other instances' streams, take over those
whose owner is gone, and let this instance's streams go to another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from firsttoken.core.mirror import Mirror
from firsttoken.core.pacing import Pacer
from firsttoken.core.schedule import Schedule
from firsttoken.core.stream import AdmissionTicket, BaseStream, Outcome, Stream, Usage
from firsttoken.core.takeovers import Reopen, Takeovers
from firsttoken.generation import Engine, EngineError, GenerationRequest
from firsttoken.resume import EventStore, MemoryStore
from firsttoken.resume.budget import ResumeBudget
from firsttoken.telemetry.log import log_enabled, log_event
from firsttoken.telemetry.metrics import LOOP_LAG_SAMPLE_S, Metrics, key_label

__all__ = ["Reopen", "StreamRegistry", "StreamTracer"]


class StreamTracer(Protocol):
    """Told of each stream's start, first token and end (`--otlp-endpoint`: a span per
    stream and its GenAI metrics). Nothing per token."""

    def started(self, stream: Stream) -> None: ...

    def first_token(self, stream: Stream, ttft_s: float) -> None: ...

    def ended(self, stream: Stream) -> None: ...


class _Pulled:
    """An iterator engine's request, pulled by a task of the registry's group: the one place
    with a task per stream, for engines that have one anyway (a relay's socket read)."""

    __slots__ = ("_room", "engine", "request", "scope", "stream")

    def __init__(self, engine: Engine, stream: Stream, request: GenerationRequest) -> None:
        self.engine = engine
        self.stream = stream
        self.request: GenerationRequest | None = request  # the engine's, until it has it
        self.scope = anyio.CancelScope()
        self._room: asyncio.Future[None] | None = None

    async def run(self) -> None:
        stream = self.stream
        request, self.request = self.request, None
        assert request is not None
        with self.scope:
            try:
                async for delta in self.engine.generate(request):
                    if not stream.push_delta(delta) and stream.outcome is None:
                        self._room = asyncio.get_running_loop().create_future()
                        await self._room
                # Iterated to its end even after the finish: an engine may work after it (the
                # cache stores the answer). One that ended without a finish reason stopped.
                stream.finish("stop")
            except EngineError as exc:
                stream.fail(exc)
            except Exception as exc:  # a bug must still end the stream with an error event
                log_event(
                    "stream.crashed",
                    logging.ERROR,
                    stream=stream.id,
                    key=key_label(stream.request.tenant),
                    error=repr(exc),
                )
                stream.fail(EngineError("internal_error", "internal error"))
        if self.scope.cancelled_caught:
            with anyio.CancelScope(shield=True):
                await self.engine.abort(stream.id)

    def resume(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def cancel(self) -> None:
        self.scope.cancel()


class StreamRegistry:
    """Live and recently finished streams by id; starts, stops and expires them."""

    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        *,
        ttl_s: float,
        store: EventStore | None = None,
        max_events: int = 8192,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.store: EventStore = store or MemoryStore()
        self.max_events = max_events
        self.schedule = Schedule()  # heartbeats, send timeouts and grace periods
        self.pacer: Pacer | None = None  # --max-stream-bytes-per-s: every writer's budget
        self.max_response_bytes: int | None = None  # --max-response-bytes: a whole answer's
        self.budget: ResumeBudget | None = None  # --resume-max-bytes: finished buffers' bytes
        self.tracer: StreamTracer | None = None  # --otlp-endpoint
        # With a keys file: why a stream about to start may not (its key revoked by a reload
        # after admission checked it; `Admission.revoked`), or None.
        self.revoked: Callable[[Stream], EngineError | None] | None = None
        self._stepper = engine.as_step_engine()
        self._streams: dict[str, Stream] = {}
        self._expiry: deque[tuple[float, str]] = deque()
        self.clock: Callable[[], float] = time.monotonic  # of expiry (a fake one in tests)
        self._tg: TaskGroup | None = None
        self._pulled: set[asyncio.Task[None]] = set()  # iterator engines' tasks (`launch`)
        # Work that callbacks (engine steps, the schedule) hand to the task group.
        self._spawns: deque[
            tuple[Callable[..., Coroutine[Any, Any, None]], tuple[object, ...], bool]
        ] = deque()
        self._spawn_wakeup: asyncio.Future[None] | None = None
        # Bound once, shared by every stream: a bound method per stream would cost 64 bytes.
        self._on_end = self._ended
        self._on_first_token = self._first_token
        self._wake_lag: Callable[[], None] = lambda: None  # armed by run()
        self.takeovers = Takeovers(self)

    async def run(self, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own the registry's task group until cancelled (the app's lifespan)."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._wake_lag = self.schedule.sample_lag(
                    LOOP_LAG_SAMPLE_S,
                    self.metrics.loop_lag.observe,
                    busy=lambda: self.metrics.active_streams > 0,
                )
                tg.start_soon(self._sweep)
                tg.start_soon(self._spawner)
                self.store.on_fenced = self.takeovers.on_fenced
                await tg.start(self.store.run, self._on_remote_cancel)
                task_status.started()
                try:
                    await anyio.sleep_forever()
                finally:
                    await self._cancel_pulled()
        finally:
            self.schedule.close()

    async def _cancel_pulled(self) -> None:
        """The engines' tasks end with the group, as its own tasks do."""
        tasks = list(self._pulled)
        for task in tasks:
            task.cancel()
        if tasks:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(tasks)

    def spawn_task(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: object) -> None:
        """Run `fn(*args)` in the registry's task group (from a task)."""
        assert self._tg is not None, "registry is not running"
        self._tg.start_soon(fn, *args)

    def local(self, stream_id: str) -> Stream | None:
        """This instance's stream `stream_id`, live or recently finished, if it has one."""
        return self._streams.get(stream_id)

    def live(self) -> list[Stream]:
        """This instance's streams that are still generating."""
        return [s for s in self._streams.values() if s.outcome is None]

    async def find(self, stream_id: str) -> Stream | Mirror | None:
        """This instance's stream, or a mirror of one that another instance generates."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            return stream
        record = await self.store.lookup(stream_id)
        if record is None:
            return None
        return Mirror(record, max_events=self.max_events)

    async def tail(self, mirror: Mirror, after: int) -> None:
        """Start filling a mirror from the store; it stops when its reader leaves, and takes
        the stream over when its owner is gone."""
        self.takeovers.tail(mirror, after)

    async def hand_over(self) -> int:
        """A drain with a shared store: hand every live stream whose readers resume by
        themselves (`movable`: native ones) over to the instance they come back to
        (`Takeovers.hand_over`). Returns how many were moved."""
        return await self.takeovers.hand_over()

    @property
    def reopen(self) -> Reopen | None:
        """Redis mode: the API's half of a takeover of a gone instance's stream."""
        return self.takeovers.reopen

    @reopen.setter
    def reopen(self, reopen: Reopen | None) -> None:
        self.takeovers.reopen = reopen

    async def cancel(self, stream: BaseStream) -> str:
        """Stop `stream` (its owner stops a mirror's); returns its outcome, or "cancelling"."""
        return await stream.cancel(self.store)

    def _on_remote_cancel(self, stream_id: str) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.stop(Outcome.CANCELLED)

    async def start(self, stream: Stream) -> EngineError | None:
        """Start generating `stream`. It never raises for the engine's sake: whatever fails
        before the engine runs (the store's registration, the opening events, a step engine's
        `open`) fails the stream instead, so its one end releases everything it took (ticket,
        active gauge, store registration) and counts `error`. Returns that error (a handler
        that has sent nothing yet answers it as JSON), or None."""
        assert self._tg is not None, "registry is not running"
        self.register(stream)
        request = stream.request
        try:
            if self.revoked is not None:  # a keys file: its key may have been revoked since
                error = self.revoked(stream)
                if error is not None:
                    raise error
            if self.store.replicates:
                if stream.handover is not None and self.budget is not None:
                    self._store_request(stream)
                self.store.open(stream.record(), self.ttl_s, stream.log)
                stream.handover = None  # the store's now
            if log_enabled(logging.DEBUG):  # `stream.finished` says it all at info
                log_event(
                    "stream.accepted",
                    logging.DEBUG,
                    stream=stream.id,
                    trace_id=stream.trace_id,
                    key=key_label(request.tenant),
                    model=request.model,
                    max_tokens=request.max_tokens,
                )
            stream.begin()
            # Its id goes out now, whatever the store: waiting for Redis to hold the meta
            # added up to 1 s to first tokens while Redis restarted. Another instance asked
            # for it before the meta lands waits for it instead (`RedisStore.lookup`), and
            # the flusher writes a missing meta before the stream's events.
            self.launch(stream, request)
        except EngineError as exc:
            stream.fail(exc)
            return exc
        except Exception as exc:
            log_event(
                "stream.open_failed",
                logging.ERROR,
                stream=stream.id,
                key=key_label(request.tenant),
                error=repr(exc),
            )
            error = EngineError("internal_error", "the engine failed to start this stream")
            stream.fail(error)
            return error
        finally:
            # The engine holds what it still needs (a relay forwards the raw body when its
            # task runs); the stream keeps only the model and the limits.
            stream.request = request.without_inputs()
        if stream.readers == 0 and stream.outcome is None:
            self.schedule_abandon(stream)
        return None

    def _store_request(self, stream: Stream) -> None:
        """The request stored with the stream for a takeover counts in the resume budget
        until the stream ends; past the budget it is not stored, and the stream cannot be
        taken over (`firsttoken_resume_requests_unstored_total`)."""
        assert stream.handover is not None and self.budget is not None
        if not self.budget.store_request(stream.id, stream.request.tenant, len(stream.handover)):
            stream.handover = None
            stream.movable = False

    def register(self, stream: Stream) -> None:
        self._streams[stream.id] = stream
        if not self.metrics.active_streams:
            self._wake_lag()  # the loop may be late from here on: sample it closely again
        self.metrics.active_streams += 1
        self.metrics.stream_started(stream.request.model, key_label(stream.request.tenant))
        stream.on_end = self._on_end
        stream.on_first_token = self._on_first_token
        if self.tracer is not None:
            self.tracer.started(stream)

    def launch(self, stream: Stream, request: GenerationRequest) -> None:
        """The engine starts on `request`, with `stream` as its sink."""
        assert self._tg is not None
        if self._stepper is not None:
            stream.generation = self._stepper.open(request, stream)
        else:
            pulled = _Pulled(self.engine, stream, request)
            stream.generation = pulled
            # A plain task, not the group's start_soon (~20 µs a stream in anyio's
            # bookkeeping against ~1 µs); `run` cancels what is left when the group ends.
            task = asyncio.get_running_loop().create_task(pulled.run())
            self._pulled.add(task)
            task.add_done_callback(self._pulled.discard)

    def forget(self, stream: BaseStream) -> None:
        """Drop an ended stream nobody can ask for (it failed before its id was handed out)."""
        if stream.outcome is not None and self._streams.get(stream.id) is stream:
            del self._streams[stream.id]
            if self.budget is not None:
                self.budget.forget(stream.id)

    def discard(self, stream: Stream) -> None:
        """A stream admitted but never started (its client left first): what it took from
        admission goes back, and it counts as `disconnected`."""
        if stream.generation is not None or stream.outcome is not None:
            return
        stream.outcome = Outcome.DISCONNECTED
        self.metrics.streams[Outcome.DISCONNECTED.value] += 1
        if stream.ticket is not None:
            self._spawn(self._release, stream.ticket, Outcome.DISCONNECTED, None, inline=True)

    def unstarted(self, ticket: AdmissionTicket) -> None:
        """An admitted request failed before it had a stream: its ticket goes back, and it
        counts as `error`."""
        self.metrics.streams[Outcome.ERROR.value] += 1
        self._spawn(self._release, ticket, Outcome.ERROR, None, inline=True)

    def attach(self, stream: BaseStream) -> None:
        stream.readers += 1
        stream._abandon_epoch += 1

    def detach(self, stream: BaseStream) -> None:
        stream.readers -= 1
        if stream.readers == 0:
            stream.last_reader_left(self)  # a mirror stops its tail; a stream, `unread`

    def unread(self, stream: Stream) -> None:
        """The last reader of a stream generated here left: its grace starts (ended: its
        line is logged now that no reader writes)."""
        if stream.outcome is not None:
            self._log_finished(stream)
        else:
            self.schedule_abandon(stream)

    def schedule_abandon(self, stream: Stream) -> None:
        if stream.grace_s <= 0:
            stream.stop(Outcome.DISCONNECTED)
            return
        stream._abandon_epoch += 1
        epoch = stream._abandon_epoch
        self.schedule.call_later(stream.grace_s, lambda: self._grace_over(stream, epoch))

    def _grace_over(self, stream: Stream, epoch: int) -> None:
        if stream.outcome is not None or stream.readers or stream._abandon_epoch != epoch:
            return
        if not self.store.replicates:
            stream.stop(Outcome.DISCONNECTED)
            return
        self._spawn(self._abandon_unless_read_elsewhere, stream, epoch)

    async def _abandon_unless_read_elsewhere(self, stream: Stream, epoch: int) -> None:
        # A reader on another instance keeps the stream alive too.
        if await self.store.has_remote_readers(stream.id):
            if stream._abandon_epoch == epoch:
                stream.log.release_floor()  # that reader reads the backlog from Redis
                self.schedule.call_later(stream.grace_s, lambda: self._grace_over(stream, epoch))
            return
        if stream._abandon_epoch == epoch and not stream.readers:
            stream.stop(Outcome.DISCONNECTED)

    def end_oldest(self) -> bool:
        """End the oldest live stream with `overloaded` (memory shedding); False if none."""
        live = self.live()
        if not live:
            return False
        oldest = min(live, key=lambda s: s.accepted_at)
        oldest.stop(
            Outcome.ERROR,
            EngineError(
                "overloaded", "the server is over its memory limit; the oldest streams are ended"
            ),
        )
        return True

    def end_all(self, code: str, message: str) -> int:
        """End every live stream with `event: error` `code` (e.g. a drain that ran out of
        time); returns how many were ended."""
        live = self.live()
        for stream in live:
            stream.stop(Outcome.ERROR, EngineError(code, message))
        return len(live)

    def end_where(self, doomed: Callable[[Stream], bool], error: EngineError) -> int:
        """End the live streams `doomed` picks with `event: error` `error` (a revoked key's);
        returns how many were ended."""
        live = [s for s in self.live() if doomed(s)]
        for stream in live:
            stream.stop(Outcome.ERROR, error)
        return len(live)

    def _first_token(self, stream: Stream, ttft_s: float) -> None:
        self.metrics.ttft.observe(ttft_s)
        if stream.ticket is not None:
            stream.ticket.first_token(ttft_s)
        if self.tracer is not None:
            self.tracer.first_token(stream, ttft_s)
        if log_enabled(logging.DEBUG):
            log_event(
                "stream.first_token",
                logging.DEBUG,
                stream=stream.id,
                trace_id=stream.trace_id,
                key=key_label(stream.request.tenant),
                ttft_ms=round(ttft_s * 1000, 3),
            )

    def _ended(self, stream: Stream) -> None:
        outcome = stream.outcome
        assert outcome is not None
        self.metrics.active_streams -= 1
        self.metrics.stream_ended(stream.request.model, key_label(stream.request.tenant))
        if self.budget is not None and self.store.replicates:
            self.budget.end_request(stream.id)  # deleted from Redis at its end, or not ours
        if outcome is Outcome.MOVED:
            self._moved(stream)
            return
        self.metrics.streams[outcome.value] += 1
        if self.tracer is not None:
            self.tracer.ended(stream)
        self._expiry.append((self.clock() + self.ttl_s, stream.id))
        self.store.finish(stream.id, outcome.value, stream.log.last_seq, self.ttl_s)
        if self.budget is not None:
            # Oldest first, server-wide or of the key that went over (this one may be among them).
            for stream_id in self.budget.add(stream.id, stream.request.tenant, stream.log.nbytes()):
                self._drop_buffer(stream_id)
        if stream.readers == 0:
            self._log_finished(stream)
        if stream.ticket is not None:
            usage: Usage | None = _own_usage(stream)
            if stream.tokens_generated == 0 and outcome in _LEFT:
                # Its client left before the first token: billed its prompt if an engine read
                # it, nothing if it still waited for its target's slot.
                if self.engine.has_prompt(stream.id):
                    stream.ticket.prompt_read()
                else:
                    usage = None
            # Awaited in turn by one task, not a task each: in memory a release never
            # suspends, and with Redis it is one short round trip.
            self._spawn(self._release, stream.ticket, outcome, usage, inline=True)

    def _moved(self, stream: Stream) -> None:
        """Another instance goes on with it: nothing ends in the store, and this instance
        forgets it at once (a reader back here finds the store's, and follows that)."""
        self.metrics.streams_moved += 1
        if self.tracer is not None:
            self.tracer.ended(stream)
        own = _own_usage(stream)
        handed = self.store.let_go(stream.id, flush=True, billed=_billed_so_far(stream, own))
        # Fenced (no longer replicated here): its new owner bills all that the store holds,
        # and settles what this one held (no usage: `Ticket.release`).
        usage = own if handed else None
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]
        log_event(
            "stream.moved",
            stream=stream.id,
            trace_id=stream.trace_id,
            key=key_label(stream.request.tenant),
            tokens_generated=stream.tokens_generated,
        )
        if stream.ticket is not None:
            self._spawn(self._release, stream.ticket, Outcome.MOVED, usage, inline=True)

    def _drop_buffer(self, stream_id: str) -> None:
        """A finished stream's events go before its TTL (the resume budget): it stays known,
        and a resume of it gets `resume_expired`."""
        self.store.release(stream_id)  # first: it keeps what Redis still lacks
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.log.drop()
        key = key_label(stream.request.tenant) if stream is not None else None
        log_event("stream.buffer_dropped", stream=stream_id, key=key)

    async def _release(
        self, ticket: AdmissionTicket, outcome: Outcome, usage: Usage | None
    ) -> None:
        try:
            await ticket.release(outcome, usage)
        except Exception as exc:  # one failed release must not stop the rest
            log_event(
                "stream.release_failed",
                logging.ERROR,
                key=key_label(ticket.key.name),
                error=repr(exc),
            )

    def _spawn(
        self, fn: Callable[..., Coroutine[Any, Any, None]], *args: object, inline: bool = False
    ) -> None:
        """Run `fn(*args)` in the registry's task group (inline: awaited by the spawner
        task itself, in order); callable from plain callbacks."""
        self._spawns.append((fn, args, inline))
        wakeup = self._spawn_wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def _spawner(self) -> None:
        assert self._tg is not None
        while True:
            while self._spawns:
                fn, args, inline = self._spawns.popleft()
                if not inline:
                    self._tg.start_soon(fn, *args)
                    continue
                try:
                    await fn(*args)
                except Exception as exc:  # one failed piece of work must not stop the rest
                    log_event("registry.spawn_failed", logging.ERROR, error=repr(exc))
            self._spawn_wakeup = asyncio.get_running_loop().create_future()
            await self._spawn_wakeup

    def _log_finished(self, stream: Stream) -> None:
        # Logged once generation is over and no reader is writing, so `tokens_sent` is final.
        # The one line per stream at info: what `stream.accepted` and `stream.first_token`
        # (debug) say is in it too. A line is ~15 µs of a new stream's CPU.
        if stream.logged_finish or stream.outcome is None:
            return
        stream.logged_finish = True
        ttft = stream.first_token_at
        request = stream.request
        log_event(
            "stream.finished",
            stream=stream.id,
            trace_id=stream.trace_id,
            key=key_label(request.tenant),
            model=request.model,
            max_tokens=request.max_tokens,
            outcome=stream.outcome.value,
            tokens_generated=stream.tokens_generated,
            tokens_sent=stream.tokens_sent,
            ttft_ms=None if ttft is None else round((ttft - stream.accepted_at) * 1000, 3),
            error_code=stream.error_code,
        )

    async def _sweep(self) -> None:
        while True:
            await anyio.sleep(min(1.0, max(self.ttl_s, 0.05)))
            self.expire()

    def expire(self) -> None:
        """Forget the finished streams whose TTL is over."""
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, stream_id = self._expiry.popleft()
            self._streams.pop(stream_id, None)
            if self.budget is not None:
                self.budget.forget(stream_id)


_LEFT = frozenset((Outcome.DISCONNECTED, Outcome.CANCELLED))  # its client left or cancelled


def _own_usage(stream: Stream) -> Usage:
    """What this instance bills of the answer: all of it, less what the owners before billed
    (`Stream.billed_before`, as the last one left it at its hand-over). A SIGKILLed owner
    billed nothing: its prompt and tokens are billed here, once, by the claim's one winner."""
    usage = stream.usage()
    before = stream.billed_before
    if before is None:
        return usage
    # The prompt's cache reads and writes were the first request's; a continuation's own
    # count of them is of the text it was sent, not of the prompt billed.
    return Usage(
        max(0, usage.prompt - before.prompt),
        max(0, usage.completion - before.completion),
        max(0, usage.reasoning - before.reasoning),
    )


def _billed_so_far(stream: Stream, own: Usage) -> bytes:
    """What a stream handed over leaves in the store for the next owner (`Claim.billed`):
    the whole answer up to here once this instance billed its part, as the ledger's
    `billed` does (a part without a token is billed nothing)."""
    before = stream.billed_before or Usage()
    if own.completion:
        usage = stream.usage()
        before = Usage(usage.prompt, usage.completion, usage.reasoning)
    return b"%d %d %d" % (before.prompt, before.completion, before.reasoning)
