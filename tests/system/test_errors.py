"""Bad input gets a clear 4xx with the OpenAI error shape, before the first byte."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.servers import Server, run_server, wait_for

MSG = [{"role": "user", "content": "hi"}]


def check(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    return err


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"messages": MSG, "max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"messages": MSG, "max_completion_tokens": -1}, "invalid_value", "max_completion_tokens"),
        ({"messages": MSG, "max_tokens": "ten"}, "invalid_value", "max_tokens"),
        ({"max_tokens": 5}, "missing_field", "messages"),
        ({"messages": []}, "invalid_value", "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_value", "messages.0.role"),
        ({"messages": MSG, "temperature": 3}, "invalid_value", "temperature"),
        ({"messages": MSG, "n": 2}, "invalid_value", "n"),
        ({"messages": MSG, "synthetic": {"itl_ms": -1}}, "invalid_value", "synthetic.itl_ms"),
    ],
)
def test_invalid_fields(server: Server, body: dict, code: str, param: str) -> None:
    err = check(httpx.post(server.v1 + "/chat/completions", json=body, timeout=10), 400, code)
    assert err["param"] == param


def test_malformed_json(server: Server) -> None:
    r = httpx.post(
        server.v1 + "/chat/completions",
        content=b'{"messages": [',
        timeout=10,
        headers={"content-type": "application/json"},
    )
    check(r, 400, "invalid_json")
    r = httpx.post(
        server.v1 + "/completions",
        content=b"[1,2]",
        headers={"content-type": "application/json; charset=utf-8"},
        timeout=10,
    )
    check(r, 400, "invalid_request")


@pytest.mark.parametrize(
    "ctype",
    [
        None,  # fetch() of a Blob sends none
        "text/plain",
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
    ],
)
def test_a_body_that_is_not_declared_json_is_415(server: Server, ctype: str | None) -> None:
    # The types a page on any origin may post without a CORS preflight are refused, even
    # when the body is valid JSON: otherwise any web page could use an open local server.
    headers = {} if ctype is None else {"content-type": ctype}
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    for path in ("/chat/completions", "/completions", "/streams", "/responses"):
        r = httpx.post(server.v1 + path, content=body, headers=headers, timeout=10)
        err = check(r, 415, "unsupported_media_type")
        assert "application/json" in err["message"], path
    r = httpx.post(server.v1 + "/messages", content=body, headers=headers, timeout=10)
    assert r.status_code == 415  # in Anthropic's error shape
    assert "application/json" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "ctype", ["application/json", "Application/JSON; charset=UTF-8", "application/vnd.x+json"]
)
def test_json_content_types_are_taken(server: Server, ctype: str) -> None:
    body = b'{"prompt": "hi", "max_tokens": 2}'
    r = httpx.post(server.v1 + "/completions", content=body, headers={"content-type": ctype})
    assert r.status_code == 200, r.text


def test_unknown_model(server: Server) -> None:
    r = httpx.post(
        server.v1 + "/chat/completions", json={"model": "nope", "messages": MSG}, timeout=10
    )
    check(r, 404, "model_not_found")


def test_a_huge_value_is_not_repeated_back_or_logged_whole() -> None:
    name = "m" * 1_000_000  # under the body limit below, so it reaches the model lookup
    with run_server("--max-body-bytes", str(2 << 20)) as srv:
        for _ in range(3):
            r = httpx.post(
                srv.v1 + "/chat/completions", json={"model": name, "messages": MSG}, timeout=10
            )
            err = check(r, 404, "model_not_found")
            assert len(err["message"]) < 1000 and "…" in err["message"]
        refused = [x for x in srv.log_records() if x["event"] == "request.refused"]
        assert refused and all(len(x["message"]) < 1000 for x in refused)
        assert sum(len(line) for line in srv.log) < 20_000


def test_refusal_log_lines_are_rate_limited() -> None:
    def refused() -> list[dict]:
        return [x for x in srv.log_records() if x["event"] == "request.refused"]

    with run_server() as srv:
        with httpx.Client(timeout=10) as client:
            for _ in range(400):  # refused before admission: no limit answers them
                r = client.post(srv.v1 + "/chat/completions", json={"model": "x"})
                assert r.status_code == 400
            time.sleep(0.2)  # a token for one more line, which counts the unlogged
            client.post(srv.v1 + "/chat/completions", json={"model": "x"})

        def counted() -> int:
            return sum(1 + x.get("unlogged", 0) for x in refused())

        # Every refusal is logged or counted in a later line (the last one's, here).
        wait_for(lambda: counted() >= 401, timeout=5)
        assert counted() == 401
        # A burst of 100 lines, then 10 a second.
        assert 100 <= len(refused()) < 300


def test_body_over_limit_is_413() -> None:
    with run_server("--max-body-bytes", "2000") as srv:
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        check(
            httpx.post(srv.v1 + "/chat/completions", json=big, timeout=10), 413, "request_too_large"
        )
        # Without Content-Length (a chunked upload) the limit holds too.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            for _ in range(5):
                sock.sendall(b"3e8\r\n" + b" " * 1000 + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
            head = b""
            while b"request_too_large" not in head:
                data = sock.recv(65536)
                if not data:
                    break
                head += data
        assert head.startswith(b"HTTP/1.1 413 ")
        assert b'"code":"request_too_large"' in head


def test_unknown_route_and_method(server: Server) -> None:
    check(httpx.get(server.url + "/v1/nothing", timeout=10), 404, "not_found")
    # An OpenAI endpoint this gateway does not serve names itself, and says what is served.
    err = check(httpx.post(server.v1 + "/files", json={}, timeout=10), 404, "not_found")
    assert "POST '/v1/files'" in err["message"] and "/v1/chat/completions" in err["message"]
    assert "file store" in err["message"]  # and why it is not
    err = check(httpx.post(server.v1 + "/audio/speech", json={}, timeout=10), 404, "not_found")
    assert "audio" in err["message"] and "/v1/moderations" in err["message"]
    check(httpx.get(server.v1 + "/chat/completions", timeout=10), 405, "method_not_allowed")


def test_native_stream_auth_and_resume_point(server: Server) -> None:
    created = httpx.post(server.v1 + "/streams", json={"prompt": "p", "max_tokens": 3}, timeout=10)
    assert created.status_code == 201
    info = created.json()
    base = f"{server.v1}/streams/{info['id']}/events"
    check(httpx.get(base, timeout=10), 401, "missing_token")
    check(httpx.get(base + "?token=wrong", timeout=10), 404, "stream_not_found")
    check(
        httpx.get(f"{server.v1}/streams/{'0' * 32}/events?token=x", timeout=10),
        404,
        "stream_not_found",
    )
    other = httpx.post(server.v1 + "/streams", json={"prompt": "q"}, timeout=10).json()
    check(httpx.get(f"{base}?token={other['resume_token']}", timeout=10), 404, "stream_not_found")
    check(
        httpx.get(f"{base}?token={info['resume_token']}&last_event_id=abc", timeout=10),
        400,
        "invalid_last_event_id",
    )
    check(
        httpx.post(server.v1 + "/streams", json={"max_tokens": 3}, timeout=10), 400, "missing_field"
    )
    httpx.delete(f"{server.v1}/streams/{other['id']}?token={other['resume_token']}", timeout=10)
