"""The Server-Sent Events wire format: every framing rule, both directions, in one place.

Encoding follows the WHATWG HTML "server-sent events" section: an event is a block of
`field: value` lines closed by a blank line. Data is split into one `data:` line per line of
text on CR, LF or CRLF, so no text can end an event early or forge another one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "DATA_FRAME",
    "PING",
    "SSE_HEADERS",
    "EventDecoder",
    "ServerSentEvent",
    "comment",
    "encode_event",
    "event_id_of",
    "event_payload",
    "ids_from",
    "owner_of_id",
    "response_headers",
    "stamp",
    "token_frame",
]

# Every event stream's response headers: no cache or proxy may hold its bytes back.
SSE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache, no-transform"),
    (b"x-accel-buffering", b"no"),
)
# A one-line data event, `%` (its seq, its data): the hot path's, for data with no line break
# (JSON's has none).
DATA_FRAME = b"id: %d\ndata: %s\n\n"

# An event's id is its seq, for the events of a stream's first owner. An instance that takes
# the stream over numbers its own events `fence × OWNER_IDS + seq` (`fence`: its claim, 2 for
# the first takeover): the same seq made by two owners has two ids, so a reader that comes
# back with the id of an event the store never got (its owner died before writing it) is
# told, never given the new owner's different event of that seq (`resume/tailer.py`).
OWNER_IDS = 10**12


def ids_from(fence: int) -> int:
    """What the ids of the events made by the owner of `fence` add to their seq."""
    return 0 if fence <= 1 else fence * OWNER_IDS


def owner_of_id(event_id: int) -> tuple[int, int]:
    """An id as (the fence of the owner that made the event, its seq)."""
    fence, seq = divmod(event_id, OWNER_IDS)
    return max(fence, 1), seq


def event_id_of(wire: bytes) -> int | None:
    """The id a framed event carries (None: none, or not a number)."""
    if not wire.startswith(b"id: "):
        return None
    end = wire.find(b"\n")
    raw = wire[4:end]
    return int(raw) if raw.isdigit() else None


def _id_field(id_base: int) -> bytes:
    """`id: %d`, for the `%` of a seq, as the events after `id_base` are numbered: the base
    is written as digits ahead of the seq (no addition per token)."""
    if not id_base:
        return b"id: %d"
    fence = id_base // OWNER_IDS
    return b"id: %d%%0%dd" % (fence, len(str(OWNER_IDS)) - 1)


def response_headers(
    stream_id: str, trace_id: str, extra: dict[str, str] | None = None
) -> list[tuple[bytes, bytes]]:
    """An event stream's response headers: `SSE_HEADERS`, its ids, and `extra`."""
    headers = [
        *SSE_HEADERS,
        (b"x-stream-id", stream_id.encode()),
        (b"x-request-id", trace_id.encode()),
    ]
    for name, value in (extra or {}).items():
        headers.append((name.lower().encode(), value.encode()))
    return headers


def token_frame(event: str | None, prefix: bytes, suffix: bytes, id_base: int = 0) -> bytes:
    """The frame of a token event, `%` (its seq, its JSON-escaped text): `id: <seq>\n`
    [`event: <name>\n`] `data: <prefix><text><suffix>\n\n`. Built once per text run, so a
    token costs one %-format; `prefix` and `suffix` hold no line break (JSON). `id_base`:
    the ids of a stream taken over (`ids_from`)."""
    head = _id_field(id_base) + b"\n"
    if event is not None:
        head += b"event: " + event.encode() + b"\n"
    return (
        head
        + b"data: "
        + prefix.replace(b"%", b"%%")
        + b"%s"
        + suffix.replace(b"%", b"%%")
        + b"\n\n"
    )


def stamp(unix_time: float) -> bytes:
    """A comment line before an event that says when it was sent (`timestamps`, for
    diagnosis): `: t=<unix time>`."""
    return b": t=%.6f\n" % unix_time


def event_payload(wire: bytes) -> tuple[str | None, bytes]:
    """A framed event's name and data, for events framed here (one `data:` line: JSON has
    no raw line breaks)."""
    name: str | None = None
    data = b""
    for line in wire.split(b"\n"):
        if line.startswith(b"data: "):
            data = line[6:]
        elif line.startswith(b"event: "):
            name = line[7:].decode()
    return name, data


_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_FORBIDDEN_IN_FIELD = ("\r", "\n", "\0")


def comment(text: str) -> bytes:
    """A comment block (ignored by parsers): used for heartbeats and send timestamps."""
    return b"".join(b": " + line.encode() + b"\n" for line in _LINE_BREAK.split(text)) + b"\n"


PING = comment("ping")


