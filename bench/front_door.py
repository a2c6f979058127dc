"""TTFT through the front door: HTTP/1.1 straight to the gateway (plain and TLS), HTTP/2 and
HTTP/3 through Caddy (deploy/Caddyfile), on cold and warm connections, on a clean loopback and
with loss on the client's side of the front.

    .venv/bin/python -m bench.front_door                # 5% loss, 100 requests a cell: ~2 min
    .venv/bin/python -m bench.front_door --requests 20 --loss 0,5,10

Everything runs in a network namespace of its own (root: `ip netns`, nftables; tests/netns.py).
The loss is an nftables `numgen random` drop on the namespace loopback's input, of packets to
or from the ports clients reach (the direct gateways and Caddy, TCP and UDP): the last mile is
lossy, Caddy's hop to its gateway is not (that gateway has a port of its own). Loopback's round
trip is ~50 µs, so what loss costs here is timers (TCP's 200 ms minimum RTO and 1 s SYN
retransmit, QUIC's probe timeout), not round trips.

TTFT is what a client sees: from the moment it starts (before connecting, when cold) to the
first content token's bytes. The engine answers at once (--synthetic-ttft-ms 0), so the figure
is the front door's own. Cold: a new connection per request (TCP + TLS 1.3, or a QUIC
handshake; no session resumption, no 0-RTT). Warm: one connection, a first request unmeasured.
Writes bench/results/front_door.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from tests.caddy import Caddy, run_caddy, self_signed
from tests.h3client import h3_connect
from tests.netns import netns
from tests.servers import ROOT, run_server

RESULTS = ROOT / "bench" / "results"
BODY = {
    "model": "synthetic",
    "messages": [{"role": "user", "content": "How fast is the first token?"}],
    "stream": True,
    "max_tokens": 2,
}
CHAT = "/v1/chat/completions"
MARK = b'"content":"'  # the role chunk's content is empty: the first token's is not
NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
PATHS = ("h1 direct", "h1+TLS direct", "h2 via Caddy", "h3 via Caddy")


def _first_token(seen: bytes) -> bool:
    i = seen.find(MARK)
    while i >= 0:
        if seen[i + len(MARK) : i + len(MARK) + 1] not in (b'"', b""):
            return True
        i = seen.find(MARK, i + 1)
    return False


async def _httpx_ttft(client: httpx.AsyncClient, url: str, t0: float | None = None) -> float:
    """Seconds from `t0` (default: now) to the first token; the answer is read to its end."""
    t0 = time.perf_counter() if t0 is None else t0
    seen = b""
    ttft = None
    async with client.stream("POST", url + CHAT, json=BODY) as resp:
        resp.raise_for_status()
        async for data in resp.aiter_raw():
            seen += data
            if ttft is None and _first_token(seen):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("no token")
    return ttft


async def _h3_ttft(client: Any, port: int, t0: float | None = None) -> float:
    t0 = time.perf_counter() if t0 is None else t0
    seen = b""
    ttft = None
    body = json.dumps(BODY).encode()
    headers = {"content-type": "application/json"}
    resp = await client.request("POST", f"localhost:{port}", CHAT, headers, body)
    async for data in resp.chunks():
        seen += data
        if ttft is None and _first_token(seen):
            ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"no token (status {resp.status})")
    return ttft


async def _cell(path: str, cold: bool, fronts: dict[str, Any], n: int) -> list[float]:
    """n TTFTs (seconds) for one path, each on a new connection (cold) or all on one (warm)."""
    caddy: Caddy = fronts["caddy"]
    if path == "h3 via Caddy":
        if cold:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()  # the QUIC handshake is part of a cold TTFT
                async with h3_connect(caddy.port, str(caddy.root_ca)) as client:
                    out.append(await _h3_ttft(client, caddy.port, t0))
            return out
        async with h3_connect(caddy.port, str(caddy.root_ca)) as client:
            await _h3_ttft(client, caddy.port)
            return [await _h3_ttft(client, caddy.port) for _ in range(n)]
    url = {"h1 direct": fronts["plain"], "h1+TLS direct": fronts["tls"]}.get(path, caddy.url)
    verify: ssl.SSLContext | bool = False  # plain HTTP: no CA bundle to load (~40 ms a client)
    if path == "h1+TLS direct":
        verify = ssl.create_default_context(cafile=fronts["cert"])
    elif path == "h2 via Caddy":
        verify = caddy.tls()

    def client() -> httpx.AsyncClient:
        # TCP_NODELAY, as browsers set it: a request's headers and body go out at once.
        transport = httpx.AsyncHTTPTransport(
            verify=verify, http2=path == "h2 via Caddy", socket_options=[NODELAY]
        )
        return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(30.0))

    if cold:
        out = []
        for _ in range(n):
            async with client() as fresh:  # made first: its TLS context is not the network's
                t0 = time.perf_counter()  # httpx connects on the first request: counted
                out.append(await _httpx_ttft(fresh, url, t0))
        return out
    async with client() as warm:
        await _httpx_ttft(warm, url)
        return [await _httpx_ttft(warm, url) for _ in range(n)]


def _set_loss(percent: int, ports: list[int]) -> None:
    """Drop `percent`% of the packets to or from `ports` (TCP and UDP) on loopback input, in
    the namespace this process runs in."""
    subprocess.run(["nft", "flush", "ruleset"], check=True, capture_output=True)
    if not percent:
        return
    listed = ", ".join(str(p) for p in ports)
    rules = "".join(
        f'    iifname "lo" meta l4proto {{ tcp, udp }} th {side} {{ {listed} }} '
        f"numgen random mod 100 < {percent} counter drop\n"
        for side in ("dport", "sport")
    )
    table = (
        "table inet ftloss {\n  chain in {\n"
        "    type filter hook input priority 0; policy accept;\n" + rules + "  }\n}\n"
    )
    subprocess.run(["nft", "-f", "-"], input=table, text=True, check=True, capture_output=True)


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)

    def pct(q: float) -> float:
        return round(ms[min(len(ms) - 1, int(q * len(ms)))], 2)

    return {
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": round(ms[-1], 2),
        "mean": round(statistics.fmean(ms), 2),
        "n": len(ms),
    }


def inside(losses: list[int], n: int) -> dict[str, Any]:
    """Run in the namespace: start the fronts, measure every cell at every loss."""
    gateway_args = (
        "--synthetic-ttft-ms",
        "0",
        "--synthetic-itl-ms",
        "1",
        "--rate-limit-per-s",
        "0",
        "--ttft-slo-ms",
        "0",
    )
    cells: dict[str, Any] = {}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="front-door-")))
        cert, key = self_signed(tmp / "tls")
        plain = stack.enter_context(run_server(*gateway_args))
        tls = stack.enter_context(
            run_server(*gateway_args, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
        )
        behind = stack.enter_context(run_server(*gateway_args))
        caddy = stack.enter_context(run_caddy(f"127.0.0.1:{behind.port}", tmp / "caddy"))
        fronts = {
            "plain": plain.url,
            "tls": tls.url.replace("127.0.0.1", "localhost"),
            "cert": str(cert),
            "caddy": caddy,
        }
        for path in PATHS:  # first requests pay for imports and caches: not measured
            asyncio.run(_cell(path, True, fronts, 5))
        for loss in losses:
            _set_loss(loss, [plain.port, tls.port, caddy.port])
            for path in PATHS:
                for cold in (True, False):
                    name = f"{loss}% {path} {'cold' if cold else 'warm'}"
                    ttfts = asyncio.run(_cell(path, cold, fronts, n))
                    cells[name] = {"loss": loss, "path": path, "cold": cold, **_summary(ttfts)}
                    print(f"{name}: {cells[name]}", file=sys.stderr, flush=True)
        _set_loss(0, [])
    return {"requests": n, "cells": cells, "caddy": _caddy_version()}


def _caddy_version() -> str:
    out = subprocess.run(["caddy", "version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip()


def table(result: dict[str, Any]) -> str:
    lines = [
        "| loss | path | cold p50 | cold p90 | cold p99 | warm p50 | warm p90 | warm p99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cells = result["cells"]
    losses = sorted({c["loss"] for c in cells.values()})
    for loss in losses:
        for path in PATHS:
            cold, warm = cells[f"{loss}% {path} cold"], cells[f"{loss}% {path} warm"]
            lines.append(
                f"| {loss}% | {path} | "
                + " | ".join(f"{c[q]:.1f}" for c in (cold, warm) for q in ("p50", "p90", "p99"))
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100, help="per cell (default 100)")
    parser.add_argument("--loss", default="0,5", help="loss percents, comma-separated")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    losses = [int(x) for x in args.loss.split(",")]
    if args.inside:
        print(json.dumps(inside(losses, args.requests)))
        return
    with netns() as ns:
        argv = [
            sys.executable,
            "-m",
            "bench.front_door",
            "--inside",
            "--requests",
            str(args.requests),
            "--loss",
            args.loss,
        ]
        proc = subprocess.run(
            ns.cmd(argv),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    if proc.returncode:
        raise SystemExit(proc.returncode)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "front_door.json").write_text(json.dumps(result, indent=1))
    print(f"TTFT ms, {result['requests']} requests a cell, {result['caddy']}")
    print(table(result))


if __name__ == "__main__":
    main()
