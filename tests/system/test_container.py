"""The image of deploy/Containerfile, built and run with podman: it answers /readyz and a
request as a non-root user, its health check passes, and SIGTERM reaches the server, whose
drain finishes the running stream before the container exits 0.

No image registry is reachable here: the base is made from Debian's packages
(`scripts/container-base`, debootstrap; `scripts/test` starts it early in the background).
This machine's kernel has cgroups v1 and v2 mixed and its root lacks CAP_SYS_RESOURCE, so
the container runs under runc with limits no higher than the machine's own."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.nginx import free_port
from tests.servers import wait_for

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/firsttoken-debian-base:bookworm"
IMAGE = "localhost/firsttoken:test"
RUN = ["podman", "--runtime", "runc", "run", "--network", "host"]
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
# The first build on a new machine makes the base (debootstrap) and the image: minutes.
pytestmark = pytest.mark.timeout(900)


def sh(*cmd: str, timeout: float = 600, env: dict[str, str] | None = None) -> Any:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def image() -> str:
    sh(str(ROOT / "scripts" / "container-base"), timeout=900)
    build = ["--isolation", "chroot", "--network", "host", "--build-arg", f"BASE={BASE}"]
    env = {**os.environ, "FIRSTTOKEN_IMAGE": IMAGE}
    sh(str(ROOT / "scripts" / "build-image"), *build, env=env, timeout=900)
    return IMAGE


@pytest.fixture
def container(image: str) -> Iterator[tuple[str, str]]:
    name, port = f"firsttoken-test-{uuid.uuid4().hex[:8]}", free_port()
    env = ["-e", "FIRSTTOKEN_HOST=127.0.0.1", "-e", f"FIRSTTOKEN_PORT={port}"]
    sh(*RUN, "-d", "--name", name, *LIMITS, *env, image, "serve", "--synthetic-itl-ms", "20")
    try:
        yield name, f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)


def test_the_image_serves_as_a_non_root_user_and_passes_its_health_check(
    container: tuple[str, str],
) -> None:
    name, url = container
    wait_for(lambda: _ready(url), timeout=30)
    asked = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    answer = httpx.post(url + "/v1/chat/completions", json=asked, timeout=10)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert sh("podman", "exec", name, "id", "-u").stdout.strip() == "10001"
    sh("podman", "healthcheck", "run", name)
    config = json.loads(sh("podman", "image", "inspect", IMAGE).stdout)[0]["Config"]
    assert config["User"] == "firsttoken" and config["StopSignal"] == "SIGTERM"


def test_sigterm_reaches_the_server_and_its_drain_finishes_the_running_stream(
    container: tuple[str, str],
) -> None:
    name, url = container
    wait_for(lambda: _ready(url), timeout=30)
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "a deploy"}],
        "max_tokens": 100,  # 2 s at 20 ms a token
        "stream": True,
    }
    out: dict[str, bytes] = {}

    def read() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            out["body"] = b"".join(r.iter_raw())

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)
    started = time.monotonic()
    sh("podman", "stop", "-t", "75", name)
    reader.join(timeout=30)
    assert out["body"].endswith(b"data: [DONE]\n\n")  # finished, not cut
    assert time.monotonic() - started < 10
    state = json.loads(sh("podman", "inspect", name).stdout)[0]["State"]
    assert state["ExitCode"] == 0


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
