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


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_targets_own_set_up_fault_is_not_the_clients(status: int) -> None:
    error = normalise_error(b'{"error":{"message":"Incorrect API key","type":"x"}}', status)
    assert error.code == "upstream_rejected" and error.status == status
    assert error.retryable and not error.client_fault and error.type == "server_error"
    assert error.message == f"the upstream answered {status}: Incorrect API key"


@pytest.mark.parametrize("status", [400, 401, 402, 403, 404, 409, 413, 422, 429, 500, 502, 529])
def test_the_openai_and_anthropic_kinds_agree_on_whose_fault_a_status_is(status: int) -> None:
    from firsttoken.engines.anthropic_relay import http_error

    openai = normalise_error(b'{"error":{"message":"no"}}', status)
    anthropic = http_error(b'{"type":"error","error":{"type":"x","message":"no"}}', status, {}, 0)
    assert (openai.retryable, openai.client_fault, openai.status) == (
        anthropic.retryable,
        anthropic.client_fault,
        anthropic.status,
    )
    assert openai.client_fault == (400 <= status < 500 and status not in (401, 403, 404, 429))
