"""What a client may read of an upstream's error: a message only from a body shaped for
clients, cleaned of control characters and escapes; else the status alone (issue 37.7)."""

from __future__ import annotations

import orjson
import pytest

from firsttoken.engines.anthropic_relay import http_error, stream_error
from firsttoken.engines.relay import normalise_error
from firsttoken.engines.upstream_errors import MAX_MESSAGE, clean, generic, shaped_message
from tests.upstreams import TRACEBACK  # what a hostile probe had an upstream answer

SECRET_5XX = b"psycopg2.OperationalError: db.internal.corp:5432 password=hunter2"


def test_clean_takes_out_escapes_and_control_characters() -> None:
    assert clean("\x1b[31mred\x1b[0m\r\nInjected: header\x00\x07 \u202eevil") == (
        "red Injected: header evil"
    )
    assert clean("\x1b]0;title\x07ok") == "ok"
    assert len(clean("x" * 10_000)) == MAX_MESSAGE


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"error": {"message": "bad\r\nvalue", "type": "invalid_request_error"}}, "bad value"),
        ({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, "busy"),
        ({"object": "error", "message": "too long", "code": 400}, "too long"),
        ({"error": "Input validation error", "error_type": "validation"}, "Input validation error"),
        ({"detail": "Not Found"}, None),  # FastAPI's: not an error written for the client
        ({"error": {"code": 500}}, None),
        ([1, 2], None),
    ],
)
def test_a_message_only_from_an_error_shaped_for_clients(body: object, message: str | None) -> None:
    assert shaped_message(orjson.dumps(body)) == message


def test_a_body_that_is_not_an_error_shape_gives_the_status_alone() -> None:
    for status, raw in ((400, TRACEBACK), (500, SECRET_5XX)):
        error = normalise_error(raw, status)
        assert error.message == generic(status)
        assert error.status == status
        assert error.upstream_said is not None and b"sk-UPSTREAM" not in error.message.encode()
    assert generic(400) == "the upstream answered 400 Bad Request"
    assert generic(599) == "the upstream answered 599"
    assert "hunter2" in (normalise_error(SECRET_5XX, 500).upstream_said or "")  # for the log


def test_an_error_shaped_message_passes_cleaned() -> None:
    raw = orjson.dumps({"error": {"message": "\x1b[1mmax_tokens\x1b[0m too large\r\nX: y"}})
    error = normalise_error(raw, 400)
    assert error.message == "the upstream answered 400: max_tokens too large X: y"


def test_the_anthropic_relay_passes_the_same_and_bounds_its_error_type() -> None:
    error = http_error(TRACEBACK, 400, {}, 0.0)
    assert error.message == generic(400) and error.status == 400
    assert http_error(SECRET_5XX, 503, {}, 0.0).message == generic(503)
    shaped = orjson.dumps({"type": "error", "error": {"type": "x", "message": "\x1b[2Jno"}})
    assert http_error(shaped, 400, {}, 0.0).message == "no"
    odd = stream_error({"error": {"type": "a b\r\n" * 40, "message": "m"}})
    assert odd.code == "api_error" and odd.message == "m"
