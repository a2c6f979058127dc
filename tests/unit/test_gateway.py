"""The request's steps (`firsttoken/api/gateway.py`): what a refused whole answer says about
retrying, and which model a request gets."""

from __future__ import annotations

from firsttoken.api.bodies import APIError
from firsttoken.api.gateway import retry_headers
from firsttoken.app import create_app
from firsttoken.config import Settings
from firsttoken.engines import EngineError


def test_a_503_or_429_says_when_to_retry_and_nothing_else_does() -> None:
    # The route's own wait, rounded up to whole seconds, never below 1.
    held = EngineError("upstream_unavailable", "x", status=503, retry_after_s=2.2)
    assert retry_headers(held) == {"retry-after": "3"}
    soon = EngineError("upstream_unavailable", "x", status=503, retry_after_s=0.1)
    assert retry_headers(soon) == {"retry-after": "1"}
    # Rebuilt from the stream's error event, the status is all that is left: 1 s.
    assert retry_headers(EngineError("queue_timeout", "x", status=503)) == {"retry-after": "1"}
    assert retry_headers(EngineError("upstream_429", "x", status=429)) == {"retry-after": "1"}
    assert retry_headers(EngineError("upstream_rejected", "x", status=400)) == {}
    assert retry_headers(EngineError("internal_error", "x")) == {}


def test_a_model_is_found_by_name_as_the_engines_own_string_and_follows_a_new_list() -> None:
    gw = create_app(Settings()).state.gateway
    asked = "".join(["synth", "etic"])  # equal, not the same object
    found = gw.model(asked)
    assert found == "synthetic" and found is gw.engine.models[0] and found is not asked
    assert gw.model(None) is gw.engine.models[0]
    gw.engine.models = ("a", "b")  # a reload swaps the engine's list
    assert gw.model("b") == "b"
    try:
        gw.model("synthetic")
    except APIError as exc:
        assert exc.status == 404 and exc.code == "model_not_found"
    else:
        raise AssertionError("a model no longer served was found")
