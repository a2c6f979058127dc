"""`GET /v1/models` and `GET /v1/models/{id}`: what the engine serves, in OpenAI's shape."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from firsttoken.api.bodies import APIError
from firsttoken.api.gateway import gateway, trace_id

__all__ = ["model", "models"]


async def models(request: Request) -> Response:
    gw = gateway(request)
    try:
        key = gw.admission.authenticate(request)
    except APIError as exc:
        return exc.response(trace_id(request))
    data = [_model_object(m) for m in gw.models_for(key)]
    return JSONResponse({"object": "list", "data": data})


async def model(request: Request) -> Response:
    """`GET /v1/models/{id}` (the openai SDK's `models.retrieve`): the model, or 404
    `model_not_found` naming the ones served. Ids may hold slashes (`org/name`)."""
    gw = gateway(request)
    try:
        key = gw.admission.authenticate(request)
        served = gw.model(request.path_params["model_id"], key)
    except APIError as exc:
        return exc.response(trace_id(request))
    return JSONResponse(_model_object(served))


def _model_object(model_id: str) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "firsttoken"}
