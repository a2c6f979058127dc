"""Takeovers and hand-overs: how a stream outlives the instance that generates it.

With a shared store (Redis) a reader here of a stream another instance generates reads a
`Mirror` of it, filled by a tail of the store (`tail`). When that owner is gone the reader
takes the stream over (`take_over`): the store's claim makes this instance the owner (one
wins), the stream is rebuilt from the request stored with it (`reopen`, the API's) and the
events the store holds, and generation goes on from exactly the text sent: a splice
(`routing/splice.py`) onto this instance's engine. The other side: a stream this instance
generates is `move`d, not ended, when it hands its streams over at shutdown (`hand_over`) or
learns another instance took it over (`on_fenced`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from firsttoken.core.mirror import Mirror
from firsttoken.core.stream import Outcome, Stream
from firsttoken.generation import Delta, EngineError, GenerationRequest
from firsttoken.resume import LOST_AHEAD, Claim, EventStore, Orphan
from firsttoken.resume.tailer import fail
from firsttoken.telemetry.log import log_event
from firsttoken.telemetry.metrics import key_label

if TYPE_CHECKING:
    from firsttoken.core.registry import StreamRegistry

__all__ = ["Reopen", "Takeovers"]

# The API's half of a takeover: the stream as it was (request, key, format) from what the
# store kept, its log holding those events, admitted here; and the request that continues
# it from the text they carry (None: the answer is complete), and the tokens already
# generated. Raises EngineError to refuse.
Reopen = Callable[[Claim, Mirror], Awaitable[tuple[Stream, GenerationRequest | None, int]]]


class Takeovers:
    """The registry's streams as they move between instances: mirrors followed here, streams
    taken over from a gone owner, and streams let go to another."""

    def __init__(self, registry: StreamRegistry) -> None:
        self.registry = registry
        self.metrics = registry.metrics
        self.reopen: Reopen | None = None  # Redis mode: takeovers of gone instances' streams
        self.mirrors: set[Mirror] = set()  # read here now: handed over at shutdown too

    @property
    def store(self) -> EventStore:
        return self.registry.store

    def tail(self, mirror: Mirror, after: int) -> None:
        """Start filling a mirror from the store; it stops when its reader leaves, and takes
        the stream over when its owner is gone."""
        self.registry.spawn_task(self._follow, mirror, after)

    async def _follow(self, mirror: Mirror, after: int) -> None:
        self.mirrors.add(mirror)
        try:
            await mirror.follow(self.store, after, self.take_over).run()
        except Exception as exc:  # a bug must end the reader's stream, not the task group
            log_event("stream.follow_crashed", logging.ERROR, stream=mirror.id, error=repr(exc))
            self._lost(mirror, "refused", "the stream could not be followed here")
        finally:
            self.mirrors.discard(mirror)

    # -- takeovers -------------------------------------------------------------------------

    async def take_over(self, mirror: Mirror, orphan: Orphan) -> bool:
        """The owner of the stream `mirror` reads is gone: continue it here, or hand its
        readers to this instance's copy of it. True once the mirror's readers have their
        answer (continued, or told it is lost); False: follow the stream again (another
        instance has it, or the store could not say)."""
        local = self.registry.local(mirror.id)
        if local is None:
            if self.reopen is None:
                return self._lost(mirror, "refused", "the instance generating it is gone")
            # Once claimed, the stream is this instance's to continue even if its reader
            # leaves meanwhile (the grace then ends it): never claimed and left standing.
            with anyio.CancelScope(shield=True):
                claim = await self.store.claim(mirror.id, orphan.owner, mirror.log.last_seq)
                local = await self._continue(claim, mirror) if isinstance(claim, Claim) else None
            if not isinstance(claim, Claim):
                local = self.registry.local(mirror.id)  # another reader here won the claim
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
        self.registry.register(stream)
        self.store.adopt(stream.record(), self.registry.ttl_s, stream.log, claim.fence)
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
            self.registry.launch(stream, following)
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
            # A reader that found the mirror but has not attached yet (its connection is still
            # opening) reads the stream too: closed, the mirror's log wakes it, and
            # `EventSender.open` sends it on. Left open, that reader waited for ever.
            mirror.successor = stream
            mirror.log.close()
        if stream.readers == 0 and stream.outcome is None:
            self.registry.schedule_abandon(stream)

    def on_fenced(self, stream_id: str, kept: int, lost: bool) -> None:
        """Another instance took over a stream this one still generates (this one was
        paused, or cut off from the store), from its event `kept`: stop, and let every
        reader go there. What this instance made after `kept` is not the answer any more:
        a reader not past it ends there and comes back with the id of an event the other
        instance goes on from; one past it is told `stream_lost` when it comes back (its
        last event has another id there). `lost`: a reader here was sent events past `kept`
        as confirmed (`--durable` released them while the store was away): told
        `stream_lost` now rather than let it read another text from there."""
        stream = self.registry.local(stream_id)
        if stream is None:
            return
        log_event("stream.fenced", stream=stream_id, trace_id=stream.trace_id, kept=kept, lost=lost)
        if lost:
            if stream.outcome is None:
                message = "another instance took this stream over from events sent before it"
                stream.stop(Outcome.ERROR, EngineError("stream_lost", message, client_fault=True))
            return
        if stream.outcome is None:
            stream.move()  # forgotten here: a reader back here follows the other instance
        else:  # it ended here, but the store has its end from the other instance
            stream.outcome = Outcome.MOVED  # for its readers: this end is not the answer's
            self.registry.forget(stream)
        stream.log.end_at(kept)
        stream.log.close()  # again: the readers that waited for what is gone end now

    async def hand_over(self) -> int:
        """A drain with a shared store: hand every live stream whose readers resume by
        themselves (`movable`: native ones) over to the instance they come back to; their
        engines stop here, their readers get what was generated and reconnect. The others
        (an SDK's: one connection, one answer) go on here until they end. Returns how many
        were moved."""
        moving = [s for s in self.registry.live() if s.movable]
        for stream in moving:
            stream.move()
        mirrors = list(self.mirrors)
        for mirror in mirrors:  # their readers go on elsewhere too
            mirror.move()
        if moving or mirrors:
            await self.store.hand_over([s.id for s in moving])
        return len(moving)
