"""Responses that outlive their connection, read back by id: `GET /v1/responses/{id}` (the
Response as it stands, or with `?stream=true&starting_after=N` its events from the stream's
log, then live), `POST /v1/responses/{id}/cancel` and `DELETE /v1/responses/{id}`. A whole
(non-streamed) answer is read back and deleted from its record (`records.py`).

A response is its stream: `resp_<stream id>`, kept like any stream (live, then
`--resume-ttl-s` after its end; with `--redis`, any instance finds it). Its events'
`sequence_number` counts from 0 and the log's seq from 1, whoever made the event (a takeover
renders on from the same count; only the SSE `id` carries its fence), so `starting_after=N`
is the log's seq `N + 1`. Only the key that created a response reads it: another key's id
answers 404, as an unknown one does, so ids cannot be probed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from firsttoken.api.bodies import APIError
from firsttoken.api.gateway import gateway, trace_id
from firsttoken.api.pipeline import Answer
from firsttoken.api.responses.records import response_records
from firsttoken.core.mirror import Mirror
from firsttoken.core.stream import Outcome, Stream
from firsttoken.eventlog import EventLog
from firsttoken.formats.responses import ResponsesRenderer, response_object
from firsttoken.formats.sse import event_payload

__all__ = [
    "as_it_stands",
    "cancel_response",
    "current",
    "delete_response",
    "find_response",
    "log_seq",
    "retrieve_response",
    "starting_after",
]

PREFIX = "resp_"
TERMINAL = frozenset(("completed", "incomplete", "failed", "cancelled"))
_DIGITS = 18  # as Last-Event-ID's: under 2**63


def log_seq(sequence_number: int) -> int:
    """The log's seq of the event numbered `sequence_number` (the renderer counts from 0)."""
    return sequence_number + 1


def starting_after(raw: str | None, last_seq: int | None) -> int:
    """`starting_after` as the log's seq to read after (0: from the first event); `last_seq`
    is the log's last, when known. A 400 naming it for anything but a sequence number this
    response has reached."""
    if raw is None or raw == "":
        return 0
    if not (raw.isascii() and raw.isdigit() and len(raw) <= _DIGITS):
        raise APIError(
            400,
            "invalid_starting_after",
            "starting_after must be an event's sequence_number (an integer, 0 or more)",
            param="starting_after",
        )
    after = log_seq(int(raw))
    if last_seq is not None and after > last_seq:
        raise APIError(
            400,
            "invalid_starting_after",
            f"starting_after is past this response's last event so far (sequence_number "
            f"{max(last_seq - 1, 0)})",
            param="starting_after",
        )
    return after


def as_it_stands(events: Iterable[tuple[str | None, bytes]]) -> dict[str, Any] | None:
    """The Response from its events (oldest first): the last one that ended it, else the
    one that opened it, in progress. None: no Response event among them."""
    opened: dict[str, Any] | None = None
    for name, data in events:
        if name is None or not name.startswith("response."):
            continue
        response = orjson.loads(data).get("response")
        if not isinstance(response, dict):
            continue
        if response.get("status") in TERMINAL:
            return response
        if opened is None:
            opened = response
    if opened is not None:
        opened = dict(opened, status="in_progress")
    return opened


def owns(stream: Stream | Mirror, key_name: str) -> bool:
    """Whether the key named `key_name` created `stream` (an open server's callers are all
    the one unnamed key)."""
    return stream.request.tenant == key_name


_NOT_FOUND = "no response with this id (it may have expired, or been deleted)"


async def _response_stream(request: Request) -> Stream | Mirror:
    key = gateway(request).admission.authenticate(request)
    stream = await find_response(request, request.path_params["response_id"], key.name)
    if stream is None:
        raise APIError(404, "not_found", _NOT_FOUND, param="response_id")
    return stream


async def find_response(
    request: Request, response_id: str, key_name: str
) -> Stream | Mirror | None:
    """The stream of the response `response_id` of the key named `key_name`; None for one
    unknown, another format's, a whole answer's (not kept as events) or another key's: all
    alike."""
    gw = gateway(request)
    stream: Stream | Mirror | None = None
    if response_id.startswith(PREFIX):
        stream = await gw.registry.find(response_id[len(PREFIX) :])
    if (
        stream is None
        or stream.format != "responses"
        or not (isinstance(stream, Mirror) or isinstance(stream.renderer, ResponsesRenderer))
        or not owns(stream, key_name)
    ):
        return None
    store = gw.registry.store
    if store.replicates and stream.ended and not isinstance(stream, Mirror):
        # Kept here after its end, it may have been deleted through another instance: the
        # store's record says (while the store answers).
        try:
            gone = await store.lookup(stream.id) is None
        except APIError:
            gone = False
        if gone:
            return None
    return stream


def _events(log: EventLog) -> list[tuple[str | None, bytes]]:
    first = max(log.first_seq, 1)
    last = log.last_seq
    # The first event opens the Response; the last three hold its end, if it has one.
    seqs = sorted({first, *range(max(first, last - 2), last + 1)})
    return [event_payload(wire) for seq in seqs if (wire := log.wire(seq)) is not None]


