"""The handlers' shared helpers: what a refused whole answer says about retrying."""

from __future__ import annotations

from firsttoken.api.gateway import retry_headers
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