@dataclass(slots=True)
class ServerSentEvent:
    data: str | None = None
    event: str | None = None
    id: str | None = None
    retry: int | None = None

    def encode(self) -> bytes:
        parts: list[str] = []
        if self.id is not None:
            _check_field("id", self.id)
            parts.append(f"id: {self.id}\n")
        if self.event is not None:
            _check_field("event", self.event)
            parts.append(f"event: {self.event}\n")
        if self.retry is not None:
            parts.append(f"retry: {int(self.retry)}\n")
        data = self.data
        if data is not None:
            if "\n" in data or "\r" in data:
                parts.extend(f"data: {line}\n" for line in _LINE_BREAK.split(data))
            else:
                parts.append(f"data: {data}\n")
        parts.append("\n")
        return "".join(parts).encode()


def encode_event(seq: int, data: bytes, event: str | None = None) -> bytes:
    """Fast path for the per-token hot path: one `id:` and one-line data (JSON has no raw
    line breaks); anything else goes through `ServerSentEvent.encode`. `find`, not `in`: on
    bytes, `in` first tries its operand as an int and formats a TypeError (~0.6 µs)."""
    if event is None and data.find(b"\n") < 0 and data.find(b"\r") < 0:
        return DATA_FRAME % (seq, data)
    return ServerSentEvent(data=data.decode(), event=event, id=str(seq)).encode()


def _check_field(name: str, value: str) -> None:
    # A line break here would end the field and let the rest forge new fields or events.
    if any(c in value for c in _FORBIDDEN_IN_FIELD):
        raise ValueError(f"SSE {name} must not contain CR, LF or NUL")


class EventDecoder:
    """Incremental parser for an event stream, per the WHATWG algorithm.

    Feed bytes as they arrive; complete events come out. `last_event_id` persists across events
    as the spec requires, so a reconnecting client knows where it stopped.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._pending_cr = False
        self._decoder_tail = b""
        self._data: list[str] = []
        self._event = ""
        self._has_fields = False
        self._started = False
        self.last_event_id = ""
        self.retry: int | None = None
        self.comments: list[str] = []

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        raw = self._decoder_tail + chunk
        # Keep an incomplete UTF-8 sequence for the next chunk.
        cut = _utf8_safe_end(raw)
        self._decoder_tail = raw[cut:]
        text = raw[:cut].decode("utf-8", errors="replace")
        return list(self._feed_text(text))

    def _feed_text(self, text: str) -> Iterator[ServerSentEvent]:
        if not self._started:
            self._started = bool(text)
            text = text.removeprefix("\ufeff")
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]
        self._pending_cr = False
        buf = self._buffer + text
        start = 0
        n = len(buf)
        while True:
            i = _find_eol(buf, start)
            if i < 0:
                break
            line = buf[start:i]
            if buf[i] == "\r":
                if i + 1 < n and buf[i + 1] == "\n":
                    start = i + 2
                elif i + 1 == n:
                    self._pending_cr = True
                    start = i + 1
                else:
                    start = i + 1
            else:
                start = i + 1
            event = self._line(line)
            if event is not None:
                yield event
        self._buffer = buf[start:]

    def _line(self, line: str) -> ServerSentEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            self.comments.append(line[1:].removeprefix(" "))
            return None
        name, sep, value = line.partition(":")
        if sep:
            value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
            self._has_fields = True
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self.last_event_id = value
        elif name == "retry":
            # ASCII digits only (str.isdigit takes '²'), and few enough for int().
            if 0 < len(value) <= 18 and value.isascii() and value.isdigit():
                self.retry = int(value)
        return None

    def pending_bytes(self) -> int:
        """Characters held for an event not yet complete: a reader bounds it, or a garbage
        upstream without newlines (or blank lines) grows it without end."""
        return len(self._buffer) + sum(len(d) for d in self._data)

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._has_fields:
            self._event = ""
            return None
        event = ServerSentEvent(
            data="\n".join(self._data),
            event=self._event or None,
            id=self.last_event_id or None,
        )
        self._data = []
        self._event = ""
        self._has_fields = False
        return event


def _find_eol(buf: str, start: int) -> int:
    lf = buf.find("\n", start)
    cr = buf.find("\r", start)
    if lf < 0:
        return cr
    if cr < 0:
        return lf
    return min(lf, cr)


def _utf8_safe_end(raw: bytes) -> int:
    """Index up to which `raw` holds only complete UTF-8 sequences."""
    n = len(raw)
    for back in range(1, min(4, n) + 1):
        b = raw[n - back]
        if b & 0xC0 != 0x80:  # a lead byte (or ASCII)
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4
            return n if back >= need else n - back
    return n