async def current(
    request: Request, stream: Stream | Mirror, until_end_s: float = 0.05
) -> dict[str, Any]:
    """The Response as it stands, from the stream's log (a mirror's from the store, waiting
    `until_end_s` at most for its end)."""
    if isinstance(stream, Mirror):
        await _fill(request, stream, until_end_s)
    response = as_it_stands(_events(stream.log))
    if response is None and isinstance(stream.renderer, ResponsesRenderer):
        response = response_object(stream.renderer.base, "in_progress", [])
    if response is None:  # a mirror of another format's stream
        raise APIError(404, "not_found", _NOT_FOUND, param="response_id")
    return response


async def _fill(request: Request, mirror: Mirror, until_end_s: float = 0.05) -> None:
    """Read a mirror's log from the store, then stop it: its first event, then until it
    ends, for `until_end_s` at most (an ended stream's end comes with the backlog, in the
    tail's first read; a live one's Response is its opening event)."""
    log = mirror.log
    await gateway(request).registry.tail(mirror, 0)
    try:
        with anyio.move_on_after(1.0):
            while not log.closed and log.last_seq == 0:
                await log.wait(0)
        with anyio.move_on_after(until_end_s):
            while not log.closed:
                await log.wait(log.last_seq)
    finally:
        mirror.stop(Outcome.DISCONNECTED)


async def retrieve_response(request: Request) -> Answer:
    """`GET /v1/responses/{response_id}`: the Response, or with `stream=true` its events
    after `starting_after`, then live."""
    gw = gateway(request)
    try:
        streamed = request.query_params.get("stream") in ("true", "1")
        whole = None if streamed else await _whole_answer(request)
        if whole is not None:
            return JSONResponse(whole)
        stream = await _response_stream(request)
        if not streamed:
            return JSONResponse(await current(request, stream))
        raw = request.query_params.get("starting_after")
        if isinstance(stream, Mirror):
            after = starting_after(raw, None)  # its form; its end once the store says
            await _caught_up(request, stream, after)
            try:
                first = stream.log.wire(stream.log.first_seq)
                if first is not None and event_payload(first)[0] != "response.created":
                    # A whole answer's stream (chat chunks, folded where it ran).
                    raise APIError(404, "not_found", _NOT_FOUND, param="response_id")
                starting_after(raw, stream.log.last_seq)
            except APIError:
                stream.stop(Outcome.DISCONNECTED)  # nobody will read it
                raise
        else:
            after = starting_after(raw, stream.log.last_seq)
    except APIError as exc:
        return exc.response(trace_id(request))
    return gw.reader(stream, request, after=after)


async def _whole_answer(request: Request) -> dict[str, Any] | None:
    """A whole answer's Response, kept with its record (`records.py`): None for a stream's,
    or one not this key's."""
    key = gateway(request).admission.authenticate(request)
    kept = await response_records(request).find(request.path_params["response_id"])
    if kept is None or kept.tenant != key.name:
        return None
    return kept.response


# How long a resume through another instance waits for the store to hold the event it
# names: the owner's readers are a flush (`--redis-flush-ms`) ahead of the store, more under
# load (500 streams resumed at once on 2 busy cores: over a second, `bench/responses.py`).
CATCH_UP_S = 5.0


async def _caught_up(request: Request, mirror: Mirror, after: int) -> None:
    """Follow a mirror from the store's first event until it holds `after` (its owner's
    readers may be ahead of the store) or ends, for `CATCH_UP_S` at most."""
    log = mirror.log
    await gateway(request).registry.tail(mirror, 0)
    with anyio.move_on_after(CATCH_UP_S):
        while not log.closed and log.last_seq < max(after, 1):
            await log.wait(log.last_seq)


async def cancel_response(request: Request) -> Response:
    """`POST /v1/responses/{response_id}/cancel`: generation stops; the Response, cancelled
    (as it stands, when it had already ended)."""
    try:
        stream = await _response_stream(request)
        await gateway(request).registry.cancel(stream)
        if isinstance(stream, Mirror):  # its owner stops it, and writes its end
            response = await current(request, stream, until_end_s=1.0)
            if response.get("status") not in TERMINAL:  # not in the store yet
                response["status"] = "cancelled"
        else:
            response = await current(request, stream)
    except APIError as exc:
        return exc.response(trace_id(request))
    return JSONResponse(response)


async def delete_response(request: Request) -> Response:
    """`DELETE /v1/responses/{response_id}`: stopped if it runs, and forgotten here and in
    the shared store (the instance that made it asks the store before it answers for it)."""
    gw = gateway(request)
    response_id = request.path_params["response_id"]
    records = response_records(request)
    try:
        if await _whole_answer(request) is not None:
            await records.forget(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        stream = await _response_stream(request)
        await gw.registry.cancel(stream)
        if isinstance(stream, Mirror):
            # Its owner ends it and writes that end: deleted after, it stays deleted.
            await _fill(request, stream, until_end_s=2.0)
        gw.registry.forget(stream)  # the ended stream, before its TTL
        await gw.registry.store.delete(stream.id)  # and on every other instance
        await records.forget(response_id)  # its input
    except APIError as exc:
        return exc.response(trace_id(request))
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
