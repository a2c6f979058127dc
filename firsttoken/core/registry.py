"""The registry: live and recently finished streams by id; it starts, stops and expires them.

It owns the one task group of the data plane: the pull tasks of iterator engines, the tails
of mirrors, ticket releases and the expiry sweep. Everything per token happens in `Stream`.

With a shared store (Redis) a stream outlives the instance that generates it. A reader here
of a stream whose owner is gone takes it over (`_take_over`): the store's claim makes this
instance the owner (one wins), the stream is rebuilt from the request stored with it
(`reopen`, the API's) and the events the store holds, and generation goes on from exactly the
text sent: a splice (`routing/splice.py`) onto this instance's engine. The other side: a
stream this instance generates is `move`d, not ended, when it hands its streams over at
shutdown or learns another instance took it over (`_on_fenced`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from firsttoken.core.mirror import Mirror
from firsttoken.core.pacing import Pacer
from firsttoken.core.schedule import Schedule
from firsttoken.core.stream import AdmissionTicket, Outcome, Stream, Usage
from firsttoken.generation import Delta, Engine, EngineError, GenerationRequest
from firsttoken.resume import LOST_AHEAD, Claim, EventStore, MemoryStore, Orphan
from firsttoken.resume.budget import ResumeBudget
from firsttoken.resume.tailer import fail
from firsttoken.telemetry.log import log_enabled, log_event
from firsttoken.telemetry.metrics import LOOP_LAG_SAMPLE_S, Metrics, key_label

__all__ = ["Reopen", "StreamRegistry", "StreamTracer"]

# The API's half of a takeover: the stream as it was (request, key, format) from what the
# store kept, its log holding those events, admitted here; and the request that continues
# it from the text they carry (None: the answer is complete), and the tokens already
# generated. Raises EngineError to refuse.
Reopen = Callable[[Claim, Stream], Awaitable[tuple[Stream, GenerationRequest | None, int]]]


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
        self.reopen: Reopen | None = None  # Redis mode: takeovers of gone instances' streams
        # With a keys file: why a stream about to start may not (its key revoked by a reload
        # after admission checked it; `Admission.revoked`), or None.
        self.revoked: Callable[[Stream], EngineError | None] | None = None
        self._stepper = engine.as_step_engine()
        self._streams: dict[str, Stream] = {}
        self._mirrors: set[Mirror] = set()  # read here now: handed over at shutdown too
        self._expiry: deque[tuple[float, str]] = deque()
        self.clock: Callable[[], float] = time.monotonic  # of expiry (a fake one in tests)
        self._tg: TaskGroup | None = None
        self._pulled: set[asyncio.Task[None]] = set()  # iterator engines' tasks (`_launch`)
        # Work that callbacks (engine steps, the schedule) hand to the task group.
        self._spawns: deque[
            tuple[Callable[..., Coroutine[Any, Any, None]], tuple[object, ...], bool]
        ] = deque()
        self._spawn_wakeup: asyncio.Future[None] | None = None
        # Bound once, shared by every stream: a bound method per stream would cost 64 bytes.
        self._on_end = self._ended
        self._on_first_token = self._first_token
        self._wake_lag: Callable[[], None] = lambda: None  # armed by run()

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
                self.store.on_fenced = self._on_fenced
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

    async def find(self, stream_id: str) -> Stream | None:
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
        assert self._tg is not None
        self._tg.start_soon(self._follow, mirror, after)

    async def _follow(self, mirror: Mirror, after: int) -> None:
        self._mirrors.add(mirror)
        try:
            await mirror.follow(self.store, after, self._take_over).run()
        except Exception as exc:  # a bug must end the reader's stream, not the task group
            log_event("stream.follow_crashed", logging.ERROR, stream=mirror.id, error=repr(exc))
            self._lost(mirror, "refused", "the stream could not be followed here")
        finally:
            self._mirrors.discard(mirror)

    # -- takeovers -------------------------------------------------------------------------

    async def _take_over(self, mirror: Mirror, orphan: Orphan) -> bool:
        """The owner of the stream `mirror` reads is gone: continue it here, or hand its
        readers to this instance's copy of it. True once the mirror's readers have their
        answer (continued, or told it is lost); False: follow the stream again (another
        instance has it, or the store could not say)."""
        local = self._streams.get(mirror.id)
        if local is None:
            if self.reopen is None:
                return self._lost(mirror, "refused", "the instance generating it is gone")
            # Once claimed, the stream is this instance's to continue even if its reader
            # leaves meanwhile (the grace then ends it): never claimed and left standing.
            with anyio.CancelScope(shield=True):
                claim = await self.store.claim(mirror.id, orphan.owner, mirror.log.last_seq)
                local = await self._continue(claim, mirror) if isinstance(claim, Claim) else None
            if not isinstance(claim, Claim):
                local = self._streams.get(mirror.id)  # another reader here won the claim
                if claim == "moved" and local is not None and local.outcome is None:
                    self._hand_readers(mirror, local)
                    return True
                if claim == "lost":
                    return self._lost(
                        mirror,
                        "lost",
                        "the instance generating this stream is gone, and the shared store "
                        "lacks events this reader was sent",
                    )
                if claim == "refused":
                    return self._lost(mirror, "refused", "the instance generating it is gone")
                # Moved to another instance, ended, or gone from an unreachable store.
                return False
            if local is None:
                return True
        elif local.outcome is Outcome.MOVED:
            return False
        self._hand_readers(mirror, local)
        return True

    def _lost(self, mirror: Mirror, outcome: str, message: str) -> bool:
        self.metrics.takeovers[outcome] += 1
        log = mirror.log
        if not log.closed:
            fail(log, "stream_lost", message)
        log_event("stream.takeover_failed", stream=mirror.id, outcome=outcome, reason=message)
        return True

    async def _continue(self, claim: Claim, mirror: Mirror) -> Stream | None:
        """This instance now owns the stream: rebuild it from what the store holds and go on
        generating from exactly the text its readers were sent."""
        assert self.reopen is not None
        try:
            stream, following, at_token = await self.reopen(claim, mirror)
        except EngineError as exc:
            self._lost(mirror, "refused", f"the stream could not be taken over: {exc.message}")
            return None
        request = stream.request
        stream.delivered_seq = mirror.delivered_seq
        stream.tokens_sent = mirror.tokens_sent
        stream.last_content_at = mirror.last_content_at
        self._register(stream)
        self.store.adopt(stream.record(), self.ttl_s, stream.log, claim.fence)
        self.metrics.takeovers["continued"] += 1
        to = self.store.instance
        log_event(
            "stream.taken_over",
            stream=stream.id,
            trace_id=stream.trace_id,
            key=key_label(request.tenant),
            owner=claim.owner,
            to=to,
            at_token=at_token,
            fence=claim.fence,
        )
        stream.number_as(claim.fence)  # its events' ids are not those the old owner gave
        stream.push_delta(
            Delta(meta={"takeover": {"from": claim.owner, "to": to, "at_token": at_token}})
        )
        if following is None:  # cut exactly at its max_tokens: it is complete
            stream.finish("length")
            return stream
        try:
            self._launch(stream, following)
        except EngineError as exc:
            stream.fail(exc)
        except Exception as exc:
            log_event("stream.open_failed", logging.ERROR, stream=stream.id, error=repr(exc))
            stream.fail(EngineError("internal_error", "the engine failed to continue this stream"))
        finally:
            stream.request = request.without_inputs()
        return stream

    def _hand_readers(self, mirror: Mirror, stream: Stream) -> None:
        """The mirror's readers read `stream` from now on, from where each one is: if the
        one that came back with an event the store did not have yet has that event here."""
        resumed = mirror.resumed
        if resumed is not None and not resumed.checked:
            resumed.checked = True
            if not stream.has_event(resumed.seq, resumed.id):
                self._lost(mirror, "lost", LOST_AHEAD)
        if not mirror.log.closed:
            for reader in list(mirror.log.readers):
                mirror.log.detach(reader)
                mirror.readers -= 1
                reader.move_to(stream)
        if stream.readers == 0 and stream.outcome is None:
            self._schedule_abandon(stream)

    def _on_fenced(self, stream_id: str, kept: int, lost: bool) -> None:
        """Another instance took over a stream this one still generates (this one was
        paused, or cut off from the store), from its event `kept`: stop, and let every
        reader go there. What this instance made after `kept` is not the answer any more:
        a reader not past it ends there and comes back with the id of an event the other
        instance goes on from; one past it is told `stream_lost` when it comes back (its
        last event has another id there). `lost`: a reader here was sent events past `kept`
        as confirmed (`--durable` released them while the store was away): told
        `stream_lost` now rather than let it read another text from there."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        log_event(
            "stream.fenced", stream=stream_id, trace_id=stream.trace_id, kept=kept, lost=lost
        )
        if lost:
            if stream.outcome is None:
                message = "another instance took this stream over from events sent before it"
                stream.stop(Outcome.ERROR, EngineError("stream_lost", message, client_fault=True))
            return
        if stream.outcome is None:
            stream.move()  # forgotten here: a reader back here follows the other instance
        else:  # it ended here, but the store has its end from the other instance
            stream.outcome = Outcome.MOVED  # for its readers: this end is not the answer's
            if self._streams.get(stream_id) is stream:
                del self._streams[stream_id]
                if self.budget is not None:
                    self.budget.forget(stream_id)
        stream.log.end_at(kept)
        stream.log.close()  # again: the readers that waited for what is gone end now

    async def hand_over(self) -> int:
        """A drain with a shared store: hand every live stream whose readers resume by
        themselves (`movable`: native ones) over to the instance they come back to; their
        engines stop here, their readers get what was generated and reconnect. The others
        (an SDK's: one connection, one answer) go on here until they end. Returns how many
        were moved."""
        moving = [s for s in self._streams.values() if s.outcome is None and s.movable]
        for stream in moving:
            stream.move()
        mirrors = list(self._mirrors)
        for mirror in mirrors:  # their readers go on elsewhere too
            mirror.move()
        if moving or mirrors:
            await self.store.hand_over([s.id for s in moving])
        return len(moving)

    async def cancel(self, stream: Stream) -> str:
        if isinstance(stream, Mirror):
            return await self.store.cancel(stream.id) or "cancelling"
        stream.stop(Outcome.CANCELLED)  # synchronous: the stream has ended when it returns
        return stream.outcome.value if stream.outcome else "cancelling"

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
        self._register(stream)
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
            self._launch(stream, request)
            if self.store.replicates:
                # Findable on other instances before its id is handed out; the engine is
                # already on its way, so the round trip is not added to the first token.
                await self.store.registered(stream.id)
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
        except BaseException:  # cancelled while registering: nobody is left to read it
            stream.stop(Outcome.DISCONNECTED)
            raise
        finally:
            # The engine holds what it still needs (a relay forwards the raw body when its
            # task runs); the stream keeps only the model and the limits.
            stream.request = request.without_inputs()
        if stream.readers == 0 and stream.outcome is None:
            self._schedule_abandon(stream)
        return None

    def _store_request(self, stream: Stream) -> None:
        """The request stored with the stream for a takeover counts in the resume budget
        until the stream ends; past the budget it is not stored, and the stream cannot be
        taken over (`firsttoken_resume_requests_unstored_total`)."""
        assert stream.handover is not None and self.budget is not None
        if not self.budget.store_request(stream.id, stream.request.tenant, len(stream.handover)):
            stream.handover = None
            stream.movable = False

    def _register(self, stream: Stream) -> None:
        self._streams[stream.id] = stream
        if not self.metrics.active_streams:
            self._wake_lag()  # the loop may be late from here on: sample it closely again
        self.metrics.active_streams += 1
        self.metrics.stream_started(stream.request.model, key_label(stream.request.tenant))
        stream.on_end = self._on_end
        stream.on_first_token = self._on_first_token
        if self.tracer is not None:
            self.tracer.started(stream)

    def _launch(self, stream: Stream, request: GenerationRequest) -> None:
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

    def forget(self, stream: Stream) -> None:
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

    def attach(self, stream: Stream) -> None:
        stream.readers += 1
        stream._abandon_epoch += 1

    def detach(self, stream: Stream) -> None:
        stream.readers -= 1
        if stream.readers == 0:
            if isinstance(stream, Mirror):
                stream.stop(Outcome.DISCONNECTED)
            elif stream.outcome is not None:
                self._log_finished(stream)
            else:
                self._schedule_abandon(stream)

    def _schedule_abandon(self, stream: Stream) -> None:
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
        live = [s for s in self._streams.values() if s.outcome is None]
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
        live = [s for s in self._streams.values() if s.outcome is None]
        for stream in live:
            stream.stop(Outcome.ERROR, EngineError(code, message))
        return len(live)

    def end_where(self, doomed: Callable[[Stream], bool], error: EngineError) -> int:
        """End the live streams `doomed` picks with `event: error` `error` (a revoked key's);
        returns how many were ended."""
        live = [s for s in self._streams.values() if s.outcome is None and doomed(s)]
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
