"""A stream another instance started, continued here (`--redis --durable`): what travels with
a stream for that (`handover`), the stream rebuilt from it and from the events the store
held (`reopen`, the registry's `Reopen`), and the bill of a dead instance's stream nobody took
over (`bill_orphaned`, the store's sweep's). The API's half of a takeover; the registry
claims the stream and continues it (`core/registry.py`), the store keeps what travels
(`resume/redis.py`), the renderer is rebuilt by replay (`formats/rebuild.py`).

The handover is JSON, read by instances of another version in a rolling deploy: its field
names never change (the request's: `stored_request`, beside `GenerationRequest`).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson

from firsttoken.admission import Admission, ApiKey, Ticket, sets_own_latency
from firsttoken.api.bodies import APIError
from firsttoken.config import Settings
from firsttoken.core.chunking import CoalescePolicy
from firsttoken.core.mirror import Mirror
from firsttoken.core.stream import SELF_RESUMING, Outcome, Stream, Usage
from firsttoken.engines import Engine, EngineError, GenerationRequest
from firsttoken.formats.anthropic import MessagesRenderer
from firsttoken.formats.rebuild import Rebuilt, decode, rebuild, replay
from firsttoken.formats.render import ChatRenderer, CompletionRenderer, NativeRenderer
from firsttoken.formats.responses import ResponsesRenderer
from firsttoken.formats.sse import EventDecoder
from firsttoken.generation import from_stored, stored_request
from firsttoken.resume import Claim, Orphaned
from firsttoken.routing.splice import Transcript, continuation

__all__ = ["Takeover"]

# Every streaming format: another instance rebuilds its renderer (`formats/rebuild.py`).
_TAKEOVER_RENDERERS = (
    NativeRenderer,
    ChatRenderer,
    CompletionRenderer,
    ResponsesRenderer,
    MessagesRenderer,
)


@dataclass(slots=True)
class Takeover:
    """Streams that move between instances, in both directions: what one leaves in the
    store, and what another makes of it."""

    settings: Settings
    engine: Engine
    admission: Admission

    def handover(
        self, stream: Stream, generation: GenerationRequest, ticket: Ticket | None
    ) -> bytes | None:
        """The stream's request, key (`ticket`'s), format and settings, as another instance
        rebuilds it (`reopen`); None when it cannot be taken over (over
        --takeover-max-bytes, or an option no JSON can hold)."""
        renderer = stream.renderer
        if not isinstance(renderer, _TAKEOVER_RENDERERS):
            return None
        coalesce = stream.coalesce
        spec = {
            "request": stored_request(generation),
            "renderer": renderer.spec(),
            "prompt_tokens": stream.prompt_tokens,
            "grace_s": stream.grace_s,
            "coalesce": None
            if coalesce is None
            else {"max_wait_s": coalesce.max_wait_s, "max_bytes": coalesce.max_bytes},
            "meta_interval_s": stream.meta_interval_s,
            "held": self.admission.held(ticket) if ticket is not None else {},
            # Which of the name's secrets it was admitted with: a rotation's old one may go
            # while the stream runs, and a takeover must then refuse it as its owner would.
            "key_sha256": ticket.key.digest.hex() if ticket is not None else "",
        }
        try:
            handover = orjson.dumps(spec)
        except TypeError:  # an option no JSON can hold: the stream stays where it is
            return None
        return handover if len(handover) <= self.settings.takeover_max_bytes else None

    async def reopen(
        self, claim: Claim, mirror: Mirror
    ) -> tuple[Stream, GenerationRequest | None, int]:
        """A stream another instance started, as it was there (`handover`), with the events
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
            made = sum(tokens for _, _, tokens in claim.events)
            await self._bill_unbilled(spec, mirror.id, mirror.trace_id, made, before, Outcome.ERROR)
            raise

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
        they billed (`before`), as one record of `outcome`: nothing when that is no token.
        A stream that ends here refused bills all its owners left unbilled (all of it after
        a SIGKILL) as an `error` record."""
        usage = Usage(
            max(0, spec["prompt_tokens"] - before.prompt), max(0, made - before.completion)
        )
        if not usage.completion:  # nothing generated, or all of it billed already
            return
        r = spec["request"]
        name = r["tenant"]
        key = self.admission.taken_key(name, spec.get("key_sha256", ""))
        key = key or self.admission.taken_key(name) or ApiKey(name=name)  # its secret gone
        request_id = f"{stream_id}:{secrets.token_hex(4)}"
        ticket = self.admission.taken_ticket(key, r["model"], request_id, trace_id)
        await ticket.release(outcome, usage)

    def _request(self, spec: dict[str, Any], stream_id: str) -> tuple[GenerationRequest, ApiKey]:
        """The stored request, as this instance serves it, and the key it started with."""
        r = spec["request"]
        key = self.admission.taken_key(r["tenant"], spec.get("key_sha256", ""))
        if key is None:
            raise EngineError(
                "key_revoked", f"the API key {r['tenant']!r} it was started with is gone"
            )
        models = self.engine.models
        if r["model"] not in models:
            raise EngineError("model_not_found", f"this instance does not serve {r['model']!r}")
        model = models[models.index(r["model"])]  # the engine's own string
        generation = from_stored(
            r,
            request_id=stream_id,
            model=model,
            tenant=key.name,
            priority=key.priority,
            weight=key.weight,
        )
        return generation, key

    def _stream(
        self,
        spec: dict[str, Any],
        mirror: Mirror,
        generation: GenerationRequest,
        renderer: Rebuilt,
    ) -> Stream:
        """The stream with the settings its owner gave it, empty (`_replay` fills it)."""
        s = self.settings
        stream = Stream(
            generation,
            renderer,
            format=mirror.format,
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
        stream.movable = mirror.format in SELF_RESUMING
        return stream

    async def _rebuild(
        self, spec: dict[str, Any], claim: Claim, mirror: Mirror, before: Usage
    ) -> tuple[Stream, GenerationRequest | None, int]:
        generation, key = self._request(spec, mirror.id)
        renderer = rebuild(spec["renderer"])
        stream = self._stream(spec, mirror, generation, renderer)
        transcript = _replay(stream, renderer, claim.events, spec["renderer"]["format"])
        why = transcript.why_not() if transcript.tokens else None
        if why is not None:
            raise EngineError("cannot_continue", why)
        following = continuation(generation, transcript) if transcript.tokens else generation
        remaining = following.max_tokens if following is not None else 0
        stream.billed_before = before
        try:
            ticket = await self.admission.admit(
                key,
                0,
                remaining,
                generation.model,
                # The ledger's record of the part billed here (an owner handed over recorded
                # its own).
                request_id=f"{mirror.id}:{secrets.token_hex(4)}",
                trace_id=mirror.trace_id,
                own_latency=sets_own_latency(generation.options),
                taken_over=True,
            )
        except APIError as exc:
            raise EngineError(exc.code, exc.message) from None
        stream.ticket = ticket
        cap = ticket.admitted.max_tokens
        if following is not None:  # what the key's budget left it, as a new request's
            limit = following.max_tokens if cap is None else cap
            following = following.admitted(
                limit, spec["prompt_tokens"], mirror.trace_id, None, None
            )
        return stream, following, transcript.tokens


def _billed(raw: bytes) -> Usage:
    """`Claim.billed` ("prompt completion reasoning"; b"": nothing billed yet)."""
    try:
        prompt, completion, reasoning = (int(n) for n in raw.split())
    except ValueError:  # none left: a SIGKILLed owner's
        return Usage()
    return Usage(prompt, completion, reasoning)


def _replay(
    stream: Stream, renderer: Rebuilt, events: list[tuple[int, bytes, int]], format: str
) -> Transcript:
    """Fill a taken-over stream's log with the events the store held, and read back what they
    carry: the answer's text to continue from, the tokens generated (its `carried` usage,
    billed where they were made), and its renderer's state (`formats/rebuild.py`)."""
    log = stream.log
    decoder = EventDecoder()
    parsed: list[tuple[str | None, bytes]] = []
    completion = 0
    for _, wire, tokens in events:
        log.append(wire, tokens)
        completion += tokens
        parsed += [(e.event, (e.data or "").encode()) for e in decoder.feed(wire)]
    deltas = list(decode(format, iter(parsed)))
    replay(renderer, deltas)
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
