"""The native create step's adapter (`api/native/adapter.py`): the body as the engine's
request, the plan (its chunking and progress events, a handle as its answer), the handle."""

from __future__ import annotations

import orjson

from firsttoken.api.native import STREAMS
from firsttoken.api.native.protocol import NativeStreamRequest
from firsttoken.api.pipeline import Ending
from firsttoken.core.stream import Stream
from firsttoken.formats.render import NativeRenderer


def test_a_native_body_becomes_a_prompt_without_a_relay_body() -> None:
    body = NativeStreamRequest(prompt="hi", max_tokens=3, stop=["x"], seed=2)
    request = STREAMS.generation(body, "m", "id1")
    assert (request.prompt, request.max_tokens, request.stop, request.seed) == ("hi", 3, ("x",), 2)
    assert request.messages is None and request.body is None


def test_a_native_stream_is_answered_with_a_handle_and_keeps_its_options() -> None:
    body = NativeStreamRequest(prompt="hi", coalesce="off", meta=False, binary=True)
    plan = STREAMS.plan(body, "m", "id1", 2)
    assert plan.ending is Ending.HANDLE
    assert (plan.coalesce, plan.meta) == ("off", False)
    assert isinstance(plan.renderer, NativeRenderer)
    stream = Stream(
        STREAMS.generation(body, "m", "id1"),
        plan.renderer,
        format=STREAMS.name,
        trace_id="t1",
        grace_s=1,
        prompt_tokens=2,
        max_events=8,
        accepted_at=0.0,
    )
    response = STREAMS.handle(stream, "m", "t1")
    handle = orjson.loads(response.body)
    assert response.status_code == 201
    assert handle["events_url"] == f"/v1/streams/id1/events?token={stream.resume_token}"
    assert handle["cancel_url"] == "/v1/streams/id1/cancel" and handle["model"] == "m"
    assert response.headers["location"] == handle["events_url"]
    assert response.headers["x-request-id"] == "t1"
