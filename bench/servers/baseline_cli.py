"""The command line every baseline server takes: `serve` with firsttoken's engine knobs."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Sequence

__all__ = ["listening_socket", "parse_serve_args"]


def parse_serve_args(prog: str, argv: Sequence[str] | None) -> argparse.Namespace:
    """`serve --host --port --synthetic-ttft-ms --synthetic-itl-ms --heartbeat-s`, as the
    bench launches firsttoken and every baseline alike; `--log-ttft` where a baseline has it."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--synthetic-ttft-ms", type=float, default=200.0)
    parser.add_argument("--synthetic-itl-ms", type=float, default=20.0)
    parser.add_argument("--heartbeat-s", type=float, default=15.0)
    # A baseline's own TTFT, logged as firsttoken logs it (`stream.first_token`), for an
    # outside client's TTFT to be held against (bench.ttft_agreement --floor).
    parser.add_argument("--log-ttft", action="store_true")
    return parser.parse_args(argv)


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before the server runs: connections queue from the start, and
    the port is known to print (uvicorn accepts on it once it runs)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    return sock
