"""The framer: a renderer's payloads as SSE frames, numbered, in one stream's event log.

A `Stream` decides what happens (a token, a structured part, the finish, an error) and counts
it; its `Framer` decides what bytes that is: the renderer's events, each framed with its id
(`seq + id_base`) and appended to the log, text tokens through one template per text run, or
through the coalescer when the stream has a chunking policy.

The hot path stays in `Stream.push`: when a text run has a template and nothing else watches
its tokens (no coalescing, no progress events), `enter_text` hands the stream that template,
and the stream appends each token's frame itself; the framer is not called per token then.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from firsttoken.core.chunking import CoalescePolicy, Coalescer
from firsttoken.eventlog import EventLog
from firsttoken.formats.sse import DATA_FRAME, encode_event, ids_from, token_frame
from firsttoken.generation import Delta

if TYPE_CHECKING:
    from firsttoken.core.stream import Renderer

__all__ = ["SHOWS_META", "Framer"]

_dumps = orjson.dumps

# Formats whose readers are told of splices and takeovers as `event: meta` (the native
# client); the others' readers read the answer only.
SHOWS_META = frozenset({"native"})

Events = Sequence[tuple[str | None, bytes]]


class Framer:
    """One stream's renderer and the frames it appends to the stream's log."""

    # Slots: one framer per stream, ten thousand of them waiting.
    __slots__ = (
        "_coalescer",
        "_flush_timer",
        "_token_event",
        "id_base",
        "log",
        "on_text",
        "renderer",
        "shows_meta",
        "template",
    )

    def __init__(self, renderer: Renderer, log: EventLog, *, shows_meta: bool) -> None:
        self.renderer = renderer
        self.log = log
        self.shows_meta = shows_meta
        self._token_event = renderer.token_event
        # The current text run's frame (a %-format of seq and the JSON text), or None: every
        # token goes through `renderer.token` (a renderer that keeps the text).
        self.template: bytes | None = None
        # What the ids of the events it frames add to their seq: 0, unless another instance
        # made the stream's first events (`number_as`, a takeover).
        self.id_base = 0
        self._coalescer: Coalescer | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        # Told after each text event (progress events); None: nobody watches. Cleared by
        # `close`: it is the stream's, which holds this framer.
        self.on_text: Callable[[], None] | None = None

    def opening(self, coalesce: CoalescePolicy | None) -> None:
        """Append the opening events; text is coalesced under `coalesce` from now on."""
        if coalesce is not None:
            self._coalescer = Coalescer(coalesce)
        self.events(self.renderer.opening())

    def enter_text(self) -> Callable[[str], None]:
        """Answer text starts (or starts again after reasoning or a tool call): the
        renderer's opening for it, and the template its tokens take. Returns what takes
        each text token from now on (`hot` says whether the stream may frame them itself)."""
        renderer = self.renderer
        self.events(renderer.begin_text())
        template = renderer.token_template()
        # One %-format per token (or per coalesced chunk).
        self.template = (
            None if template is None else token_frame(self._token_event, *template, self.id_base)
        )
        return self.text if self._coalescer is None else self.coalesce

    def hot(self) -> bool:
        """Whether the stream may frame text tokens itself with `template`: nothing but the
        log sees them (no coalescer, no progress events)."""
        return self._coalescer is None and self.on_text is None

    def number_as(self, fence: int) -> None:
        """Number the events framed from now on as the owner of `fence` (a takeover): their
        ids say which instance made them (`formats.sse.ids_from`)."""
        self.id_base = ids_from(fence)
        if self.template is not None:
            template = self.renderer.token_template()
            self.template = (
                None
                if template is None
                else token_frame(self._token_event, *template, self.id_base)
            )

    # -- events ----------------------------------------------------------------------------

    def events(self, events: Events) -> None:
        log, base = self.log, self.id_base
        for name, data in events:  # `append`'s, inline: a stream's opening and closing events
            log.append(encode_event(log.last_seq + 1 + base, data, name), 0)

    def append(self, name: str | None, data: bytes, tokens: int = 0) -> None:
        log = self.log
        log.append(encode_event(log.last_seq + 1 + self.id_base, data, name), tokens)

    def text(self, text: str, tokens: int = 1) -> None:
        """A text event (a token, or a coalesced chunk of `tokens` tokens)."""
        log = self.log
        template = self.template
        if template is not None:
            log.append(template % (log.last_seq + 1, _dumps(text)), tokens)
        else:
            data = self.renderer.token(text)
            token_event = self._token_event
            if token_event is None:
                # JSON has no raw line breaks: the one-line frame needs no checks.
                log.append(DATA_FRAME % (log.last_seq + 1 + self.id_base, data), tokens)
            else:
                seq = log.last_seq + 1 + self.id_base
                log.append(encode_event(seq, data, token_event), tokens)
        if self.on_text is not None:
            self.on_text()

    def part(self, delta: Delta) -> None:
        """A structured delta's events (it counts as one token, on its last event)."""
        self.flush()
        events = self.renderer.part(delta)
        last = len(events) - 1
        for i, (name, data) in enumerate(events):
            self.append(name, data, 1 if i == last else 0)

    def meta(self, meta: Mapping[str, Any]) -> bool:
        """News about the stream (a splice, a takeover), for the formats that show it: True
        when it was framed (it ends the text run)."""
        if not self.shows_meta:
            return False
        self.flush()
        self.append("meta", _dumps(meta))
        return True

    def closing(self, reason: str, usage: dict[str, Any]) -> None:
        self.flush()
        self.events(self.renderer.closing(reason, usage))

    def error(self, code: str, message: str, type_: str) -> None:
        self.events(self.renderer.error(code, message, type_))

    # -- coalescing ------------------------------------------------------------------------

    def coalesce(self, text: str) -> None:
        """Tokens go through the coalescer as they come. A pending chunk's deadline is one
        loop timer per stream, armed when a chunk opens and not cancelled when a boundary
        flushes it first: when it fires it flushes what is due or re-arms for what is pending."""
        coalescer = self._coalescer
        assert coalescer is not None  # `enter_text` hands this out only with one
        now = time.perf_counter()
        for chunk in coalescer.push(text, now):
            self.text(chunk.text, chunk.tokens)
        deadline = coalescer.deadline
        if deadline is not None and self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(max(0.0, deadline - now), self._flush_due)

    def _flush_due(self) -> None:
        self._flush_timer = None
        coalescer = self._coalescer
        if coalescer is None:  # closed
            return
        now = time.perf_counter()
        for chunk in coalescer.due(now):
            self.text(chunk.text, chunk.tokens)
        deadline = coalescer.deadline
        if deadline is not None:  # a newer chunk opened after the one this timer was for
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(max(0.0, deadline - now), self._flush_due)

    def flush(self) -> None:
        """Frame what the coalescer holds (before any other event: never merged across)."""
        if self._coalescer is not None:
            for chunk in self._coalescer.flush():
                self.text(chunk.text, chunk.tokens)

    def close(self) -> None:
        """The stream ended or moved (what was pending framed already): nothing is after."""
        self._coalescer = None
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self.on_text = None
