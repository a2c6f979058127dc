"""Startup as a newcomer meets it: each failure is one JSON log line and exit status 1, the
server warns when it is open to the network, and every refused request leaves a log line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from firsttoken.preflight import StartupError, describe, redact
from tests.servers import ROOT, run_server, wait_for


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FIRSTTOKEN_")}
    return subprocess.run(
        [sys.executable, "-m", "firsttoken", "serve", "--port", "0", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_failure_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The run failed with exactly one `startup.failed` line and no traceback; its error."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    record = json.loads(lines[0])
    assert record["event"] == "startup.failed" and record["level"] == "error"
    return str(record["error"])


@contextmanager
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock
    finally:
        sock.close()


def closed_port() -> int:
    with listener() as sock:
        return int(sock.getsockname()[1])


@contextmanager
def not_redis() -> Iterator[int]:
    """A TCP server that answers like a web server: a Redis URL pointing at the wrong thing."""
    with listener() as sock:

        def answer() -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        yield int(sock.getsockname()[1])


def test_port_in_use() -> None:
    with listener() as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "firsttoken", "serve", "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    error = one_failure_line(proc)
    assert error.startswith(f"cannot listen on 127.0.0.1:{port}: the address is already in use")


def test_keys_file_that_is_not_toml(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text("[[keys]]\nname = \n")
    error = one_failure_line(serve("--api-keys", str(keys)))
    assert error.startswith(f"--api-keys {keys}: not valid TOML")


def test_keys_file_without_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text("# nothing yet\n")
    error = one_failure_line(serve("--api-keys", str(keys)))
    assert error == f"--api-keys {keys}: no [[keys]] entries"


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ('[[keys]]\nname = "a"\nkey = "k"\nmax_stream = 3\n', "keys[0].max_stream: unknown field"),
        ('[keys]\nname = "a"\nkey = "sk-a"\n', "keys is a table; write each key as [[keys]]"),
        ('[keys.alice]\nkey = "sk-a"\n', "keys is a table; write each key as [[keys]]"),
        ('keys = ["sk-a"]\n', "keys[0] is not a table; write each key as [[keys]]"),
    ],
)
def test_keys_file_with_a_typo_or_the_wrong_shape(tmp_path: Path, body: str, said: str) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(body)
    error = one_failure_line(serve("--api-keys", str(keys)))
    assert error.startswith(f"--api-keys {keys}: {said}")


def test_canned_answers_file_with_a_typo(tmp_path: Path) -> None:
    canned = tmp_path / "canned.toml"
    canned.write_text('[answer]\n"hi" = "Hello"\n')
    error = one_failure_line(serve("--canned-answers", str(canned)))
    assert error == f"--canned-answers {canned}: unknown table or field 'answer' (known: [answers])"


def test_redis_unreachable() -> None:
    port = closed_port()
    error = one_failure_line(serve("--redis", f"redis://127.0.0.1:{port}"))
    assert error == f"--redis redis://127.0.0.1:{port}: Redis did not answer PING: " + (
        "Connection refused"
    )


def test_redis_url_pointing_at_something_else() -> None:
    with not_redis() as port:
        error = one_failure_line(serve("--redis", f"redis://:secret@127.0.0.1:{port}/0"))
    assert error.startswith(f"--redis redis://:***@127.0.0.1:{port}/0: Redis did not answer")
    assert "is it a Redis server?" in error and "secret" not in error


def test_upstream_unreachable() -> None:
    port = closed_port()
    error = one_failure_line(serve("--engine", "openai", "--upstream", f"http://127.0.0.1:{port}"))
    assert error == (
        f"--upstream: no upstream answered GET /models (http://127.0.0.1:{port}/v1: "
        "Connection refused)"
    )


def test_model_file_that_is_not_a_model(tmp_path: Path) -> None:
    model = tmp_path / "empty.gguf"
    model.write_bytes(b"")
    error = one_failure_line(serve("--engine", "llamacpp", "--model", str(model)))
    assert str(model) in error


def test_debug_shows_the_traceback() -> None:
    port = closed_port()
    proc = serve("--redis", f"redis://127.0.0.1:{port}", "--log-level", "debug")
    assert proc.returncode == 1
    assert '"startup.failed"' in proc.stdout
    assert "Traceback" in proc.stderr


def test_warns_when_open_beyond_loopback(tmp_path: Path) -> None:
    def warnings(*args: str) -> list[dict]:
        with run_server(*args) as server:
            return [r for r in server.log_records() if r["event"] == "open_to_the_network"]

    assert warnings() == []  # loopback: no warning
    [warning] = warnings("--host", "0.0.0.0")
    assert warning["level"] == "warning" and "--api-keys" in warning["note"]
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "a"\nkey = "sk-a"\n')
    assert warnings("--host", "0.0.0.0", "--api-keys", str(keys)) == []


def test_warns_once_when_a_proxy_forwards_from_afar_without_keys(tmp_path: Path) -> None:
    # Behind Caddy the gateway listens on loopback: only what the proxy forwards tells that
    # its clients come from elsewhere (Caddy and nginx both send X-Forwarded-For).
    chat = {"model": "synthetic", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}

    def warnings(*args: str, headers: dict[str, str]) -> list[dict]:
        with run_server(*args, "--synthetic-ttft-ms", "1") as server:
            for _ in range(2):
                sent = httpx.post(
                    server.v1 + "/chat/completions",
                    json=chat,
                    headers={"authorization": "Bearer sk-a", **headers},
                    timeout=10,
                )
                assert sent.status_code == 200, sent.text
            return [r for r in server.log_records() if r["event"] == "open_to_the_network"]

    afar = {"x-forwarded-for": "203.0.113.7, 127.0.0.1"}
    [warning] = warnings(headers=afar)  # once, not per request
    assert warning["level"] == "warning" and warning["address"] == "203.0.113.7"
    assert "--api-keys" in warning["note"] and "proxy" in warning["note"]
    assert warnings(headers={"x-forwarded-for": "127.0.0.1"}) == []
    assert warnings(headers={}) == []
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "a"\nkey = "sk-a"\n')
    assert warnings("--api-keys", str(keys), headers=afar) == []


def test_warns_about_a_variable_no_setting_reads() -> None:
    with run_server(env={"FIRSTTOKEN_HEARTBEAT": "5"}) as server:
        [warning] = [r for r in server.log_records() if r["event"] == "config.unknown_variable"]
    assert warning["variable"] == "FIRSTTOKEN_HEARTBEAT"
    assert "did you mean FIRSTTOKEN_HEARTBEAT_S?" in warning["note"]


# ---- refused requests: a message a person can act on, and a log line ------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text('[[keys]]\nname = "alice"\nkey = "sk-alice"\n')
    with run_server("--api-keys", str(keys), "--synthetic-ttft-ms", "1") as server:
        yield server


def refusals(server, code: str) -> list[dict]:  # type: ignore[no-untyped-def]
    return [
        r for r in server.log_records() if r["event"] == "request.refused" and r["code"] == code
    ]


def test_refusals_say_what_is_allowed_and_are_logged(keyed) -> None:  # type: ignore[no-untyped-def]
    auth = {"authorization": "Bearer sk-alice"}
    chat = keyed.v1 + "/chat/completions"
    hi = [{"role": "user", "content": "hi"}]

    r = httpx.post(chat, json={"messages": hi})
    assert r.status_code == 401
    r = httpx.post(chat, json={"model": "gpt-4", "messages": hi}, headers=auth)
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "'gpt-4' does not exist" in message and "serves: synthetic" in message
    r = httpx.post(chat, json={"messages": hi, "stop": list("abcde")}, headers=auth)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "stop: at most 4 stop strings are allowed, got 5"
    assert r.json()["error"]["param"] == "stop"
    r = httpx.post(chat, json={"messages": hi, "stop": ["a", "b"]}, headers=auth)
    assert r.status_code == 200

    wait_for(lambda: refusals(keyed, "invalid_value"))
    assert len(refusals(keyed, "invalid_api_key")) == 1
    [missing] = refusals(keyed, "model_not_found")
    assert missing["status"] == 404 and missing["trace_id"]
    assert "sk-alice" not in "\n".join(keyed.log)


def test_one_line_words() -> None:
    assert redact("redis://user:pw@h:6379/0") == "redis://user:***@h:6379/0"
    assert redact("redis://h:6379") == "redis://h:6379"
    group = ExceptionGroup("unhandled errors in a TaskGroup", [ConnectionError(111, "refused")])
    assert describe(group) == "refused"
    assert describe(StartupError("--redis x: down")) == "--redis x: down"
    assert describe(ValueError("bad\nsecond line")) == "ValueError: bad"
