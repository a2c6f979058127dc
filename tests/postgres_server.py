"""A real PostgreSQL (Debian's package) on a free loopback port, in a temporary directory, for
the ledger's tests; it can be stopped and started again on the same port and data (the
database-away tests).

PostgreSQL refuses to run as root: as root (the test machines), initdb and postgres run as the
`postgres` system user (`runuser`); otherwise as the current user.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin_dir() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    if not found:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    return found[-1]


def available() -> bool:
    return bool(glob.glob("/usr/lib/postgresql/*/bin/postgres"))


class PostgresServer:
    def __init__(self, directory: str) -> None:
        self.bin = _bin_dir()
        self.dir = directory
        self.data = os.path.join(directory, "data")
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._as: list[str] = []
        if os.geteuid() == 0:
            self._as = ["runuser", "-u", "postgres", "--"]
            shutil.chown(directory, "postgres", "postgres")
        subprocess.run(
            [*self._as, f"{self.bin}/initdb", "-D", self.data, "-A", "trust", "-U", "postgres"],
            check=True,
            capture_output=True,
            timeout=120,
        )

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        args = ["-D", self.data, "-p", str(self.port), "-h", "127.0.0.1", "-k", self.dir]
        args += ["-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200"]
        self.proc = subprocess.Popen(
            [*self._as, f"{self.bin}/postgres", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            ready = subprocess.run(
                [f"{self.bin}/pg_isready", "-h", "127.0.0.1", "-p", str(self.port), "-q"],
                check=False,
            )
            if ready.returncode == 0:
                return
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("postgres did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop now (fast shutdown: open connections are cut)."""
        if self.proc is not None and self.proc.poll() is None:
            subprocess.run(
                [*self._as, f"{self.bin}/pg_ctl", "stop", "-D", self.data, "-m", "fast", "-s"],
                check=False,
                capture_output=True,
                timeout=60,
            )
            self.proc.wait(timeout=30)
        self.proc = None

    def new_database(self) -> str:
        """A fresh, empty database's URL (one per test)."""
        name = "t_" + uuid.uuid4().hex[:12]
        subprocess.run(
            [
                f"{self.bin}/createdb",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                name,
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    with tempfile.TemporaryDirectory() as tmp:
        server = PostgresServer(tmp)
        server.start()
        try:
            yield server
        finally:
            server.stop()
