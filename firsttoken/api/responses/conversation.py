"""Stored conversations: a Response's input kept as items (`records.py`), listed by
`GET /v1/responses/{id}/input_items`, and `previous_response_id`, which prepends an earlier
response's input items and its output to a new request's input.

As OpenAI's: the earlier response's `instructions` are not carried over (the new request's
own apply); its input items already hold the conversation before it, so a chain of
responses is one list that grows; each input item has an id (its own, or
`<kind>_<response key>_in<index>`).
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from firsttoken.admission.keys import ApiKey
from firsttoken.api.bodies import APIError
from firsttoken.api.gateway import gateway, trace_id
from firsttoken.api.responses.protocol import InputItem, MessageItem, ResponsesRequest
from firsttoken.api.responses.records import Kept, response_records
from firsttoken.api.responses.stored import PREFIX, TERMINAL, current, find_response
from firsttoken.core.stream import Stream
from firsttoken.telemetry.log import log_event

__all__ = [
    "input_items",
    "keep_answer",
    "keep_input",
    "keep_input_later",
    "prepare",
    "stored_items",
]

_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])
_KINDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
MAX_LIST = 100  # input_items' `limit`, as OpenAI bounds it


def stored_items(own: str | list[Any], key: str) -> list[dict[str, Any]]:
    """A request's own input as the items input_items lists: a string is one user message;
    each item has an id and its content as parts."""
    if isinstance(own, str):
        return [_message(f"msg_{key}_in0", "user", [{"type": "input_text", "text": own}])]
    items: list[dict[str, Any]] = []
    for index, item in enumerate(own):
        data = item.model_dump(mode="json", exclude_none=True, by_alias=True)
        if data.get("type") == "message" and isinstance(data.get("content"), str):
            kind = "output_text" if data["role"] == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": data["content"]}]
            data.setdefault("status", "completed")
        data.setdefault("id", f"{_KINDS.get(data['type'], 'rs')}_{key}_in{index}")
        items.append(data)
    return items


def _message(item_id: str, role: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": role,
        "content": content,
        "status": "completed",
    }


async def prepare(request: Request, key: ApiKey, body: ResponsesRequest) -> ResponsesRequest:
    """`body` with the stored conversation of its `previous_response_id` before its input;
    what storing it takes of the key's caps checked (`store` false: nothing is kept)."""
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        earlier = await _conversation(request, key, body.previous_response_id)
    if body.store is not False:
        own = (
            body.input
            if isinstance(body.input, str)
            else [item.model_dump(mode="json", exclude_none=True) for item in body.input]
        )
        response_records(request).admit(
            key.name, len(orjson.dumps(earlier)) + len(orjson.dumps(own))
        )
    if not earlier:
        return body
    parsed: list[Any] = []
    for item in earlier:
        try:
            parsed.extend(_ITEMS.validate_python([item]))
        except ValidationError:
            continue  # an output item the API takes no input of (none yet: kept anyway)
    own_items = (
        [MessageItem(role="user", content=body.input)]
        if isinstance(body.input, str)
        else list(body.input)
    )
    merged = body.model_copy(update={"input": parsed + own_items})
    merged._earlier = earlier
    merged._own = len(parsed)
    return merged


async def _conversation(request: Request, key: ApiKey, previous_id: str) -> list[dict[str, Any]]:
    """The stored response's input items and its output. A 404 naming the field for one
    unknown, expired, deleted or another key's; a 400 for one still running."""
    kept = await response_records(request).find(previous_id)
    if kept is None or kept.tenant != key.name:
        raise _previous_missing(previous_id)
    response = kept.response
    if response is None:  # a stream: its output is in its log
        stream = await find_response(request, previous_id, key.name)
        if stream is None:
            raise _previous_missing(previous_id)
        response = await current(request, stream)
    if response.get("status") not in TERMINAL:
        raise APIError(
            400,
            "previous_response_in_progress",
            f"previous_response_id {previous_id[:80]} is still {response.get('status')}: "
            "continue from it once it has ended",
            param="previous_response_id",
        )
    return kept.items + list(response.get("output") or ())


def _previous_missing(previous_id: str) -> APIError:
    return APIError(
        404,
        "previous_response_not_found",
        f"previous_response_id {previous_id[:80]} names no stored response of this key (it "
        "may have expired, or been deleted)",
        param="previous_response_id",
    )


async def keep_input(request: Request, key: ApiKey, body: ResponsesRequest, stream: Stream) -> None:
    """Store the response's input (its id is its stream's); kept for as long as its stream
    can be. A shared store that does not answer leaves it unstored, logged, and the response
    runs: its input_items and previous_response_id then answer 404."""
    settings = gateway(request).settings
    own = body.input if isinstance(body.input, str) else body.input[body._own :]
    items = body._earlier + stored_items(own, stream.id)
    try:
        await response_records(request).keep(
            PREFIX + stream.id,
            Kept(key.name, items),
            settings.responses_ttl_s + settings.resume_ttl_s,
        )
    except APIError as exc:
        log_event("responses.unstored", 30, stream_id=stream.id, error=exc.message)


async def keep_input_later(
    request: Request, key: ApiKey, body: ResponsesRequest, stream: Stream
) -> None:
    """`keep_input` off the request's path, in the registry's task group: what fails is
    logged, never raised into the group."""
    try:
        await keep_input(request, key, body, stream)
    except Exception as exc:
        log_event("responses.unstored", 30, stream_id=stream.id, error=repr(exc))


async def keep_answer(request: Request, key: ApiKey, body: ResponsesRequest, answer: Any) -> None:
    """A whole answer's Response, kept with its input for `--resume-ttl-s`: read back by id,
    continued by previous_response_id."""
    response_id = answer["id"]
    kept = response_records(request)
    stored = await kept.find(response_id)
    if stored is None:
        return
    stored.response = answer
    try:
        await kept.keep(response_id, stored, gateway(request).settings.resume_ttl_s)
    except APIError as exc:
        log_event("responses.unstored", 30, stream_id=response_id, error=exc.message)


async def input_items(request: Request) -> Response:
    """`GET /v1/responses/{response_id}/input_items`: OpenAI's list (`data`, `first_id`,
    `last_id`, `has_more`), `limit` (1-100, 20), `order` (`desc` by default, as OpenAI's) and
    `after` (an item id) as the SDK sends them."""
    try:
        key = gateway(request).admission.authenticate(request)
        response_id = request.path_params["response_id"]
        kept = await response_records(request).find(response_id)
        if kept is None or kept.tenant != key.name:
            raise APIError(
                404,
                "not_found",
                "no stored response with this id (it may have expired, been deleted, or "
                "been sent with store false)",
                param="response_id",
            )
        page = _page(kept.items, request.query_params)
    except APIError as exc:
        return exc.response(trace_id(request))
    return JSONResponse(page)


def _page(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    raw_limit = query.get("limit", "20")
    if not (raw_limit.isascii() and raw_limit.isdigit() and 1 <= int(raw_limit) <= MAX_LIST):
        raise APIError(
            400, "invalid_limit", "limit must be an integer from 1 to 100", param="limit"
        )
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "invalid_order", 'order must be "asc" or "desc"', param="order")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise APIError(
                400,
                "invalid_after",
                "after must be the id of one of this response's input items",
                param="after",
            )
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[: int(raw_limit)]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > len(data),
    }
