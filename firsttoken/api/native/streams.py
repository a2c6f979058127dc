"""The native stream API's reading side: read (an EventSource-friendly GET, resumable) and
cancel a stream that `POST /v1/streams` (`adapter.py`) started."""

from __future__ import annotations

import re

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from firsttoken.api.bodies import APIError
from firsttoken.api.gateway import gateway, trace_id
from firsttoken.api.pipeline import Answer
from firsttoken.core.mirror import Mirror
from firsttoken.core.stream import Outcome, Stream
from firsttoken.formats.sse import owner_of_id
from firsttoken.resume import LOST_AHEAD, Resumed

__all__ = ["cancel_stream", "stream_events"]

_SEQ_DIGITS = 18  # under 2**63: any event id this server can have given (`sse.ids_from`)
_SEQ = re.compile(rf"[0-9]{{1,{_SEQ_DIGITS}}}")

# Sent first on every native connection: EventSource reconnects after 1 s instead of ~3 s.
_PREAMBLE = b"retry: 1000\n\n"
_ELSEWHERE = APIError(
    503,
    "server_draining",
    "this instance is shutting down; read the stream through another (with Last-Event-ID)",
    headers={"retry-after": "1"},
)


async def stream_events(request: Request) -> Answer:
    gw = gateway(request)
    try:
        stream = await _authorized_stream(request)
        event_id = _last_event_id(request)
        after = owner_of_id(event_id)[1]
        if event_id and not isinstance(stream, Mirror) and not stream.has_event(after, event_id):
            raise APIError(409, "stream_lost", LOST_AHEAD)
    except APIError as exc:
        return exc.response(trace_id(request))
    log = stream.log
    mirror = isinstance(stream, Mirror)
    if (mirror or stream.outcome is Outcome.MOVED) and gw.admission.shedder.draining:
        # On its way out, this instance sends the reader of a stream it does not generate
        # to another (a front door tries the next instance on a 503), which reads it, or
        # continues it when this one handed it over.
        return _ELSEWHERE.response(trace_id(request))
    if isinstance(stream, Mirror):
        if event_id:  # checked against the store's event of that seq (`resume.Resumed`)
            stream.resumed = Resumed(after, event_id)
        await gw.registry.tail(stream, after)
        # Give the mirror a moment to learn whether the stream already ended there.
        with anyio.move_on_after(0.5):
            while not log.closed and log.last_seq == after:
                await log.wait(after)
    if log.closed and after >= log.last_seq and _ended(stream):
        # Everything was delivered: 204 tells an EventSource to stop reconnecting.
        return Response(status_code=204, headers={"x-stream-id": stream.id})
    return gw.reader(
        stream,
        request,
        after=after,
        preamble=_PREAMBLE if stream.format == "native" else b"",
        timestamps=request.query_params.get("timestamps") in ("1", "true"),
    )


def _ended(stream: Stream | Mirror) -> bool:
    """Whether the stream's closed log is its end. Not for one handed over (its log closed
    here while another instance goes on), nor for a mirror whose tail stopped before the
    store said the stream ended: its reader is cut, and resumes, never told "all delivered"."""
    if stream.outcome is Outcome.MOVED:
        return False
    return not isinstance(stream, Mirror) or stream.ended_there


async def cancel_stream(request: Request) -> Response:
    try:
        stream = await _authorized_stream(request)
    except APIError as exc:
        return exc.response(trace_id(request))
    outcome = await gateway(request).registry.cancel(stream)
    return JSONResponse({"id": stream.id, "outcome": outcome})


async def _authorized_stream(request: Request) -> Stream | Mirror:
    # The resume token is the credential here (an EventSource can only send it in the URL).
    token = request.query_params.get("token") or request.headers.get("x-resume-token")
    auth = request.headers.get("authorization", "")
    if token is None and auth[:7].lower() == "bearer ":
        token = auth[7:].strip()
    if not token:
        raise APIError(
            401,
            "missing_token",
            "this stream needs its resume token (?token= or Authorization: Bearer)",
        )
    stream = await gateway(request).registry.find(request.path_params["stream_id"])
    # Unknown id and wrong token answer alike, so ids cannot be probed.
    if stream is None or not stream.check_token(token):
        raise APIError(
            404,
            "stream_not_found",
            "no such stream (it may have expired), or the token does not match",
        )
    return stream


def _last_event_id(request: Request) -> int:
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if raw is None or raw == "":
        return 0
    # ASCII digits only, and few enough for any log: str.isdigit() passes "²", and int() of
    # thousands of digits raises past Python's limit. Either was a 500.
    if _SEQ.fullmatch(raw) is None:
        raise APIError(
            400,
            "invalid_last_event_id",
            f"Last-Event-ID must be a sequence number (at most {_SEQ_DIGITS} digits 0-9)",
            param="last_event_id",
        )
    return int(raw)
