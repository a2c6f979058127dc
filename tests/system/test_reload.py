"""Reload over real signals and real files: SIGHUP and --watch-config swap keys, routes and
canned answers under running streams; a removed key's streams end with key_revoked, the
others run on uncut; a bad file changes nothing; every worker reloads."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from firsttoken.formats.sse import EventDecoder
from tests.servers import ROOT, Server, run_server, wait_for

ROUTES = """
[targets.slow]
kind = "synthetic"
ttft_ms = 5
itl_ms = 20

[models.chat]
targets = ["slow"]
"""
MORE_ROUTES = (
    ROUTES
    + """
[targets.quick]
kind = "synthetic"
ttft_ms = 1
itl_ms = 1

[models.edge]
targets = ["quick"]
"""
)
KEYS = '[[keys]]\nname = "alice"\nkey = "sk-alice"\n\n[[keys]]\nname = "bob"\nkey = "sk-bob"\n'
WITHOUT_ALICE = '[[keys]]\nname = "bob"\nkey = "sk-bob"\nweight = 2\n'
CANNED = '[answers]\n"hello" = "Hi from the edge."\n'


class Reader(threading.Thread):
    """One Chat Completions stream read to its end in a thread: its text, error, and when."""

    def __init__(self, server: Server, secret: str, model: str = "chat", tokens: int = 150) -> None:
        super().__init__(daemon=True)
        self.url, self.secret, self.model, self.tokens = server.v1, secret, model, tokens
        self.text, self.error, self.done, self.ended_at = "", None, False, 0.0
        self.started = threading.Event()

    def run(self) -> None:
        body = {
            "model": self.model,
            "stream": True,
            "max_tokens": self.tokens,
            "messages": [{"role": "user", "content": "tell me"}],
        }
        headers = {"authorization": f"Bearer {self.secret}"}
        decoder = EventDecoder()
        with httpx.stream(
            "POST", self.url + "/chat/completions", json=body, headers=headers, timeout=30
        ) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_raw():
                for event in decoder.feed(chunk):
                    if event.data == "[DONE]":
                        self.done = True
                        continue
                    data = json.loads(event.data or "{}")
                    if event.event == "error" or "error" in data:
                        self.error = data["error"]["code"]
                        continue
                    for choice in data.get("choices", []):
                        self.text += choice["delta"].get("content") or ""
                        self.started.set()
        self.ended_at = time.monotonic()


def models(server: Server, secret: str = "sk-bob") -> list[str]:
    answer = httpx.get(server.v1 + "/models", headers={"authorization": f"Bearer {secret}"})
    return [m["id"] for m in answer.json().get("data", [])]


def files(tmp: Path) -> tuple[Path, Path, Path]:
    keys, routes, canned = tmp / "keys.toml", tmp / "routes.toml", tmp / "canned.toml"
    keys.write_text(KEYS)
    routes.write_text(ROUTES)
    canned.write_text(CANNED)
    return keys, routes, canned


def serve_args(keys: Path, routes: Path, canned: Path) -> tuple[str, ...]:
    return ("--api-keys", str(keys), "--routes", str(routes), "--canned-answers", str(canned))


def records(server: Server, event: str) -> list[dict]:
    return [r for r in server.log_records() if r.get("event") == event]


def test_sighup_swaps_keys_and_routes_under_running_streams(tmp_path: Path) -> None:
    keys, routes, canned = files(tmp_path)
    with run_server(*serve_args(keys, routes, canned)) as server:
        alice, bob = Reader(server, "sk-alice"), Reader(server, "sk-bob")
        for reader in (alice, bob):
            reader.start()
            assert reader.started.wait(10)
        keys.write_text(WITHOUT_ALICE)
        routes.write_text(MORE_ROUTES)
        canned.write_text('[answers]\n"howdy" = "Howdy back."\n')
        sent, sent_at = time.monotonic(), time.time()
        server.proc.send_signal(signal.SIGHUP)
        alice.join(10)
        assert alice.error == "key_revoked" and not alice.done
        # A leaked key stops spending at once: its stream ended by the server within 1 s of
        # the signal (its log line's time); the client saw it soon after (a loaded machine).
        wait_for(lambda: records(server, "config.reloaded"), timeout=5)
        (ended,) = [
            r for r in records(server, "stream.finished") if r.get("error_code") == "key_revoked"
        ]
        assert ended["ts"] - sent_at < 1.0 and ended["key"] == "alice"
        assert alice.ended_at - sent < 3.0
        assert models(server) == ["chat", "edge"]
        assert models(server, "sk-alice") == []  # 401 now: no list
        bob.join(30)
        assert bob.error is None and bob.done and len(bob.text.split()) > 100  # uncut
        canned_answer = httpx.post(
            server.v1 + "/chat/completions",
            headers={"authorization": "Bearer sk-bob"},
            json={"model": "edge", "messages": [{"role": "user", "content": "Howdy!"}]},
        )
        assert canned_answer.json()["choices"][0]["message"]["content"] == "Howdy back."
        metrics = server.metrics()
        assert metrics['firsttoken_config_reloads_total{result="ok"}'] == 1
        assert metrics["firsttoken_config_loaded_timestamp_seconds"] >= time.time() - 30
        (line,) = records(server, "config.reloaded")
        assert line["keys_removed"] == ["alice"] and line["streams_revoked"] == 1
        assert line["targets_new"] == ["quick"]


@pytest.mark.parametrize(
    ("which", "text", "says"),
    [
        ("keys", '[[keys]]\nname = "x\n', "keys.toml: not valid TOML"),
        ("keys", KEYS + "colour = 1\n", "keys.toml: keys[1].colour: unknown field"),
        ("routes", ROUTES.replace('["slow"]', '["fast"]'), "[models.chat] targets: no target"),
        ("keys", KEYS + '\n[[keys]]\nname = "eve"\nkey = "sk-bob"\n', "the same key as"),
        ("keys", KEYS + 'routes = ["ch[at"]\n', "keys[1].routes 'ch[at': a bad glob"),
    ],
)
def test_a_bad_file_changes_nothing_logs_one_line_and_counts_failed(
    tmp_path: Path, which: str, text: str, says: str
) -> None:
    keys, routes, canned = files(tmp_path)
    with run_server(*serve_args(keys, routes, canned)) as server:
        (keys if which == "keys" else routes).write_text(text)
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: records(server, "config.reload_failed"), timeout=5)
        time.sleep(0.2)
        (line,) = records(server, "config.reload_failed")
        assert says in line["error"] and str(tmp_path) in line["error"]
        assert models(server) == ["chat"]  # as it was
        assert models(server, "sk-alice") == ["chat"]
        metrics = server.metrics()
        assert metrics['firsttoken_config_reloads_total{result="failed"}'] == 1
        assert metrics['firsttoken_config_reloads_total{result="ok"}'] == 0


def test_watch_config_applies_a_change_within_a_second_or_two(tmp_path: Path) -> None:
    keys, routes, canned = files(tmp_path)
    with run_server(*serve_args(keys, routes, canned), "--watch-config") as server:
        routes.write_text(MORE_ROUTES)
        changed = time.time()
        wait_for(lambda: models(server) == ["chat", "edge"], timeout=10, interval=0.05)
        (line,) = records(server, "config.reloaded")
        assert line["trigger"] == "watch"
        assert line["ts"] - changed < 1.5  # the contents are compared once a second


def test_every_worker_reloads_on_the_supervisors_sighup(tmp_path: Path) -> None:
    keys, routes, canned = files(tmp_path)
    with run_server(*serve_args(keys, routes, canned), "--workers", "2") as server:
        wait_for(lambda: len(records(server, "listening")) >= 2, timeout=20)
        routes.write_text(MORE_ROUTES)
        sent = time.time()
        server.proc.send_signal(signal.SIGHUP)

        def everywhere() -> bool:  # new connections land on either worker
            return all(models(server) == ["chat", "edge"] for _ in range(20))

        wait_for(everywhere, timeout=10, interval=0.05)
        swapped = [r["ts"] for r in records(server, "config.reloaded")]
        assert len(swapped) == 2
        # Each worker's swap (its log line's time) within 2 s of the signal; what a client
        # sees adds its own requests' time on a loaded machine.
        assert max(swapped) - sent < 2.0
        metrics = server.metrics()
        assert metrics['firsttoken_config_reloads_total{result="ok"}'] == 2  # one per worker
        loaded = metrics["firsttoken_config_loaded_timestamp_seconds"]
        assert time.time() - 30 < loaded <= time.time()  # the stalest worker's, not a sum


def test_check_validates_offline_one_line_per_problem(tmp_path: Path) -> None:
    keys, routes, canned = files(tmp_path)

    def check(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "firsttoken", "check", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )

    good = check("--api-keys", str(keys), "--routes", str(routes), "--canned-answers", str(canned))
    free = f"warning: {routes}: no target has a price: every answer costs 0\n"
    assert good.returncode == 0 and good.stderr == free  # a warning, not a failure
    assert good.stdout.count(": ok") == 3
    keys.write_text(KEYS + "colour = 1\n")
    routes.write_text(ROUTES.replace("kind", "knid", 1))
    bad = check("--api-keys", str(keys), "--routes", str(routes))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    lines = bad.stderr.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{keys}: keys[1].colour: unknown field")
    assert lines[1].startswith(f"{routes}: [targets.slow] knid: unknown field")
    assert check().returncode == 2  # nothing to check
    keys.write_text(KEYS.replace('key = "sk-bob"', 'key = "sk-bob"\nroutes = ["chta", "c*"]'))
    routes.write_text(ROUTES)
    typo = check("--api-keys", str(keys), "--routes", str(routes))
    assert typo.returncode == 0  # a warning: the key is only refused what it misnames
    assert typo.stderr == (
        f"warning: {keys}: key 'bob': routes entry 'chta' matches no route of {routes} (chat)\n"
        + free
    )


def test_a_key_removed_while_its_bodies_arrive_gets_no_stream(tmp_path: Path) -> None:
    """Headers (the key checked) and a part of the body, then SIGHUP removes the key, then
    the rest of the body: admission checks the key again, so nothing streams for it."""
    import socket

    keys, routes, canned = files(tmp_path)
    body = json.dumps(
        {
            "model": "chat",
            "stream": True,
            "max_tokens": 150,
            "messages": [{"role": "user", "content": "tell me"}],
        }
    ).encode()
    with run_server(*serve_args(keys, routes, canned)) as server:
        host, port = server.url.removeprefix("http://").split(":")
        slow = []
        for _ in range(5):
            conn = socket.create_connection((host, int(port)), timeout=10)
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"authorization: Bearer sk-alice\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body[:10])
            )
            slow.append(conn)
        time.sleep(0.5)  # the heads are read, the key checked; the bodies wait
        keys.write_text(WITHOUT_ALICE)
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: records(server, "config.reloaded"), timeout=5)
        statuses = []
        for conn in slow:
            conn.sendall(body[10:])
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
            statuses.append(head.split(b" ", 2)[1])
            conn.close()
        assert statuses == [b"401"] * 5, statuses
        assert not records(server, "stream.finished")  # nothing streamed, nothing billed


def test_sighup_rotates_the_admin_key_from_its_file(tmp_path: Path) -> None:
    admin, keys = tmp_path / "admin.key", tmp_path / "keys.toml"
    admin.write_text("admin-old\n")
    keys.write_text('[[keys]]\nname = "bob"\nkey = "sk-bob"\n')
    with run_server("--api-keys", str(keys), "--admin-key-file", str(admin)) as server:

        def usage(secret: str) -> int:
            headers = {"authorization": f"Bearer {secret}"}
            return httpx.get(server.v1 + "/usage", headers=headers, timeout=10).status_code

        assert usage("admin-old") == 200
        admin.write_text("admin-new\n")
        server.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: records(server, "config.reloaded"), timeout=5)
        (line,) = records(server, "config.reloaded")
        assert line["admin_key"] == "changed"
        assert usage("admin-new") == 200
        assert usage("admin-old") == 401  # now an unknown key, as any other
