"""The native stream API's create step (`POST /v1/streams`), as the pipeline's adapter: the
stream starts at once, and the answer is a handle (`201 {"id", "resume_token", ...}`) that
`GET /v1/streams/{id}/events` reads (`streams.py`)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from firsttoken.api.native.protocol import NativeStreamRequest
from firsttoken.api.pipeline import Ending, Format, Inputs, Plan
from firsttoken.config import Settings
from firsttoken.core.stream import Stream
from firsttoken.formats.render import NativeRenderer

__all__ = ["STREAMS", "NativeFormat"]


class NativeFormat(Format[NativeStreamRequest]):
    name = "native"
    body = NativeStreamRequest

    def grace_s(self, settings: Settings) -> float:
        # Read by an EventSource that reconnects on its own: --resume-grace-s.
        return settings.resume_grace_s

    def inputs(self, body: NativeStreamRequest, raw: dict[str, Any] | None, model: str) -> Inputs:
        return Inputs(
            body.prompt,
            body.max_tokens,
            body.seed,
            body.temperature,
            body.stop_strings(),
            None,
            None,
            {"synthetic": body.synthetic.model_dump() if body.synthetic else None},
        )

    def plan(
        self, body: NativeStreamRequest, model: str, stream_id: str, prompt_tokens: int
    ) -> Plan:
        renderer = NativeRenderer(binary=body.binary)
        return Plan(renderer, Ending.HANDLE, coalesce=body.coalesce, meta=body.meta)

    def handle(self, stream: Stream, model: str, trace: str) -> Response:
        events_url = f"/v1/streams/{stream.id}/events?token={stream.resume_token}"
        return JSONResponse(
            {
                "id": stream.id,
                "resume_token": stream.resume_token,
                "events_url": events_url,
                "cancel_url": f"/v1/streams/{stream.id}/cancel",
                "model": model,
            },
            status_code=201,
            headers={"x-stream-id": stream.id, "x-request-id": trace, "location": events_url},
        )


STREAMS = NativeFormat()
