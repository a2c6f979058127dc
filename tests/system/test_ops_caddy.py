"""docs/ops.md's Caddy recipe for opening `/ops` in a browser, run as written: a real Caddy
in front of a real gateway. Whoever reaches the proxy is the admin, so what it listens on and
what it lets through is the test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.caddy import caddy_binary
from tests.servers import ROOT, run_server
from tests.upstreams import free_port

ADMIN = "admin-secret-caddy"


def recipe() -> str:
    """The Caddyfile block docs/ops.md gives, as a reader copies it."""
    text = (ROOT / "docs" / "ops.md").read_text()
    after = text[text.index("for example with Caddy") :]
    found = re.search(r"```\n(.*?)```", after, re.DOTALL)
    assert found is not None
    return found.group(1)


def listening(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` (IPv4 and IPv6)."""
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                addresses.append(host)
    return addresses


@contextmanager
def run_recipe(tmp: Path, gateway: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    config = tmp / "ops.Caddyfile"
    config.write_text(
        recipe().replace("127.0.0.1:9000", f"127.0.0.1:{port}").replace("127.0.0.1:8000", gateway)
    )
    env = {
        **os.environ,
        "HOME": str(tmp),
        "XDG_DATA_HOME": str(tmp / "data"),
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "FIRSTTOKEN_ADMIN_KEY": ADMIN,
    }
    with (tmp / "caddy.log").open("wb") as log:
        proc = subprocess.Popen(
            [caddy_binary(), "run", "--config", str(config), "--adapter", "caddyfile"],
            cwd=tmp,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 20
        while not listening(port):
            assert proc.poll() is None, (tmp / "caddy.log").read_text()
            assert time.monotonic() < deadline, (tmp / "caddy.log").read_text()
            time.sleep(0.05)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_ops_recipe_serves_the_page_on_loopback_only_and_only_reads(tmp_path: Path) -> None:
    assert "127.0.0.1:9000" in recipe() and "127.0.0.1:8000" in recipe()
    port = free_port()
    with run_server("--admin-key-env", "OPS_ADMIN", env={"OPS_ADMIN": ADMIN}) as server:
        gateway = server.url.removeprefix("http://")
        with run_recipe(tmp_path, gateway, port):
            assert listening(port) == ["0100007F"]  # 127.0.0.1, and nothing else
            proxy = f"http://127.0.0.1:{port}"
            page = httpx.get(proxy + "/ops")
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            assert httpx.get(proxy + "/v1/usage").status_code == 200  # the key was added
            # A write through the proxy, as a page elsewhere could make the browser send:
            write = httpx.post(proxy + "/v1/chat/completions", json={"model": "x"})
            assert write.status_code == 405
            # A name rebound to 127.0.0.1 by DNS: not this site, so never proxied.
            rebound = httpx.get(proxy + "/v1/usage", headers={"host": f"evil.example:{port}"})
            assert rebound.status_code != 200 or rebound.content == b""
    # Plain HTTP on loopback: no certificate, no CA made (let alone installed).
    assert not (tmp_path / "data" / "caddy" / "pki").exists()
