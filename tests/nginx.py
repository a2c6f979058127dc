"""A real nginx for tests: deploy/nginx.conf with the ports substituted, run in a tmp prefix.

Runs in the foreground (`daemon off`) as a child of the test, with pid, logs and temp paths in
the tmp dir, so nothing on the machine is touched and nothing outlives the test.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPLOY_CONF = ROOT / "deploy" / "nginx.conf"
MULTI_CONF = ROOT / "deploy" / "nginx-multi.conf"


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def render_config(
    base: str,
    upstream_ports: list[int],
    listen_port: int,
    prefix: Path,
    replace: Mapping[str, str] | None = None,
) -> str:
    """The deploy config made runnable in `prefix`; `replace` swaps exact snippets. The
    upstream `server` lines take `upstream_ports` in order; lines beyond them are dropped (the
    three-instance config run with two), so nginx never balances onto a port nobody holds."""
    text = base
    for old, new in (replace or {}).items():
        if old not in text:
            raise ValueError(f"snippet not in the config: {old!r}")
        text = text.replace(old, new)
    ports = iter(upstream_ports)

    def upstream(m: re.Match[str]) -> str:
        port = next(ports, None)
        return "" if port is None else f"{m.group(1)}server 127.0.0.1:{port}{m.group(2)}"

    text = re.sub(r"(?m)^(\s*)server 127\.0\.0\.1:\d+([^;]*;\n)", upstream, text)
    text = re.sub(r"listen 80;", f"listen 127.0.0.1:{listen_port};", text)
    text = re.sub(r"(?m)^\s*(worker_processes|user|pid|error_log|daemon)\b[^;]*;", "", text)
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers must reach the tmp prefix
    top = (
        f"daemon off;\nworker_processes 1;\n{user}pid {prefix}/nginx.pid;\n"
        f"error_log {prefix}/error.log info;\n"
    )
    temp = "".join(
        f"    {name}_temp_path {prefix}/{name}_temp;\n"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # Each request with every instance it went to and what each answered ("503, 200": sent to
    # a second one after a refusal), for tests that check where nginx sent a request again.
    log = (
        "    log_format upstreams '$request_method $uri $status "
        "upstreams=$upstream_addr statuses=$upstream_status';\n"
        f"    access_log {prefix}/access.log upstreams;\n"
    )
    text = text.replace("http {", f"http {{\n{log}{temp}", 1)
    return top + text


class Nginx:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, prefix: Path) -> None:
        self.proc = proc
        self.url = url
        self.prefix = prefix

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def access_log(self) -> list[str]:
        """One line a request: `METHOD URI STATUS upstreams=... statuses=...`."""
        path = self.prefix / "access.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []


def check_config(conf_text: str, prefix: Path) -> subprocess.CompletedProcess[str]:
    binary = nginx_binary()
    assert binary is not None
    prefix.mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx-test.conf"
    conf.write_text(conf_text)
    return subprocess.run(
        [binary, "-t", "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")],
        capture_output=True,
        text=True,
        timeout=30,
    )


@contextmanager
def run_nginx(
    upstream_ports: list[int],
    prefix: Path,
    replace: Mapping[str, str] | None = None,
    base: Path = DEPLOY_CONF,
) -> Iterator[Nginx]:
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx not installed (apt-get install -y nginx)")
    prefix.mkdir(parents=True, exist_ok=True)
    last_error = ""
    for _attempt in range(3):  # the free port can be taken between probe and bind
        port = free_port()
        conf = prefix / "nginx.conf"
        conf.write_text(render_config(base.read_text(), upstream_ports, port, prefix, replace))
        proc = subprocess.Popen(
            [binary, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        if _wait_listening(proc, port):
            break
        last_error = _stop(proc)
    else:
        raise RuntimeError(f"nginx did not start: {last_error}")
    try:
        yield Nginx(proc, f"http://127.0.0.1:{port}", prefix)
    finally:
        _stop(proc)


def _wait_listening(proc: subprocess.Popen[bytes], port: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # fast shutdown: drops open streams
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    return err
