"""The keys file's allowlists, digests, lifetime and request rate against a real server,
through the official SDKs where there is one."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from firsttoken.admission.keys import digest_hex
from tests.redis_server import run_redis
from tests.servers import ROOT, Server, run_server, wait_for

ROUTES = """
[targets.small]
kind = "synthetic"
ttft_ms = 1
itl_ms = 1

[models.chat]
targets = ["small"]

[models.edge]
targets = ["small"]
"""
SECRET = "sk-edge-only-0123456789"


def keys_file(tmp: Path, extra: str = "") -> str:
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=1)
    path = tmp / "keys.toml"
    path.write_text(
        f'[[keys]]\nname = "edge-only"\nkey_sha256 = "{digest_hex(SECRET)}"\n'
        'routes = ["edge"]\nrequests_per_minute = 1000\n\n'
        '[[keys]]\nname = "all"\nkey = "sk-all"\n\n'
        '[[keys]]\nname = "off"\nkey = "sk-off"\ndisabled = true\n\n'
        f'[[keys]]\nname = "old"\nkey = "sk-old"\nexpires_at = {past.isoformat()}\n' + extra
    )
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("keys")
    (tmp / "routes.toml").write_text(ROUTES)
    with run_server("--api-keys", keys_file(tmp), "--routes", str(tmp / "routes.toml")) as srv:
        yield srv


def test_a_key_limited_to_edge_gets_404_for_chat_on_every_surface(server: Server) -> None:
    before = server.metric("firsttoken_tokens_generated_total")
    oa = openai.OpenAI(base_url=server.v1, api_key=SECRET, max_retries=0)
    an = anthropic.Anthropic(base_url=server.url, api_key=SECRET, max_retries=0)
    user = [{"role": "user", "content": "hi"}]
    calls = {
        "chat": lambda: oa.chat.completions.create(model="chat", messages=user, stream=True),
        "completions": lambda: oa.completions.create(model="chat", prompt="hi"),
        "responses": lambda: oa.responses.create(model="chat", input="hi", stream=True),
        "retrieve": lambda: oa.models.retrieve("chat"),
        "messages": lambda: an.messages.create(model="chat", max_tokens=5, messages=user),
        "count_tokens": lambda: an.messages.count_tokens(model="chat", messages=user),
    }
    for name, call in calls.items():
        with pytest.raises((openai.NotFoundError, anthropic.NotFoundError)) as refused:
            call()
        body = refused.value.body
        assert isinstance(body, dict), name
        error = body.get("error", body)
        assert "does not exist or you do not have access" in error["message"], name
        assert "chat" not in error["message"].split("serves:")[1], name  # not even its name
    native = httpx.post(
        server.v1 + "/streams",
        headers={"authorization": f"Bearer {SECRET}"},
        json={"prompt": "hi", "model": "chat", "max_tokens": 3},
    )
    assert native.status_code == 404 and native.json()["error"]["code"] == "model_not_found"
    assert [m.id for m in oa.models.list()] == ["edge"]
    assert server.metric("firsttoken_tokens_generated_total") == before  # no engine work
    # The route it may use works, on each API; a key without `routes` sees them all.
    answer = oa.chat.completions.create(model="edge", messages=user, max_tokens=3)
    assert answer.choices[0].message.content
    assert an.messages.create(model="edge", max_tokens=3, messages=user).content
    native = httpx.post(
        server.v1 + "/streams",
        headers={"authorization": f"Bearer {SECRET}"},
        json={"prompt": "hi", "max_tokens": 3},  # no model: the first route it may use
    )
    assert native.status_code == 201
    every = openai.OpenAI(base_url=server.v1, api_key="sk-all", max_retries=0)
    assert [m.id for m in every.models.list()] == ["chat", "edge"]


@pytest.mark.parametrize(
    ("secret", "code"), [("sk-off", "key_disabled"), ("sk-old", "key_expired")]
)
def test_a_disabled_or_expired_key_gets_401_with_its_code(
    server: Server, secret: str, code: str
) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key=secret, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.chat.completions.create(
            model="edge", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert refused.value.code == code


@pytest.mark.parametrize("redis", [False, True])
def test_requests_per_minute_refuse_with_429_and_retry_after(tmp_path: Path, redis: bool) -> None:
    (tmp_path / "routes.toml").write_text(ROUTES)
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "slow"\nkey = "sk-slow"\nrequests_per_minute = 3\n')
    args = ["--api-keys", str(keys), "--routes", str(tmp_path / "routes.toml")]
    with run_redis() if redis else _nothing() as url:
        if url:
            args += ["--redis", url]
        with run_server(*args) as srv:
            body = {"prompt": "hi", "model": "edge", "max_tokens": 1}
            minute = time.time() // 60
            answers = [
                httpx.post(srv.v1 + "/completions", headers={"x-api-key": "sk-slow"}, json=body)
                for _ in range(5)
            ]
            if time.time() // 60 != minute:
                pytest.skip("a clock minute began during the burst: its count started over")
    assert [a.status_code for a in answers] == [200, 200, 200, 429, 429]
    refused = answers[3]
    assert refused.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(refused.headers["retry-after"]) <= 60


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_keys_new_prints_a_secret_once_and_lines_that_hold_only_its_digest(
    tmp_path: Path,
) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "firsttoken", "keys", "new", "carol"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    secret, blank, *toml = made.stdout.splitlines()
    assert secret.startswith("sk-") and len(secret) >= 46 and blank == ""
    assert secret not in "\n".join(toml) and "shown only now" in made.stderr
    hashed = subprocess.run(
        [sys.executable, "-m", "firsttoken", "keys", "hash"],
        input=secret + "\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert toml == ["[[keys]]", 'name = "carol"', f'key_sha256 = "{hashed.stdout.strip()}"']
    (tmp_path / "keys.toml").write_text("\n".join(toml) + "\n")
    with run_server("--api-keys", str(tmp_path / "keys.toml")) as srv:
        ok = httpx.get(srv.v1 + "/models", headers={"authorization": f"Bearer {secret}"})
        assert ok.status_code == 200
        wrong = httpx.get(srv.v1 + "/models", headers={"authorization": "Bearer sk-nope"})
        assert wrong.status_code == 401


def test_keys_rotate_gives_the_new_secret_the_keys_limits_and_counts(tmp_path: Path) -> None:
    # The README's recipe: the new secret must not escape what the old one used up.
    (tmp_path / "routes.toml").write_text(ROUTES)
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[keys]]\nname = "alice"\nkey = "sk-alice-old"\nrequests_per_minute = 3\n'
        'routes = ["edge"]\n'
    )
    args = ["--api-keys", str(keys), "--routes", str(tmp_path / "routes.toml")]
    with run_server(*args) as srv:
        minute = time.time() // 60

        def ask(secret: str, model: str = "edge") -> httpx.Response:
            body = {"prompt": "hi", "model": model, "max_tokens": 1}
            return httpx.post(srv.v1 + "/completions", headers={"x-api-key": secret}, json=body)

        assert [ask("sk-alice-old").status_code for _ in range(3)] == [200, 200, 200]
        made = subprocess.run(
            [sys.executable, "-m", "firsttoken", "keys", "rotate", "alice"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "FIRSTTOKEN_API_KEYS": str(keys)},
        )
        assert made.returncode == 0, made.stderr
        secret = made.stdout.strip()
        assert secret.startswith("sk-") and secret not in keys.read_text()
        srv.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any(r.get("event") == "config.reloaded" for r in srv.log_records()))
        chat, refused = ask(secret, "chat"), ask(secret)
        if time.time() // 60 != minute:
            pytest.skip("a clock minute began during the test: its count started over")
    assert chat.status_code == 404  # the old entry's routes hold for the new secret
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"


def test_keys_help_asks_for_nothing_and_mints_nothing() -> None:
    for argv in (["keys", "--help"], ["keys", "new", "--help"], ["keys", "rotate", "--help"]):
        shown = subprocess.run(
            [sys.executable, "-m", "firsttoken", *argv], capture_output=True, text=True, cwd=ROOT
        )
        assert shown.returncode == 0 and shown.stdout.startswith("usage: firsttoken keys")
        assert "sk-" not in shown.stdout and "key_sha256 =" not in shown.stdout
