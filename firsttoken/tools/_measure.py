"""One measured stream: send the request, timestamp every network read, decode the events.

Timing is taken per read off the socket (httpx `aiter_raw`), before any decoding, so what is
reported is when bytes reached this process, not when Python got round to parsing them.
"""

from __future__ import annotations

import itertools
import json
import re
import socket
import ssl
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpcore._backends.anyio  # noqa: F401  (see below)
import httpx

from firsttoken.formats.sse import EventDecoder, ServerSentEvent
from firsttoken.tools._tcpinfo import content_marker

__all__ = [
    "Comment",
    "Event",
    "Kind",
    "Read",
    "RequestSpec",
    "StreamResult",
    "detect_kind",
    "measure_stream",
]

# httpx imports its anyio network backend on the first connection; importing it above keeps
# that (tens of ms) out of the first request's connect and send times.
_SERVER_T = re.compile(r"^t=(\d+(?:\.\d+)?)$")
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")
_ERROR_BODY_LIMIT = 65536
# Error codes of answers that were not event streams (the HTTP status, or this one).
NOT_STREAMS = ("not_a_stream",)


class Kind(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"  # the OpenAI Responses API
    MESSAGES = "messages"  # the Anthropic Messages API
    NATIVE = "native"
    SSE = "sse"


def detect_kind(url: str) -> Kind:
    """The request shape from the URL path (see docs/tools.md)."""
    path = urlsplit(url).path.rstrip("/")
    if path.endswith("/chat/completions"):
        return Kind.CHAT
    if path.endswith("/completions"):
        return Kind.COMPLETIONS
    if path.endswith("/responses"):
        return Kind.RESPONSES
    if path.endswith("/messages"):
        return Kind.MESSAGES
    if path.endswith("/v1/streams"):
        return Kind.NATIVE
    return Kind.SSE


# Named events that carry answer text, the end, or an error, in the typed-event formats.
_TEXT_EVENTS = {
    "response.output_text.delta",
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
    "response.refusal.delta",
    "response.function_call_arguments.delta",
    "content_block_delta",
}
_END_EVENTS = {"response.completed", "response.incomplete", "message_stop"}
_ERROR_EVENTS = {"error", "response.failed"}


@dataclass(slots=True)
class RequestSpec:
    url: str
    kind: Kind
    prompt: str
    model: str | None = None
    max_tokens: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    include_usage: bool = True
    timestamps: bool = False  # ask for `: t=` send stamps (firsttoken's extension)

    def body(self) -> dict[str, Any] | None:
        body: dict[str, Any]
        limit = "max_tokens"
        if self.kind is Kind.CHAT:
            body = {"messages": [{"role": "user", "content": self.prompt}], "stream": True}
        elif self.kind is Kind.COMPLETIONS:
            body = {"prompt": self.prompt, "stream": True}
        elif self.kind is Kind.RESPONSES:
            body, limit = {"input": self.prompt, "stream": True}, "max_output_tokens"
        elif self.kind is Kind.MESSAGES:
            # The API requires max_tokens: without --max-tokens, a ceiling no answer here reaches.
            body = {"messages": [{"role": "user", "content": self.prompt}], "stream": True}
            body["max_tokens"] = 4096
        elif self.kind is Kind.NATIVE:
            body = {"prompt": self.prompt}
        else:
            return None
        if self.model is not None:
            body["model"] = self.model
        if self.kind in (Kind.CHAT, Kind.COMPLETIONS):
            options: dict[str, Any] = {}
            if self.include_usage:
                options["include_usage"] = True
            if self.timestamps:
                options["timestamps"] = True
            if options:
                body["stream_options"] = options
        if self.max_tokens is not None:
            body[limit] = self.max_tokens
        body.update(self.extra_body)
        return body


@dataclass(slots=True)
class Event:
    """One SSE event as received. `t` is seconds since the request started."""

    t: float
    data: str
    event: str | None
    id: str | None  # only when this event's block carried its own `id:` line
    size: int  # bytes of the event's block on the (decoded) stream
    server_t: float | None = None  # epoch seconds from a preceding `: t=` comment
    role: str = "other"  # content | done | error | meta | usage | other
    text: str = ""
    seq: int = 0  # wire order among events and comments


@dataclass(slots=True)
class Comment:
    t: float
    text: str
    seq: int = 0


@dataclass(slots=True)
class Read:
    """One piece off the wire: when it arrived, when we were done with it, its sizes."""

    t: float
    done_t: float
    wire: int
    decoded: int


@dataclass
class StreamResult:
    url: str
    kind: Kind
    started_at: float  # epoch seconds at request start
    status: int | None = None
    http_version: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # When the request was fully written (the server can start): TTFT counts from here. For
    # native streams that is the POST; `sse_request_t` is when the SSE GET was written.
    sent_t: float = 0.0
    sse_request_t: float = 0.0
    connect_s: float | None = None  # TCP connect, when this request opened a connection
    headers_t: float | None = None
    end_t: float = 0.0
    events: list[Event] = field(default_factory=list)
    comments: list[Comment] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    error: dict[str, str] | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None

    @property
    def content(self) -> list[Event]:
        return [e for e in self.events if e.role == "content"]

    @property
    def done(self) -> bool:
        return any(e.role == "done" for e in self.events)

    @property
    def wire_bytes(self) -> int:
        return sum(r.wire for r in self.reads)

    @property
    def decoded_bytes(self) -> int:
        return sum(r.decoded for r in self.reads)

    @property
    def ttft(self) -> float | None:
        """First content event after the request was sent, as the server counts it."""
        content = self.content
        return content[0].t - self.sent_t if content else None

    @property
    def ttft_e2e(self) -> float | None:
        """First content event after we started: connect and send included."""
        content = self.content
        return content[0].t if content else None

    @property
    def intervals(self) -> list[float]:
        ts = [e.t for e in self.content]
        return [b - a for a, b in itertools.pairwise(ts)]

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.done

    @property
    def is_stream(self) -> bool:
        """An answer whose body was read as events (200 and an event-stream, or untyped)."""
        return self.status == 200 and (self.error or {}).get("code") not in NOT_STREAMS

    def problem(self) -> str | None:
        """One line when there was nothing to measure: no answer, or not an event stream."""
        err = self.error or {}
        if self.status is None and err:
            return f"no answer from {self.url}: {err['message']}"
        if self.is_stream:
            return None
        ctype = self.headers.get("content-type") or "no content type"
        said = f": {err['message']}" if err.get("message") else ""
        return f"{self.url} answered {self.status} ({ctype}), not an event stream{said}"


def classify(ev: Event) -> None:
    """Fill `role` and `text`: what the event means for the measurement."""
    data = ev.data
    if ev.event == "error":
        ev.role = "error"
        return
    if data.strip() == "[DONE]":
        ev.role = "done"
        return
    try:
        obj: Any = json.loads(data)
    except ValueError:
        obj = None
    if ev.event in _ERROR_EVENTS:
        ev.role = "error"
        return
    if ev.event in _END_EVENTS:
        ev.role = "done"
        return
    if ev.event in _TEXT_EVENTS and isinstance(obj, dict):
        delta = obj.get("delta")
        if isinstance(delta, dict):  # Anthropic: text_delta, thinking_delta, input_json_delta
            delta = delta.get("text") or delta.get("thinking") or delta.get("partial_json")
        ev.role, ev.text = ("content", delta) if isinstance(delta, str) and delta else ("other", "")
        return
    if ev.event not in (None, "message"):
        ev.role = "meta" if ev.event == "meta" else "other"
        return
    if not isinstance(obj, dict):
        # Plain-text SSE (or a JSON scalar): the data is the content.
        ev.role, ev.text = "content", data
        return
    choices = obj.get("choices")
    if isinstance(choices, list):
        if not choices:
            ev.role = "usage" if obj.get("usage") else "other"
            return
        c0 = choices[0] if isinstance(choices[0], dict) else {}
        delta = c0.get("delta") if isinstance(c0.get("delta"), dict) else {}
        text = (
            delta.get("content")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or c0.get("text")
            or ""
        )
        ev.role, ev.text = ("content", str(text)) if text else ("other", "")
        return
    if "error" in obj:
        ev.role = "error"
        return
    for key in ("token", "text", "content", "delta"):
        value = obj.get(key)
        if isinstance(value, str):
            ev.role, ev.text = "content", value
            return
    ev.role = "other"


class _Body:
    """Content decoding, line splitting and SSE decoding of one response body."""

    def __init__(self, encoding: str, result: StreamResult) -> None:
        self._result = result
        self._zlib: Any = None
        self._deflate_probe = False
        enc = encoding.strip().lower()
        if enc in ("gzip", "x-gzip"):
            self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif enc == "deflate":
            self._zlib = zlib.decompressobj()
            self._deflate_probe = True
        self._partial = b""
        self._decoder = EventDecoder()
        self._block_bytes = 0
        self._block_has_id = False
        self._pending_t: float | None = None
        self._seq = 0
        self._after_cr = False
        self.content_events = 0

    def decode(self, raw: bytes) -> bytes:
        if self._zlib is None:
            return raw
        try:
            return bytes(self._zlib.decompress(raw))
        except zlib.error:
            # "deflate" in the wild is sometimes raw deflate without the zlib header.
            if self._deflate_probe:
                self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
                self._deflate_probe = False
                return bytes(self._zlib.decompress(raw))
            raise

    def feed(self, t: float, data: bytes) -> None:
        buf = self._partial + data
        pos = 0
        for m in _LINE.finditer(buf):
            self._line(t, m.group(0))
            pos = m.end()
        self._partial = buf[pos:]

    def _line(self, t: float, line: bytes) -> None:
        # Fed a line at a time so comments (`: t=`) and id lines keep their order with events.
        self._block_bytes += len(line)
        if line.startswith(b"id:") or line.rstrip(b"\r\n") == b"id":
            self._block_has_id = True
        before = len(self._decoder.comments)
        events = self._decoder.feed(line)
        for text in self._decoder.comments[before:]:
            self._seq += 1
            self._result.comments.append(Comment(t, text, self._seq))
            m = _SERVER_T.match(text.strip())
            if m:
                self._pending_t = float(m.group(1))
        # A lone LF right after a CR is the rest of a CRLF split across reads, not a blank line.
        split_crlf = self._after_cr and line == b"\n"
        self._after_cr = line.endswith(b"\r")
        if line.strip(b"\r\n") == b"" and not events and not split_crlf:
            self._block_bytes = 0
            self._block_has_id = False
        for sse in events:
            self._event(t, sse)

    def _event(self, t: float, sse: ServerSentEvent) -> None:
        ev = Event(
            t=t,
            data=sse.data or "",
            event=sse.event,
            id=sse.id if self._block_has_id else None,
            size=self._block_bytes,
            server_t=self._pending_t,
        )
        self._seq += 1
        ev.seq = self._seq
        self._block_bytes = 0
        self._block_has_id = False
        self._pending_t = None
        classify(ev)
        result = self._result
        result.events.append(ev)
        self.content_events += ev.role == "content"
        if ev.role == "error":
            result.error = _error_of(ev.data, default_code="stream_error")
        elif ev.role in ("content", "other", "usage", "done", "meta"):
            _note_end_fields(ev.data, result)


def _note_end_fields(data: str, result: StreamResult) -> None:
    """Usage and why the answer ended, in whichever API's words: Chat/Completions
    `finish_reason`, native `event: meta` `finish_reason`, Anthropic `stop_reason`, Responses
    `status` (`completed`, or the `incomplete_details.reason`, e.g. `max_output_tokens`)."""
    if (
        '"usage"' not in data
        and '"finish_reason"' not in data
        and '"stop_reason"' not in data
        and '"status"' not in data
    ):
        return
    try:
        obj = json.loads(data)
    except ValueError:
        return
    if not isinstance(obj, dict):
        return
    if isinstance(obj.get("usage"), dict):
        result.usage = obj["usage"]
    if isinstance(obj.get("finish_reason"), str):  # native: the closing `event: meta`
        result.finish_reason = obj["finish_reason"]
    response = obj.get("response")  # Responses: response.completed carries usage
    if isinstance(response, dict):
        if isinstance(response.get("usage"), dict):
            result.usage = response["usage"]
        status = response.get("status")
        details = response.get("incomplete_details")
        if status == "incomplete" and isinstance(details, dict) and details.get("reason"):
            result.finish_reason = str(details["reason"])
        elif status in ("completed", "incomplete"):
            result.finish_reason = str(status)
    delta = obj.get("delta")  # Anthropic: message_delta carries the stop reason
    if isinstance(delta, dict) and delta.get("stop_reason"):
        result.finish_reason = str(delta["stop_reason"])
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        if reason:
            result.finish_reason = str(reason)


def _error_of(body: str, default_code: str) -> dict[str, str]:
    try:
        obj = json.loads(body)
    except ValueError:
        return {"code": default_code, "message": body[:300]}
    err = obj.get("error") if isinstance(obj, dict) else None
    response = obj.get("response") if isinstance(obj, dict) else None
    if err is None and isinstance(response, dict):  # Responses: response.failed
        err = response.get("error")
    if isinstance(err, dict):
        code = err.get("code") or err.get("type") or default_code
        return {"code": str(code), "message": str(err.get("message", ""))[:300]}
    if isinstance(err, str):
        return {"code": default_code, "message": err[:300]}
    return {"code": default_code, "message": body[:300]}


def _answer_error(body: str, code: str) -> dict[str, str]:
    """An answer that is not a stream: `code` (the status), and the body's own words."""
    said = _error_of(body, default_code="")
    message = f"{said['code']}: {said['message']}" if said["code"] else said["message"]
    return {"code": code, "message": " ".join(message.split())[:300]}


def _network_why(exc: httpx.HTTPError) -> str:
    """Why nothing answered, in words: refused, unknown host, TLS, …"""
    text = str(exc)
    cause: BaseException | None = exc
    while cause is not None:  # the OS's reason is at the bottom of httpcore's chain
        if isinstance(cause, ssl.SSLError):
            return f"TLS failed: {cause.reason or cause}"
        if isinstance(cause, socket.gaierror):
            return f"unknown host ({cause.strerror})"
        if isinstance(cause, OSError) and cause.strerror:
            text = cause.strerror
        cause = cause.__cause__ or cause.__context__
    lowered = text.lower()
    if "connection refused" in lowered or "connect call failed" in lowered:
        return "connection refused (is the server running, on this port?)"
    if "name or service not known" in lowered or "nodename nor servname" in lowered:
        return "unknown host"
    if "certificate" in lowered or "ssl" in lowered:
        return f"TLS failed: {text[:200]}"
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _with_query(url: str, name: str, value: str) -> str:
    parts = urlsplit(url)
    query = "&".join(q for q in (parts.query, f"{name}={value}") if q)
    return urlunsplit(parts._replace(query=query))


def _note_sent(result: StreamResult, marks: dict[str, float]) -> None:
    result.sent_t = marks.get("send_request_body.complete", 0.0)
    if "connect_tcp.started" in marks and "connect_tcp.complete" in marks:
        result.connect_s = marks["connect_tcp.complete"] - marks["connect_tcp.started"]


async def measure_stream(client: httpx.AsyncClient, spec: RequestSpec) -> StreamResult:
    """Run one streaming request and record everything about its arrival."""
    t0 = time.perf_counter()
    result = StreamResult(url=spec.url, kind=spec.kind, started_at=time.time())

    def rel() -> float:
        return time.perf_counter() - t0

    def tracer(marks: dict[str, float]) -> dict[str, Any]:
        async def trace(name: str, info: dict[str, Any]) -> None:
            marks.setdefault(name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1], rel())

        return {"trace": trace}

    first: dict[str, float] = {}
    second: dict[str, float] = {}

    headers = {"Accept": "text/event-stream", "Accept-Encoding": "gzip, deflate"}
    headers.update(spec.headers)
    method, url, body = (
        ("GET", spec.url, None) if spec.kind is Kind.SSE else ("POST", spec.url, spec.body())
    )
    try:
        if spec.kind is Kind.NATIVE:
            created = await client.post(
                url,
                json=body,
                headers={**headers, "Accept": "application/json"},
                extensions=tracer(first),
            )
            _note_sent(result, first)
            if created.status_code not in (200, 201):
                result.status = created.status_code
                result.headers = {k.lower(): v for k, v in created.headers.items()}
                result.error = _answer_error(created.text, str(created.status_code))
                return result
            info = created.json()
            method, url, body = "GET", urljoin(str(created.url), info["events_url"]), None
        if spec.timestamps and method == "GET":
            url = _with_query(url, "timestamps", "1")
        marks = second if spec.kind is Kind.NATIVE else first
        async with client.stream(
            method, url, json=body, headers=headers, extensions=tracer(marks)
        ) as resp:
            result.headers_t = rel()
            result.sse_request_t = marks.get("send_request_body.complete", 0.0)
            if spec.kind is not Kind.NATIVE:
                _note_sent(result, marks)
            result.status = resp.status_code
            result.http_version = resp.http_version
            result.headers = {k.lower(): v for k, v in resp.headers.items()}
            ctype = resp.headers.get("content-type", "")
            if resp.status_code != 200 or (ctype and "text/event-stream" not in ctype.lower()):
                raw = (await resp.aread())[:_ERROR_BODY_LIMIT]
                code = str(resp.status_code) if resp.status_code != 200 else "not_a_stream"
                result.error = _answer_error(raw.decode("utf-8", "replace"), code)
                return result
            await _read_events(resp, result, rel)
    except httpx.TimeoutException as exc:
        result.error = {"code": "timeout", "message": f"{type(exc).__name__}: {exc}"}
    except httpx.HTTPError as exc:
        result.error = {"code": type(exc).__name__, "message": _network_why(exc)}
    except (zlib.error, KeyError, ValueError) as exc:
        result.error = {"code": type(exc).__name__, "message": str(exc)[:300]}
    finally:
        result.end_t = rel()
    if result.error is None and result.status == 200 and not result.done:
        result.error = {"code": "no_done", "message": "stream ended without [DONE]"}
    return result


async def _read_events(
    resp: httpx.Response, result: StreamResult, rel: Callable[[], float]
) -> None:
    """An event stream's body as it arrives: each read's time and sizes, its events decoded."""
    decoder = _Body(resp.headers.get("content-encoding", ""), result)
    # `diag --packet-loss` is told which reads carried content, so that its gaps are
    # inter-chunk gaps, not the wait for the first token.
    mark = content_marker(resp.extensions.get("network_stream"))
    seen = 0
    async for raw in resp.aiter_raw():
        t = rel()
        data = decoder.decode(raw)
        decoder.feed(t, data)
        result.reads.append(Read(t=t, done_t=rel(), wire=len(raw), decoded=len(data)))
        if mark is not None and decoder.content_events > seen:
            mark(seen == 0)
            seen = decoder.content_events
