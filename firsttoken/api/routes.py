"""The API's routes, in one table: the app builds both its Starlette routes (under `/v1`) and
the direct dispatch of the hot ones (`app.HotRouteApp`, served past uvicorn's ASGI layers and
Starlette's router) from it. Adding a format is its folder and one line here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NamedTuple

from starlette.requests import Request

from firsttoken.api import anthropic, embeddings, native, openai, responses, usage
from firsttoken.api.pipeline import Answer, Format, serve

__all__ = ["ROUTES", "ApiRoute", "Endpoint", "endpoint"]

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
    ApiRoute("GET", "/models", openai.models),
    ApiRoute("GET", "/models/{model_id:path}", openai.model),
    ApiRoute("POST", "/streams", endpoint(native.STREAMS), hot=True),
    ApiRoute("GET", "/streams/{stream_id}/events", native.stream_events, hot=True),
    ApiRoute("POST", "/streams/{stream_id}/cancel", native.cancel_stream),
    ApiRoute("DELETE", "/streams/{stream_id}", native.cancel_stream),
    ApiRoute("GET", "/usage", usage.usage),  # the ledger: the admin key, or a key its own
)
