"""Real server processes for tests: `firsttoken serve` on an ephemeral loopback port."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


class Server:
    """A running `firsttoken serve` process; `url` is http://127.0.0.1:PORT."""

    def __init__(self, proc: subprocess.Popen[str], url: str, log: list[str]) -> None:
        self.proc = proc
        self.url = url
        self.port = int(url.rsplit(":", 1)[1])
        self.log = log

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        """Parse /metrics into {'name{labels}': value}."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return parse_metrics(text)

    def metric(self, name: str, default: float = 0.0) -> float:
        return self.metrics().get(name, default)

    def log_records(self) -> list[dict]:
        out = []
        for line in list(self.log):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = _METRIC.match(line.strip())
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Poll until predicate() is truthy; return its value or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)


@contextmanager
def run_server(
    *args: str, env: dict[str, str] | None = None, timeout: float = 20.0, cwd: Path = ROOT
) -> Iterator[Server]:
    """Start `python -m firsttoken serve --port 0 ARGS` and yield it once it listens (`cwd`
    first on its sys.path: another folder holding a `firsttoken/` runs that package)."""
    cmd: Sequence[str] = [sys.executable, "-m", "firsttoken", "serve", "--port", "0", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    ready = threading.Event()
    found: list[str] = []

    def _read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line.rstrip("\n"))
            if not ready.is_set() and '"listening"' in line:
                try:
                    found.append(json.loads(line)["url"])
                except (ValueError, KeyError):
                    continue
                ready.set()

    reader = threading.Thread(target=_read, daemon=True)
    reader.start()
    try:
        if not ready.wait(timeout):
            raise RuntimeError("server did not start:\n" + "\n".join(log[-50:]))
        yield Server(proc, found[0], log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)  # a second signal cuts the drain short
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        reader.join(timeout=5)
