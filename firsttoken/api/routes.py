"""The API's routes, in one table: the app builds both its Starlette routes (under `/v1`) and
the direct dispatch of the hot ones (`app.HotRouteApp`, served past uvicorn's ASGI layers and
Starlette's router) from it. Adding a format is its folder and one line here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NamedTuple

from starlette.requests import Request

from firsttoken.api import (
    anthropic,
    embeddings,
    images,
    moderations,
    native,
    openai,
    responses,
    usage,
)
from firsttoken.api.pipeline import Answer, Format, serve
from firsttoken.formats.errors import echo

__all__ = ["ROUTES", "ApiRoute", "Endpoint", "endpoint", "not_served"]

Endpoint = Callable[[Request], Awaitable[Answer]]


def endpoint(format: Format[Any]) -> Endpoint:
    """The pipeline for one format, as a request handler (Starlette unwraps the partial)."""
    return partial(serve, format=format)


class ApiRoute(NamedTuple):
    method: str
    path: str  # under /v1; `{name}` is a path parameter (`{name:path}` may hold slashes)
    endpoint: Endpoint
    hot: bool = False  # a streaming route: served straight from the connection


ROUTES: tuple[ApiRoute, ...] = (
    ApiRoute("POST", "/chat/completions", endpoint(openai.CHAT), hot=True),
    ApiRoute("POST", "/completions", endpoint(openai.COMPLETIONS), hot=True),
    ApiRoute("POST", "/responses", endpoint(responses.RESPONSES), hot=True),
    ApiRoute("GET", "/responses/{response_id}", responses.retrieve_response, hot=True),
    ApiRoute("POST", "/responses/{response_id}/cancel", responses.cancel_response),
    ApiRoute("GET", "/responses/{response_id}/input_items", responses.input_items),
    ApiRoute("DELETE", "/responses/{response_id}", responses.delete_response),
    ApiRoute("POST", "/messages", endpoint(anthropic.MESSAGES), hot=True),
    ApiRoute("POST", "/messages/count_tokens", anthropic.count_tokens),
    ApiRoute("POST", "/embeddings", embeddings.embeddings),
    ApiRoute("POST", "/moderations", moderations.moderations),
    ApiRoute("POST", "/images/generations", images.generations),
    ApiRoute("GET", "/models", openai.models),
    ApiRoute("GET", "/models/{model_id:path}", openai.model),
    ApiRoute("POST", "/streams", endpoint(native.STREAMS), hot=True),
    ApiRoute("GET", "/streams/{stream_id}/events", native.stream_events, hot=True),
    ApiRoute("POST", "/streams/{stream_id}/cancel", native.cancel_stream),
    ApiRoute("DELETE", "/streams/{stream_id}", native.cancel_stream),
    ApiRoute("GET", "/usage", usage.usage),  # the ledger: the admin key, or a key its own
)

SERVED = (
    "this gateway serves /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, "
    "/v1/messages/count_tokens, /v1/embeddings, /v1/moderations, /v1/images/generations, "
    "/v1/models and /v1/streams "
    "(docs/endpoints.md)"
)
# OpenAI's endpoints this gateway does not serve, and why: the 404 says it.
_WHY_NOT = (
    ("/v1/audio/", "audio (multipart uploads in, binary speech out) is not relayed"),
    ("/v1/images/", "image edits and variations (multipart uploads) are not relayed"),
    ("/v1/files", "files need a file store, which this gateway does not keep"),
    ("/v1/uploads", "uploads need a file store, which this gateway does not keep"),
    ("/v1/batches", "batches need files and a job store, which this gateway does not keep"),
    ("/v1/fine_tuning/", "fine-tuning is the model provider's, not a gateway's"),
    ("/v1/vector_stores", "vector stores need a file store, which this gateway does not keep"),
    ("/v1/assistants", "assistants and threads are not served: use /v1/responses"),
    ("/v1/threads", "assistants and threads are not served: use /v1/responses"),
    ("/v1/realtime", "the realtime API (WebSocket, WebRTC) is not served"),
)


def not_served(method: str, path: str) -> str:
    """What a 404 under /v1 says: the path is not an endpoint here, why where we know, and
    what is served."""
    why = next((reason for prefix, reason in _WHY_NOT if path.startswith(prefix)), None)
    said = f"{method} {echo(path)} is not an endpoint of this gateway"
    return f"{said} ({why}): {SERVED}" if why else f"{said}: {SERVED}"
