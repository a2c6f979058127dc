"""`POST /v1/embeddings`, behind the keys, limits and budgets, and counted in the ledger like
any request: its inputs are its prompt (the target's `prompt` price), and it holds one of its
key's concurrent slots while it runs. The engine answers (`Engine.embed`): the synthetic
engine's deterministic vectors, or a route's targets in order, the next one taking over from
one that is down or fails before it answered (`RoutedEngine.embed`). `/v1/moderations`
(`moderations.py`) goes the same way (`answer_once`)."""

from __future__ import annotations

from typing import Annotated, Literal, Protocol, cast

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from firsttoken.api.gateway import gateway, new_stream_id, retry_headers, trace_id
from firsttoken.api.protocol import _Body
from firsttoken.core.stream import Outcome, Usage
from firsttoken.formats.errors import APIError
from firsttoken.generation import EmbeddingRequest, EngineError
from firsttoken.pricing import LegStart

__all__ = ["EmbeddingBody", "answer_once", "embeddings"]

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs
MAX_DIMENSIONS = 8192


class EmbeddingBody(_Body):
    model: str | None = None
    # A text, texts, token ids, or lists of token ids: OpenAI's four shapes.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=MAX_DIMENSIONS)] | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _bounded(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, list):
            if not value:
                raise ValueError("must hold at least one input")
            many = not isinstance(value[0], int)  # else one input of token ids
            if many and len(value) > MAX_INPUTS:
                raise ValueError(f"holds {len(value)} inputs; at most {MAX_INPUTS}")
            if any(isinstance(item, list) and not item for item in value):
                raise ValueError("an input of token ids must hold at least one")
        return value

    def inputs(self) -> tuple[str | tuple[int, ...], ...]:
        value = self.input
        if isinstance(value, str):
            return (value,)
        # Validated: all of one shape (never empty). The `isinstance`s tell the type checker.
        if isinstance(value[0], int):  # one input of token ids
            return (tuple(item for item in value if isinstance(item, int)),)
        return tuple(
            item if isinstance(item, str) else tuple(item)
            for item in value
            if not isinstance(item, int)
        )


class OneCallBody(Protocol):
    """A body of one of the endpoints answered in one call (`ENDPOINTS`)."""

    def inputs(self) -> tuple[str | tuple[int, ...], ...]: ...


async def embeddings(request: Request) -> Response:
    return await answer_once(request, EmbeddingBody, "embeddings")


async def answer_once(request: Request, kind: type[_Body], endpoint: str) -> Response:
    """One call to the engine (`Engine.embed`) for `endpoint`'s body of `kind`, behind the
    key, its limits and budget, and in the ledger: its inputs are its prompt; the engine's
    count of them is billed, or ours where it gives none (an upstream's moderations)."""
    gw = gateway(request)
    trace = trace_id(request)
    try:
        body, raw, model, key = await gw.accept_raw(request, kind)
        inputs = cast(OneCallBody, body).inputs()
        count = gw.engine.prompt_tokens
        tokens = sum(count(item) if isinstance(item, str) else len(item) for item in inputs)
        request_id = new_stream_id()
        ticket = await gw.admission.admit(
            key, tokens, 0, model, request_id=request_id, trace_id=trace
        )
    except APIError as exc:
        return exc.response(trace)
    asked = EmbeddingRequest(request_id, model, inputs, raw, key.name, trace, endpoint)
    outcome, used = Outcome.DISCONNECTED, None  # until the engine answered
    try:
        answer = await gw.engine.embed(asked)
    except EngineError as exc:
        outcome = Outcome.ERROR
        ticket.client_fault = exc.client_fault
        status = exc.status if exc.status is not None and exc.status >= 400 else 502
        return APIError(status, exc.code, exc.message, headers=retry_headers(exc)).response(trace)
    else:
        if answer.target is not None:
            ticket.legs = (LegStart(answer.target),)
        outcome, used = Outcome.COMPLETED, Usage(answer.prompt_tokens or tokens)
        answer.body["model"] = model  # the name the client asked by, not the target's
        return JSONResponse(answer.body, headers={"x-request-id": trace})
    finally:
        await ticket.release(outcome, used)
