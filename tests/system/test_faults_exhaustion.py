"""Resource exhaustion and request limits, for real: a server process whose open-file limit is
lowered under it, and request heads, bodies and JSON at and past their limits."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from firsttoken.requestlimits import MAX_HEADER_BYTES, MAX_HEADERS, MAX_URL_BYTES
from tests.rawhttp import RawStream
from tests.servers import Server, run_server, wait_for

FAST = ("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "20", "--rate-limit-per-s", "0")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server(*FAST) as s:
        yield s


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def native_tokens(body: bytes) -> tuple[list[str], bool]:
    tokens, done = [], False
    for event in EventDecoder().feed(body):
        if event.data == "[DONE]":
            done = True
        elif event.event is None:
            tokens.append(json.loads(event.data or "")["token"])
    return tokens, done


def try_request(server: Server) -> str:
    """What a new client gets now: 'ok', '503', 'refused' or 'timeout'."""
    try:
        r = httpx.get(server.url + "/readyz", timeout=1.5)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.TransportError:
        return "refused"
    return "ok" if r.status_code == 200 else str(r.status_code)


def test_out_of_file_descriptors() -> None:
    with run_server(*FAST) as server:
        pid = server.proc.pid
        created = httpx.post(
            server.v1 + "/streams", json={"prompt": "fd", "max_tokens": 150}, timeout=10
        ).json()
        running = RawStream(server.port, "GET", created["events_url"])
        result: list[bytes] = []
        reader = threading.Thread(target=lambda: result.append(running.read_all()))
        reader.start()

        in_use = len(os.listdir(f"/proc/{pid}/fd"))
        limit = in_use + 8
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))
        idle: list[socket.socket] = []
        try:
            for _ in range(30):  # more connections than the process may hold
                with contextlib.suppress(OSError):
                    idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=2))
            time.sleep(0.3)
            assert len(os.listdir(f"/proc/{pid}/fd")) <= limit
            outcomes = {try_request(server) for _ in range(3)}
            assert outcomes <= {"refused", "timeout", "503"}, outcomes
            # No spin: an accept loop that retries at once would burn a core here.
            cpu = cpu_seconds(pid)
            time.sleep(2.0)
            assert cpu_seconds(pid) - cpu < 0.6
            assert server.proc.poll() is None
        finally:
            for sock in idle:
                sock.close()
        # The running stream never noticed.
        reader.join(20)
        tokens, done = native_tokens(result[0])
        assert done and tokens == synthetic_tokens("fd", None, 150)[0]
        # Descriptors free again: new clients are served, and nothing crashed.
        wait_for(lambda: try_request(server) == "ok", timeout=10, interval=0.2)
        r = httpx.post(
            server.v1 + "/completions", json={"prompt": "after", "max_tokens": 5}, timeout=10
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        bad = [rec for rec in server.log_records() if rec["level"] in ("error", "critical")]
        print(bad)
        assert bad == [] and server.proc.poll() is None


# -- request limits -------------------------------------------------------------------------


def raw(server: Server, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    status = int(out.split(b" ", 2)[1])
    return status, out.partition(b"\r\n\r\n")[2]


def code_of(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


def test_headers_at_and_over_the_limit(server: Server) -> None:
    under = b"X-Pad: " + b"a" * (MAX_HEADER_BYTES - 1000) + b"\r\n"
    status, _ = raw(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + under + b"\r\n")
    assert status == 200
    over = b"X-Pad: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n"
    status, body = raw(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + over + b"\r\n")
    assert (status, code_of(body)) == (431, "headers_too_large")
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS + 1))
    status, body = raw(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert (status, code_of(body)) == (431, "headers_too_large")


def test_a_head_that_never_ends_is_cut_off_while_it_is_parsed(server: Server) -> None:
    """Headers streamed without end: the connection gets a 431 and is closed after a bounded
    amount (the parser would otherwise keep every byte), and the server stays well."""
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(ConnectionError, OSError):
            for i in range(4096):  # up to 4 MiB, far past the cut-off
                sock.sendall(b"X-%d: " % i + b"a" * 1000 + b"\r\n")
                sent += 1
        answer = b""
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert code_of(answer.partition(b"\r\n\r\n")[2]) == "headers_too_large"
    assert sent < 4096  # the server closed before the client was done
    assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200


def test_urls_at_and_over_the_limit(server: Server) -> None:
    def get(n: int) -> tuple[int, bytes]:
        return raw(server, b"GET /healthz?p=" + b"a" * n + b" HTTP/1.1\r\nHost: x\r\n\r\n")

    assert get(MAX_URL_BYTES - 100)[0] == 200
    status, body = get(MAX_URL_BYTES + 1)
    assert (status, code_of(body)) == (414, "uri_too_long")
    assert get(200_000)[0] == 400  # far past it the parser itself refuses (uvicorn: 64 KiB)


def test_bodies_at_and_over_the_limit(server: Server) -> None:
    limit = 1_048_576  # --max-body-bytes default
    prompt = "a" * (limit - 100)
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    assert len(body) <= limit
    json_type = {"content-type": "application/json"}
    r = httpx.post(server.v1 + "/completions", content=body, headers=json_type, timeout=30)
    assert r.status_code == 200
    over = json.dumps({"prompt": prompt + "a" * 200, "max_tokens": 1}).encode()
    r = httpx.post(server.v1 + "/completions", content=over, headers=json_type, timeout=30)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
    # Chunked, with no Content-Length to refuse up front: counted as it arrives.
    chunks = iter([over[:600_000], over[600_000:]])
    r = httpx.post(server.v1 + "/completions", content=chunks, headers=json_type)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
    # A Content-Length past any integer the parser takes.
    status, _ = raw(
        server,
        b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n",
    )
    assert status == 400


def test_json_nesting_and_encoding_limits(server: Server) -> None:
    def post(raw_body: bytes) -> httpx.Response:
        return httpx.post(
            server.v1 + "/streams",
            content=raw_body,
            headers={"content-type": "application/json"},
            timeout=10,
        )

    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = post(deep)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json")
    assert "depth" in r.json()["error"]["message"]
    # Deep but under the parser's limit: the validator refuses it as a plain 400.
    nested = b'{"prompt": "x", "stop": ' + b"[" * 500 + b"]" * 500 + b"}"
    assert post(nested).status_code == 400
    for bad in (b'{"prompt": "\\ud800"}', b'{"prompt": "\xff\xfe"}', b"\x00", b'{"prompt": NaN}'):
        r = post(bad)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json"), bad
