"""A real redis-server on a free loopback port, for the tests that share state across instances,
and that can be stopped and started again on the same port (the Redis fault tests); and a real
Redis Cluster of several such servers (`redis_cluster`)."""

from __future__ import annotations

import os
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


class RedisClusterServers:
    """A Redis Cluster of `masters` masters, each with `replicas` replicas, every node a
    redis-server on a free loopback port (no persistence). A failed node counts as failed
    after `node_timeout_ms`, so a killed master's replica takes over in a second or two."""

    def __init__(
        self, directory: str, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000
    ) -> None:
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
        self.dir = directory
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.ports = [_cluster_port() for _ in range(masters * (1 + replicas))]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """One node's URL: the client finds the others."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start_node(self, port: int) -> None:
        node_dir = f"{self.dir}/{port}"
        os.makedirs(node_dir, exist_ok=True)
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", f"{node_dir}/nodes.conf"]
        args += ["--cluster-node-timeout", str(self.node_timeout_ms), "--dir", node_dir]
        self.procs[port] = subprocess.Popen(
            [self.binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        _wait_for_pong(port, self.procs[port])

    def start(self) -> None:
        for port in self.ports:
            self.start_node(port)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        replicas = ("--cluster-replicas", str(self.replicas))
        subprocess.run(
            [self.cli, "--cluster", "create", *nodes, *replicas, "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()
        self.wait_replicas_synced()

    def wait_replicas_synced(self, timeout: float = 30) -> None:
        """Until every replica has its master's data (a replica that never synced does not
        take over when its master fails)."""
        deadline = time.monotonic() + timeout
        replicas = [int(n[1].split(":")[1].split("@")[0]) for n in self.nodes() if "slave" in n[2]]
        while not all(
            "master_link_status:up" in self.command(p, "info", "replication") for p in replicas
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas did not sync")
            time.sleep(0.1)

    def command(self, port: int, *args: str) -> str:
        done = subprocess.run(
            [self.cli, "-p", str(port), *args], capture_output=True, text=True, timeout=10
        )
        return done.stdout

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node says the cluster is ok and agrees on its masters."""
        deadline = time.monotonic() + timeout
        while True:
            live = [p for p, proc in self.procs.items() if proc.poll() is None]
            states = [self.command(p, "cluster", "info") for p in live]
            if all("cluster_state:ok" in s for s in states) and len(self.master_ports()) == (
                self.masters
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not settle: {states}")
            time.sleep(0.1)

    def nodes(self) -> list[list[str]]:
        """`CLUSTER NODES` as seen by a live node: one split line per node."""
        live = next(p for p, proc in self.procs.items() if proc.poll() is None)
        return [line.split() for line in self.command(live, "cluster", "nodes").splitlines()]

    def master_ports(self) -> list[int]:
        return sorted(
            int(n[1].split(":")[1].split("@")[0])
            for n in self.nodes()
            if "master" in n[2] and "fail" not in n[2]
        )

    def master_of_slot(self, slot: int) -> int:
        for n in self.nodes():
            if "master" not in n[2] or "fail" in n[2]:
                continue
            for part in n[8:]:
                lo, _, hi = part.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return int(n[1].split(":")[1].split("@")[0])
        raise LookupError(slot)

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)


def _cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000) is one too."""
    while True:
        port = _free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _wait_for_pong(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)


@contextmanager
def redis_cluster(masters: int = 3, replicas: int = 0) -> Iterator[RedisClusterServers]:
    """A started cluster for the block."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = RedisClusterServers(tmp, masters, replicas)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
