"""`python -m bench.instructions`: what a new stream costs the server, counted, not timed.

The server's user-space instructions per new stream under valgrind's callgrind, for this
tree and for a baseline commit (`--baseline-rev`, a6bb94a by default: the guard's reference),
in one run. A count does not move with the machine's load, where the `setup` workload's CPU
time does by ±10% on a shared machine; what it leaves out is the kernel's part (system calls,
the same for both trees unless one makes more of them) and cache effects.

Each server runs `firsttoken serve` (synthetic engine, no pacing, the bench's open admission,
logging at info as deployed) under `valgrind --tool=callgrind --instr-atstart=no`. Warm-up
requests run uncounted; then counting starts, is zeroed, `--streams` chat streams of 2 tokens
run in bursts of `--burst` at once, each on its own connection with `Connection: close` (the
`setup` workload's shape), and the count is dumped. The figure is instructions ÷ streams.

Needs valgrind (`apt-get install valgrind`); ~1 minute a tree at the defaults. Figures:
bench/README.md, "Instructions per new stream".
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import orjson

from bench.procs import ROOT, check_out
from bench.servers import OPEN, ServerSpec

BASELINE = "a6bb94a"
_BODY = {
    "model": "synthetic",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "stream": True,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(port: int) -> bytes:
    body = orjson.dumps(_BODY)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def _burst(port: int, streams: int, at_once: int) -> None:
    raw = _request(port)

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        while await reader.read(65536):
            pass
        writer.close()

    for done in range(0, streams, at_once):
        await asyncio.gather(*(one() for _ in range(min(at_once, streams - done))))


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], capture_output=True, check=False)


def count(cwd: Path, out: Path, streams: int, at_once: int) -> float:
    """Instructions per new stream of the firsttoken that `python -m firsttoken` in `cwd`
    imports."""
    port = _free_port()
    dump = out / "callgrind.out"
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={dump}",
        sys.executable,
        "-m",
        "firsttoken",
        "serve",
        "--port",
        str(port),
        "--synthetic-ttft-ms",
        "0",
        "--synthetic-itl-ms",
        "0",
        "--log-level",
        "info",
        *OPEN,
    ]
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300  # valgrind starts Python ~50 times slower
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server in {cwd} did not start under valgrind") from None
                time.sleep(0.5)
        asyncio.run(_burst(port, 100, at_once))  # warm-up, not counted
        _control("-i", "on", str(proc.pid))
        time.sleep(0.5)
        asyncio.run(_burst(port, 30, at_once))  # code paths warm with counting on
        _control("-z", str(proc.pid))
        asyncio.run(_burst(port, streams, at_once))
        _control("-d", "measured", str(proc.pid))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(300)
    for path in sorted(out.glob("callgrind.out*")):
        text = path.read_text(errors="replace")
        if "measured" in text:
            found = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            if found:
                return int(found.group(1)) / streams
    raise SystemExit("callgrind wrote no dump of the measured streams")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument("--baseline-rev", default=BASELINE, help="'none' leaves it out")
    parser.add_argument("--streams", type=int, default=400)
    parser.add_argument("--burst", type=int, default=100, help="streams requested at once")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench.instructions needs valgrind: apt-get install valgrind", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees: list[tuple[str, Path]] = [("this tree", ROOT)]
        if args.baseline_rev != "none":
            rev = args.baseline_rev
            base = check_out(ServerSpec(rev, rev, "firsttoken", True, rev=rev), work)
            assert base.cwd is not None
            trees.insert(0, (args.baseline_rev, base.cwd))
        figures: dict[str, float] = {}
        for name, cwd in trees:
            out = work / f"cg-{len(figures)}"
            out.mkdir()
            figures[name] = count(cwd, out, args.streams, args.burst)
            print(f"{name:>10}: {figures[name]:,.0f} instructions per new stream", flush=True)
    if len(figures) == 2:
        base, now = figures[args.baseline_rev], figures["this tree"]
        print(f"this tree ÷ {args.baseline_rev}: {now / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
