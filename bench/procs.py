"""Server processes under test: start one on an ephemeral port, read its CPU time and RSS."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.servers import ServerSpec

__all__ = [
    "CpuSample",
    "RedisProcess",
    "ServerProcess",
    "check_out",
    "cpu_sample",
    "raise_fd_limit",
]

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """A server subprocess; stdout/stderr go to a log file (nothing to drain while measuring)."""

    def __init__(self, spec: ServerSpec, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.spec = spec
        self.proc = proc
        self.log = log
        self.url = ""
        self.ps = psutil.Process(proc.pid)

    @classmethod
    def launch(
        cls, spec: ServerSpec, log: Path, *, ttft_ms: float, itl_ms: float, heartbeat_s: float
    ) -> ServerProcess:
        if spec.rev and spec.cwd is None:
            raise RuntimeError(f"{spec.name}: run check_out() first (firsttoken at {spec.rev})")
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                spec.command(ttft_ms, itl_ms, heartbeat_s),
                cwd=spec.cwd or ROOT,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        return cls(spec, proc, log)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if '"listening"' in line:
                    try:
                        self.url = json.loads(line)["url"]
                        return
                    except (ValueError, KeyError):
                        continue
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.spec.name} did not start; log tail:\n{self.log_tail()}")

    @property
    def host(self) -> str:
        return self.url.split("//", 1)[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def cpu_seconds(self) -> float:
        """Time on CPU of the server and any children it started, every thread: from
        `/proc/PID/task/TID/schedstat` (ns) where there is one, as `stat`'s utime + stime
        count 10 ms ticks, and a small server at tiny sizes could read 0."""
        total = 0.0
        for p in [self.ps, *self.ps.children(recursive=True)]:
            try:
                total += _on_cpu_s(p)
            except psutil.NoSuchProcess:
                continue
        return total

    def rss_bytes(self) -> int:
        total = 0
        for p in [self.ps, *self.ps.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name.strip()] = float(value)
            except ValueError:
                continue
        return out

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RedisProcess:
    """A redis-server on a free loopback port for the `--redis` servers (no persistence)."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"

    @classmethod
    def start(cls, log: Path) -> RedisProcess:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log.parent.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [binary, *args, "--dir", str(log.parent)], stdout=sink, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return cls(proc, port)
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def cpu_seconds(self) -> float:
        try:
            return _on_cpu_s(psutil.Process(self.proc.pid))
        except psutil.NoSuchProcess:
            return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def check_out(spec: ServerSpec, out: Path) -> ServerSpec:
    """Extract `firsttoken/` as of `spec.rev` into OUT/baseline-REV/; the spec then runs there.

    `python -m firsttoken` started with that folder as cwd imports the old package: the cwd
    comes first on sys.path, before the editable install's finder (checked here, once).
    """
    if not spec.rev:
        return spec
    dest = (out / f"baseline-{spec.rev}").resolve()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "archive", spec.rev, "firsttoken"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert archive.stdout is not None
    untar = subprocess.run(
        ["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True
    )
    archive.stdout.close()
    err = archive.stderr.read().decode(errors="replace") if archive.stderr else ""
    if archive.wait() != 0 or untar.returncode != 0:
        why = (err or untar.stderr.decode(errors="replace")).strip()
        raise RuntimeError(f"cannot extract firsttoken at {spec.rev!r}: {why}")
    found = subprocess.run(
        [sys.executable, "-c", "import firsttoken; print(firsttoken.__file__)"],
        cwd=dest,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not found.startswith(str(dest)):
        raise RuntimeError(f"{spec.name}: `import firsttoken` in {dest} found {found!r}")
    return dataclasses.replace(spec, cwd=dest)


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU seconds used so far: this (client) process, and the whole machine (busy, total)."""

    wall: float
    client: float
    machine_busy: float

    def since(self, earlier: CpuSample) -> tuple[float, float, float]:
        return (
            self.wall - earlier.wall,
            self.client - earlier.client,
            self.machine_busy - earlier.machine_busy,
        )


_ME = psutil.Process()


def cpu_sample() -> CpuSample:
    mine = _ME.cpu_times()
    machine = psutil.cpu_times()
    busy = machine.user + machine.nice + machine.system
    busy += getattr(machine, "irq", 0.0) + getattr(machine, "softirq", 0.0)
    return CpuSample(time.perf_counter(), mine.user + mine.system, busy)


def raise_fd_limit(wanted: int) -> tuple[int, str | None]:
    """Raise RLIMIT_NOFILE toward `wanted` (children inherit it); returns (limit, note)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    note = None
    if soft < wanted:
        note = f"open-file limit is {soft} (hard limit {hard}), below the {wanted} wanted"
    return soft, note


def _on_cpu_s(p: psutil.Process) -> float:
    try:
        tids = os.listdir(f"/proc/{p.pid}/task")
    except OSError:
        tids = []
    total_ns = 0
    for tid in tids:
        try:
            with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                total_ns += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    if total_ns:
        return total_ns / 1e9
    t = p.cpu_times()
    return t.user + t.system
