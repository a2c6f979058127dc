"""The relay's error normalisation: every upstream's error shape becomes one EngineError."""

from __future__ import annotations

import pytest

from firsttoken.engines.relay import normalise_error


@pytest.mark.parametrize(
    ("raw", "status", "code", "message", "retryable"),
    [
        (  # OpenAI
            b'{"error":{"message":"Rate limit","type":"requests","code":"rate_limit_exceeded"}}',
            429,
            "rate_limit_exceeded",
            "Rate limit",
            True,
        ),
        (  # vLLM: numeric code, a 400 for the request's own fault
            b'{"object":"error","message":"max_tokens too large","type":"BadRequestError",'
            b'"code":400}',
            400,
            "upstream_rejected",
            "the upstream answered 400: max_tokens too large",
            False,
        ),
        (  # TGI
            b'{"error":"Input validation error","error_type":"validation"}',
            422,
            "upstream_rejected",
            "the upstream answered 422: Input validation error",
            False,
        ),
        (b"<html><body><h1>502 Bad Gateway</h1></body></html>", 502, "upstream_502", None, True),
        (  # an error event in the stream (no HTTP status): the type is the code
            b'{"error":{"message":"engine died","type":"internal_error"}}',
            None,
            "internal_error",
            "engine died",
            True,
        ),
    ],
)
def test_error_shapes(
    raw: bytes, status: int | None, code: str, message: str | None, retryable: bool
) -> None:
    error = normalise_error(raw, status)
    assert error.code == code and error.retryable is retryable
    if message is not None:
        assert error.message == message
    else:
        assert "502 Bad Gateway" in error.message and "<" not in error.message
