"""Property-based fuzzing of every request body the API takes, and of raw HTTP request bytes
over a socket: a client's mistake is never a 5xx, and the server never dies.

Bounded example counts (a few hundred requests in all) so the module runs in seconds.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.servers import Server, run_server

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure here is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

ENDPOINTS = {
    "/v1/chat/completions": {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
    },
    "/v1/completions": {"model": "synthetic", "prompt": "hi", "max_tokens": 3, "stream": False},
    "/v1/streams": {"prompt": "hi", "max_tokens": 3},
}
# Field names the models know, nested ones included, so mutations reach the validators.
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream",
    "stream_options", "seed", "temperature", "top_p", "stop", "n", "synthetic", "coalesce",
    "meta", "binary", "role", "content", "include_usage", "ttft_ms", "itl_ms", "fail_after",
    "error_code", "answer_tokens", "mode", "max_wait_ms", "max_bytes", "type", "text",
]  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(["user", "system", "text", "boundary", "off", "synthetic", "", "\x00"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server(
        "--synthetic-ttft-ms",
        "0",
        "--synthetic-itl-ms",
        "0",
        "--resume-grace-s",
        "0",
        "--rate-limit-per-s",
        "0",
        "--breaker-error-rate",
        "1",
        "--header-timeout-s",
        "2",
    ) as s:
        yield s


def _post(client: httpx.Client, path: str, content: bytes, ctype: str = "application/json") -> int:
    with client.stream(
        "POST", path, content=content, headers={"content-type": ctype}, timeout=10
    ) as resp:
        status = resp.status_code
        if status != 200:
            resp.read()
            if status >= 400:
                assert resp.json()["error"]["code"], resp.text  # the OpenAI error shape
        # A stream that was accepted is left at once: the fuzz is about the request.
    return status


def _alive(server: Server) -> None:
    assert server.proc.poll() is None, "the server died"
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return repr(value).encode()  # integers past 64 bits, NaN: send them as raw text


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_any_json_body(server: Server, path: str) -> None:
    with httpx.Client(base_url=server.url) as client:

        @FUZZ
        @given(body=json_values)
        def check(body: Any) -> None:
            status = _post(client, path, _dumps(body))
            assert status < 500, (path, body, status)

        check()
    _alive(server)


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_valid_bodies_with_one_field_broken(server: Server, path: str) -> None:
    base = ENDPOINTS[path]
    with httpx.Client(base_url=server.url) as client:

        @FUZZ
        @given(
            field=st.sampled_from(FIELDS),
            value=json_values,
            nested=st.sampled_from([None, "synthetic", "stream_options", "coalesce"]),
        )
        def check(field: str, value: Any, nested: str | None) -> None:
            body = dict(base)
            if nested is None:
                body[field] = value
            else:
                body[nested] = {field: value}
            status = _post(client, path, _dumps(body))
            assert status < 500, (path, body, status)

        check()
    _alive(server)


@FUZZ
@given(raw=st.binary(max_size=300), ctype=st.sampled_from(["application/json", "text/plain", ""]))
def test_any_bytes_as_a_body(server: Server, raw: bytes, ctype: str) -> None:
    with httpx.Client(base_url=server.url) as client:
        for path in ENDPOINTS:
            status = _post(client, path, raw, ctype)
            assert status < 500, (path, raw, status)


# -- raw HTTP over a socket ------------------------------------------------------------------

methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "BREW"])
paths = st.sampled_from(
    [
        "/",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/streams",
        "/v1/streams/abc/events?token=x",
        "/v1/streams/abc/cancel",
        "/v1/models",
        "/metrics",
        "/readyz",
        "/v1/streams/%00/events?token=%ff&last_event_id=-1",
        "/../../etc/passwd",
        "/v1/" + "a" * 300,
    ]
) | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=50).map(
    lambda t: "/" + t
)
header_names = st.sampled_from(
    [
        "Content-Length",
        "Transfer-Encoding",
        "Content-Type",
        "Last-Event-ID",
        "Authorization",
        "Accept-Encoding",
        "X-Request-Id",
        "traceparent",
        "Expect",
        "Connection",
    ]
) | st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", min_size=1,
          max_size=12)  # fmt: skip
ascii_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
header_values = (
    st.sampled_from(
        ["0", "-1", "99999999999999999999", "chunked", "gzip, zstd", "100-continue", "close"]
    )
    | ascii_text
    | ascii_text
    | st.text(max_size=10)
)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(methods)
    path = draw(paths)
    # Mostly well-formed, so most requests reach the application, not only the parser.
    version = draw(st.sampled_from(["HTTP/1.1"] * 5 + ["HTTP/1.0", "HTTP/2.0", "", "HTTP/9"]))
    headers = draw(st.lists(st.tuples(header_names, header_values), max_size=4))
    body = draw(st.binary(max_size=80) | st.just(b'{"prompt": "x", "max_tokens": 2}'))
    line_end = draw(st.sampled_from(["\r\n"] * 4 + ["\n"]))
    lines = [f"{method} {path} {version}".rstrip(), "Host: 127.0.0.1"]
    if draw(st.booleans()):  # a body the parser can frame, half the time
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in headers]
    head = line_end.join(lines) + line_end + line_end
    return head.encode("utf-8", "surrogateescape") + body


def _exchange(port: int, data: bytes) -> bytes:
    """Send the bytes, half-close, and read what comes back (bounded in time and size)."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return b""  # the server already closed: fine
        out = b""
        try:
            while len(out) < 65536:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n" in out:
                    break  # the status line is all this needs
        except (TimeoutError, OSError):
            pass
        return out


def _status(response: bytes) -> int | None:
    if not response.startswith(b"HTTP/"):
        return None
    parts = response.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


@FUZZ
@given(data=requests())
def test_raw_http_requests(server: Server, data: bytes) -> None:
    status = _status(_exchange(server.port, data))
    assert status is None or status < 500, (data, status)


@FUZZ
@given(data=st.binary(min_size=1, max_size=400))
def test_raw_bytes(server: Server, data: bytes) -> None:
    status = _status(_exchange(server.port, data))
    assert status is None or status < 500, (data, status)


def test_server_survived_the_fuzz(server: Server) -> None:
    _alive(server)
    crashed = [r for r in server.log_records() if r.get("level") == "error"]
    assert crashed == [], crashed[:3]
