"""A network namespace of the test's own, its loopback made lossy with nftables.

`ip netns add` needs root (CAP_SYS_ADMIN); the loss is a `numgen random` drop rule on what
the namespace's `lo` delivers (the kernel here has no netem), so it drops that share of the
segments, ACKs and SYNs of both directions. The rule sits on the *input* hook on purpose: a
packet dropped on output never left, the sender's TCP is told at once (a local send failure)
and sends it again with its next write, with no retransmission counted anywhere; dropped on
input, it was sent and is lost, as on a real network (RACK, TLP and RTO repair it).
Processes run inside with `Netns.cmd([...])`; the server and the clients are pinned to one
CPU: loopback queues packets per CPU, so a sender that moves between CPUs can reorder its
own segments, which the receiver counts as it counts a loss (`tcpi_rcv_ooopack`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tests.servers import ROOT


def _run(*cmd: str, stdin: str | None = None) -> None:
    subprocess.run(cmd, check=True, input=stdin, text=True, capture_output=True, timeout=30)


def require_tools() -> None:
    """Fail (not skip) without the tools: the test command installs them."""
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"missing {', '.join(missing)}: apt-get install iproute2 nftables")


def _one_cpu() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


class Netns:
    def __init__(self, name: str) -> None:
        self.name = name

    def cmd(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def set_loss(self, percent: int) -> None:
        """Drop `percent`% of the packets leaving the namespace's loopback (0: none)."""
        _run(*self.cmd(["nft", "flush", "ruleset"]))
        if percent:
            rules = (
                "table inet ftloss {\n"
                "  chain in {\n"
                "    type filter hook input priority 0; policy accept;\n"
                f'    iifname "lo" numgen random mod 100 < {percent} counter drop\n'
                "  }\n"
                "}\n"
            )
            _run(*self.cmd(["nft", "-f", "-"]), stdin=rules)

    def drops(self) -> int:
        """Packets the loss rule has dropped so far (its counter)."""
        out = subprocess.run(
            self.cmd(["nft", "-j", "list", "table", "inet", "ftloss"]),
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for item in json.loads(out)["nftables"]:
            for expr in item.get("rule", {}).get("expr", []):
                if "counter" in expr:
                    return int(expr["counter"]["packets"])
        return 0

    @contextmanager
    def server(self, *args: str) -> Iterator[str]:
        """`firsttoken serve --port 0 ARGS` inside the namespace; yields its URL."""
        import sys

        proc = subprocess.Popen(
            self.cmd([sys.executable, "-m", "firsttoken", "serve", "--port", "0", *args]),
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_one_cpu,
        )
        found: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not ready.is_set() and '"listening"' in line:
                    found.append(json.loads(line)["url"])
                    ready.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            if not ready.wait(30):
                raise RuntimeError("server did not start in the namespace")
            yield found[0]
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(5)

    def python(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        import sys

        return subprocess.run(
            self.cmd([sys.executable, *args]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=_one_cpu,
        )


@contextmanager
def netns() -> Iterator[Netns]:
    require_tools()
    name = f"ft-{os.getpid()}-{secrets.token_hex(3)}"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "-n", name, "link", "set", "lo", "up")
        yield Netns(name)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
