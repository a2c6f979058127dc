"""A real redis-server on a free loopback port, for the tests that share state across instances,
and that can be stopped and started again on the same port (the Redis fault tests)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process (no persistence: a restart loses every key, as a crashed
    cache node does); `stop()` and `start()` keep the port."""

    def __init__(self, directory: str) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.port = _free_port()
        self.dir = directory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    """A started RedisServer for the block."""
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp)
        server.start()
        try:
            yield server
        finally:
            server.stop()


@contextmanager
def run_redis() -> Iterator[str]:
    """Yield redis://127.0.0.1:PORT/0 of a throwaway server (no persistence)."""
    with redis_server() as server:
        yield server.url
