"""Failover: do answers outlive their engines? Many streams over three synthetic upstreams while
one is SIGKILLed and restarted on a schedule and another stalls now and then.

    .venv/bin/python -m bench.failover [--quick] [--streams N] [--kill-every-s S] [--no-litellm]

Three `firsttoken serve` synthetic upstreams on fixed loopback ports: `steady`; `killed`, SIGKILLed
every `--kill-every-s` and started again on the same port at once; `stalling`, behind a small TCP
proxy (this module, `--stall-proxy`) that stops forwarding for longer than the idle deadline
every `--stall-every-s`. In front of them one gateway, `firsttoken serve --routes FILE`: the
three as targets of kind openai with `continuation = "vllm"`, short first-token and idle deadlines
(a stall is a cut), `max_splices` 2, balanced by streams in flight.

Clients: `--streams` Chat Completions streams, `--concurrency` at once, each with its own seed
and max_tokens, read to the end by a raw socket client (timestamps only while running, parsed
afterwards). The uninterrupted answer of each request is the synthetic engine's own
(bench/expected.py); a few requests sent straight to `steady` first check that it is.

Figures: completion rate (`[DONE]` and a finish reason, no error event); completed answers
byte-identical to the uninterrupted one, and "clean" ones (also one id, one role delta, one
`[DONE]`, the same finish reason and usage); the gap at each splice as the client saw it (the
last chunk before the cut to the first after it; splices read from the gateway's `route.splice`
log lines), by cause (upstream cut vs stall, a stall's gap includes the idle deadline), set
beside the ordinary first-token time + 50 ms; failovers by phase from the gateway's /metrics.

The same schedule then runs through a LiteLLM proxy (`.venv/litellm`, as bench/proxies.py finds
it) with the three upstreams as one model group, retries and cooldowns as its users configure
them; its completion and identity rates are reported beside the gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson

from bench.decode import _Dechunker, _Events  # the bench's own HTTP/SSE framing
from bench.expected import chat_prompt
from bench.procs import ROOT, ServerProcess, raise_fd_limit
from bench.proxies import LITELLM_ENV, LITELLM_START_S, find_litellm, litellm_version
from bench.servers import ServerSpec
from bench.stats import loadavg
from firsttoken.engines.synthetic import synthetic_tokens

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
OPEN = ("--rate-limit-per-s", "0", "--ttft-slo-ms", "0", "--breaker-error-rate", "1")
UPSTREAMS = ("steady", "killed", "stalling")
MODEL = "synthetic"
COMPLETION_TARGET = 0.999
GAP_ALLOWANCE_MS = 50.0  # the splice's gap target: the next target's first-token time + this


def _log(msg: str) -> None:
    print(f"[failover {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    streams: int = 1000
    concurrency: int = 100
    tokens_min: int = 100
    tokens_max: int = 200
    ttft_ms: float = 50.0
    itl_ms: float = 10.0
    kill_every_s: float = 10.0
    stall_every_s: float = 7.0
    stall_s: float = 3.0  # longer than the idle deadline: every stream through it is cut
    first_token_timeout_s: float = 2.0
    idle_timeout_s: float = 2.0
    max_splices: int = 2
    stream_deadline_s: float = 60.0  # a stream still open after this is counted as stuck

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            streams=100,
            tokens_min=40,
            tokens_max=80,
            concurrency=25,
            kill_every_s=2.0,
            stall_every_s=2.5,
            stall_s=1.5,
            first_token_timeout_s=1.0,
            idle_timeout_s=1.0,
            stream_deadline_s=20.0,
        )


# --- requests and their uninterrupted answers ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    """One client request; its answer without faults is the synthetic engine's for it."""

    index: int
    max_tokens: int

    @property
    def seed(self) -> int:
        return 5000 + self.index

    @property
    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": "You are a benchmark."},
            {"role": "user", "content": f"Failover stream {self.index % 16}, please."},
        ]

    def body(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": self.messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.max_tokens,
            "seed": self.seed,
        }

    def http(self, host: str, port: int) -> bytes:
        body = orjson.dumps(self.body())
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            "Authorization: Bearer x\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        return head.encode() + body

    def answer(self) -> tuple[str, str, int]:
        """The uninterrupted answer: its text, finish reason and completion tokens."""
        tokens, finish = synthetic_tokens(chat_prompt(self.messages), self.seed, self.max_tokens)
        return "".join(tokens), finish, len(tokens)


def asks(sizes: Sizes, seed: int = 24) -> list[Ask]:
    rng = random.Random(seed)
    return [Ask(i, rng.randint(sizes.tokens_min, sizes.tokens_max)) for i in range(sizes.streams)]


# --- the client -------------------------------------------------------------------------------


@dataclass(slots=True)
class Capture:
    ask: Ask
    t_sent: float = 0.0
    reads: list[tuple[float, bytes]] = field(default_factory=list)
    error: str | None = None


class _Stream(asyncio.Protocol):
    """Writes the request; records every read with its time; nothing else while it runs."""

    def __init__(self, cap: Capture, request: bytes) -> None:
        self.cap = cap
        self.request = request
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)
        self.cap.t_sent = time.perf_counter()

    def data_received(self, data: bytes) -> None:
        self.cap.reads.append((time.perf_counter(), data))

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.cap.error = f"connection lost: {exc!r}"
        if not self.closed.done():
            self.closed.set_result(None)


async def drive(host: str, port: int, work: Sequence[Ask], sizes: Sizes) -> list[Capture]:
    """Every request, `sizes.concurrency` at a time, each read until the server closes."""
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(sizes.concurrency)
    caps = [Capture(a) for a in work]

    async def one(cap: Capture) -> None:
        async with slots:
            request = cap.ask.http(host, port)
            try:
                _, proto = await loop.create_connection(lambda: _Stream(cap, request), host, port)
            except OSError as exc:
                cap.error = f"connect failed: {exc!r}"
                return
            done, _ = await asyncio.wait({proto.closed}, timeout=sizes.stream_deadline_s)
            if not done:
                cap.error = f"still open after {sizes.stream_deadline_s:g} s"
                assert proto.transport is not None
                proto.transport.abort()

    await asyncio.gather(*(one(c) for c in caps))
    return caps


@dataclass(slots=True)
class Seen:
    """One stream as the client saw it."""

    status: int | None = None
    ids: set[str] = field(default_factory=set)
    roles: int = 0
    contents: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    dones: int = 0
    error: str | None = None  # an error event or chunk, a bad status, a broken connection

    @property
    def completed(self) -> bool:
        return self.dones >= 1 and self.finish is not None and self.error is None

    @property
    def text(self) -> str:
        return "".join(self.contents)

    @property
    def stream_id(self) -> str | None:
        only = next(iter(self.ids)) if len(self.ids) == 1 else None
        return only.removeprefix("chatcmpl-") if only else None


def parse(cap: Capture) -> Seen:
    seen = Seen()
    head = b""
    body: list[tuple[float, bytes]] = []
    for i, (t, data) in enumerate(cap.reads):
        head += data
        end = head.find(b"\r\n\r\n")
        if end >= 0:
            body = [(t, head[end + 4 :]), *cap.reads[i + 1 :]]
            head = head[:end]
            break
    if not body:
        seen.error = cap.error or "no response"
        return seen
    lines = head.split(b"\r\n")
    seen.status = int(lines[0].split()[1])
    if seen.status != 200:
        seen.error = f"HTTP {seen.status}"
        return seen
    chunked = b"transfer-encoding: chunked" in head.lower()
    dechunk = _Dechunker() if chunked else None
    events = _Events()
    for t, data in body:
        raw = dechunk.feed(data) if dechunk is not None else data
        for block in events.feed(raw):
            _event(seen, t, block)
    if cap.error and not seen.completed:
        seen.error = seen.error or cap.error
    return seen


def _event(seen: Seen, t: float, block: list[bytes]) -> None:
    name = b""
    data: list[bytes] = []
    for line in block:
        if line.startswith(b":"):
            continue
        key, _, value = line.partition(b":")
        value = value[1:] if value.startswith(b" ") else value
        if key == b"data":
            data.append(value)
        elif key == b"event":
            name = value
    if not data:
        return
    payload = b"\n".join(data)
    if name == b"error":
        seen.error = seen.error or "error event: " + payload[:2000].decode(errors="replace")
        return
    if payload == b"[DONE]":
        seen.dones += 1
        return
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        seen.error = seen.error or "undecodable chunk"
        return
    if "error" in chunk:
        seen.error = seen.error or "error chunk: " + payload[:2000].decode(errors="replace")
        return
    if chunk.get("id"):
        seen.ids.add(chunk["id"])
    if chunk.get("usage"):
        seen.usage = chunk["usage"]
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("role"):
            seen.roles += 1
        if delta.get("content"):
            seen.contents.append(delta["content"])
            seen.times.append(t)
        if choice.get("finish_reason"):
            seen.finish = choice["finish_reason"]


# --- the stalling proxy (its own process: `--stall-proxy LISTEN:TARGET`) ----------------------


async def stall_proxy(listen: int, target: int, stall_s: float) -> None:
    """Relay loopback TCP to `target`; on SIGUSR1 stop forwarding both ways for `stall_s`.

    A paused pump neither reads nor writes, so the upstream feels backpressure and the gateway
    hears silence, as from an engine that hangs with its connection open.
    """
    loop = asyncio.get_running_loop()
    flowing = asyncio.Event()
    flowing.set()

    def stall() -> None:
        flowing.clear()
        loop.call_later(stall_s, flowing.set)

    loop.add_signal_handler(signal.SIGUSR1, stall)

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                await flowing.wait()
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", listen, reuse_address=True)
    print(json.dumps({"event": "listening", "url": f"http://127.0.0.1:{listen}"}), flush=True)
    async with server:
        await server.serve_forever()


# --- processes --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class Process:
    """A subprocess with a fixed command; `restart` runs it again (same port) with a new log."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        logs: Path,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.logs = logs
        self.env = {**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"}
        self.cwd = cwd
        self.lives = 0
        self.server: ServerProcess | None = None

    def start(self) -> ServerProcess:
        self.lives += 1
        log = self.logs / f"{self.name}-{self.lives}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                self.cmd, cwd=self.cwd, env=self.env, stdout=sink, stderr=subprocess.STDOUT
            )
        spec = ServerSpec(self.name, self.name, "firsttoken", has_metrics=True)
        self.server = ServerProcess(spec, proc, log)
        return self.server

    def kill(self) -> None:
        if self.server is not None and self.server.proc.poll() is None:
            self.server.proc.kill()
            self.server.proc.wait()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def upstream_cmd(port: int, sizes: Sizes) -> list[str]:
    return [
        sys.executable,
        "-m",
        "firsttoken",
        "serve",
        "--port",
        str(port),
        "--synthetic-ttft-ms",
        _num(sizes.ttft_ms),
        "--synthetic-itl-ms",
        _num(sizes.itl_ms),
        *OPEN,
    ]


def routes_toml(urls: dict[str, str], sizes: Sizes) -> str:
    out: list[str] = []
    for name, url in urls.items():
        out += [
            f"[targets.{name}]",
            'kind = "openai"',
            f'url = "{url}/v1"',
            f'model = "{MODEL}"',
            'continuation = "vllm"',
            "connect_timeout_s = 1",
            f"first_token_timeout_s = {sizes.first_token_timeout_s}",
            f"idle_timeout_s = {sizes.idle_timeout_s}",
            "eject_after = 3",
            "eject_s = 2",
            "",
        ]
    out += [
        f"[models.{MODEL}]",
        "targets = [" + ", ".join(f'"{n}"' for n in urls) + "]",
        f"max_splices = {sizes.max_splices}",
        'balance = "least_busy"',
    ]
    return "\n".join(out) + "\n"


def litellm_yaml(urls: dict[str, str], sizes: Sizes) -> str:
    """The three upstreams as one model group; retries on another deployment, cooldown of a
    failing one, and a stream timeout as short as the gateway's idle deadline."""
    lines = ["model_list:"]
    for name, url in urls.items():
        lines += [
            f"  - model_name: {MODEL}",
            "    litellm_params:",
            f"      model: openai/{MODEL}",
            f"      api_base: {url}/v1",
            "      api_key: x",
            f"      stream_timeout: {sizes.idle_timeout_s}",
            "      timeout: 30",
            "    model_info:",
            f"      id: {name}",
        ]
    lines += [
        "router_settings:",
        "  routing_strategy: simple-shuffle",
        "  num_retries: 2",
        "  allowed_fails: 3",
        "  cooldown_time: 2",
        "litellm_settings:",
        "  num_retries: 2",
        "  request_timeout: 30",
        "  suppress_debug_info: true",
        "general_settings:",
        "  disable_spend_logs: true",
    ]
    return "\n".join(lines) + "\n"


def start_litellm(binary: Path, config: str, logs: Path) -> Process:
    """LiteLLM on a free loopback port, offline (bench/proxies.py's environment), polled on
    /health/liveliness until it answers."""
    path = logs / "litellm.yaml"
    path.write_text(config)
    port = _free_port()
    cmd = [str(binary), "--config", str(path), "--port", str(port), "--host", "127.0.0.1"]
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy")}
    proc = Process("litellm", cmd, logs, env={**env, **LITELLM_ENV}, cwd=logs)
    server = proc.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + LITELLM_START_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"LiteLLM exited ({server.proc.returncode}): {server.log_tail(8)}")
        try:
            with urllib.request.urlopen(url + "/health/liveliness", timeout=2) as resp:
                if resp.status == 200:
                    server.url = url
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    proc.stop()
    raise RuntimeError(f"LiteLLM not ready after {LITELLM_START_S:.0f} s")


class Fleet:
    """The three upstreams and the stalling proxy in front of one of them."""

    def __init__(self, sizes: Sizes, logs: Path) -> None:
        self.sizes = sizes
        self.ports = {name: _free_port() for name in UPSTREAMS}
        self.upstreams = {
            name: Process(name, upstream_cmd(port, sizes), logs)
            for name, port in self.ports.items()
        }
        self.proxy_port = _free_port()
        self.proxy = Process(
            "stall-proxy",
            [
                sys.executable,
                "-m",
                "bench.failover",
                "--stall-proxy",
                f"{self.proxy_port}:{self.ports['stalling']}",
                "--stall-s",
                _num(sizes.stall_s),
            ],
            logs,
        )
        self.kills: list[float] = []
        self.stalls: list[float] = []
        self.restart_s: list[float] = []

    @property
    def urls(self) -> dict[str, str]:
        """What a gateway is pointed at: the stalling upstream through its proxy."""
        port = {**self.ports, "stalling": self.proxy_port}
        return {name: f"http://127.0.0.1:{p}" for name, p in port.items()}

    async def start(self) -> None:
        servers = [p.start() for p in (*self.upstreams.values(), self.proxy)]
        await asyncio.gather(*(asyncio.to_thread(s.wait_ready, 60.0) for s in servers))

    def stop(self) -> None:
        for p in (self.proxy, *self.upstreams.values()):
            p.stop()

    async def chaos(self, t0: float) -> None:
        """Until cancelled: kill and restart `killed`, stall `stalling`, on the schedule.

        A restart runs beside the schedule (a slow start must not delay the next stall), and
        is waited for on the way out, so the next run starts with three upstreams."""
        loop = asyncio.get_running_loop()
        sizes = self.sizes
        stall_at = t0 + sizes.stall_every_s / 2  # the two schedules out of step
        kill_at = t0 + sizes.kill_every_s
        restarts: list[asyncio.Task[None]] = []
        try:
            while True:
                await asyncio.sleep(max(0.0, min(stall_at, kill_at) - loop.time()))
                now = loop.time()
                if now >= stall_at:
                    assert self.proxy.server is not None
                    self.proxy.server.proc.send_signal(signal.SIGUSR1)
                    self.stalls.append(now - t0)
                    stall_at += sizes.stall_every_s
                if now >= kill_at:
                    self.upstreams["killed"].kill()
                    self.kills.append(now - t0)
                    restarts.append(asyncio.create_task(self._restart(now)))
                    kill_at += sizes.kill_every_s
        finally:
            await asyncio.gather(*restarts, return_exceptions=True)

    async def _restart(self, killed_at: float) -> None:
        server = self.upstreams["killed"].start()
        try:
            await asyncio.to_thread(server.wait_ready, 60.0)
        except RuntimeError:
            return  # killed again before it was ready
        self.restart_s.append(asyncio.get_running_loop().time() - killed_at)


# --- one run: a front (the gateway or LiteLLM) under the schedule -----------------------------


async def reference_check(fleet: Fleet, work: Sequence[Ask], sizes: Sizes) -> dict[str, Any]:
    """A few requests straight to `steady`: its answers must be the references."""
    url = fleet.urls["steady"]
    host, port = url.split("//")[1].split(":")
    sample = list(work[: min(10, len(work))])
    caps = await drive(host, int(port), sample, replace(sizes, concurrency=10))
    same = 0
    for cap in caps:
        seen = parse(cap)
        text, finish, tokens = cap.ask.answer()
        usage = (seen.usage or {}).get("completion_tokens")
        same += seen.completed and seen.text == text and seen.finish == finish and usage == tokens
    return {"requests": len(sample), "identical": same}


async def run_front(
    name: str,
    front: ServerProcess,
    fleet: Fleet,
    work: Sequence[Ask],
    sizes: Sizes,
    *,
    faults: bool = True,
) -> tuple[list[Capture], dict[str, Any]]:
    loop = asyncio.get_running_loop()
    fleet.kills, fleet.stalls, fleet.restart_s = [], [], []
    t0 = loop.time()
    chaos = asyncio.create_task(fleet.chaos(t0) if faults else asyncio.sleep(0))
    try:
        caps = await drive(front.host, front.port, work, sizes)
    finally:
        chaos.cancel()
        await asyncio.gather(chaos, return_exceptions=True)
    wall = loop.time() - t0
    # The killed upstream may be down at the end: bring it back for the next run.
    killed = fleet.upstreams["killed"]
    if killed.server is None or killed.server.proc.poll() is not None:
        await asyncio.to_thread(killed.start().wait_ready, 60.0)
    schedule = {
        "wall_s": round(wall, 2),
        "kills_at_s": [round(x, 2) for x in fleet.kills],
        "stalls_at_s": [round(x, 2) for x in fleet.stalls],
        "restart_s": [round(x, 2) for x in fleet.restart_s],
    }
    _log(
        f"{name}: {len(caps)} streams in {wall:.1f} s, {len(fleet.kills)} kills, "
        f"{len(fleet.stalls)} stalls"
    )
    return caps, schedule


def gateway_events(log: Path, offset: int = 0) -> list[dict[str, Any]]:
    """The gateway's `route.*` log lines written after `offset` (one run's)."""
    out: list[dict[str, Any]] = []
    with log.open("rb") as f:
        f.seek(offset)
        for line in f.read().splitlines():
            if b'"route.' not in line:
                continue
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return out


def failover_metrics(gateway: ServerProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in gateway.metrics().items():
        if key.startswith("firsttoken_failovers_total{"):
            phase = key.split('phase="', 1)[1].split('"', 1)[0]
            out[phase] = out.get(phase, 0.0) + value
    return out


# --- figures ----------------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


def summarize(
    name: str, caps: Sequence[Capture], events: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    problems: Counter[str] = Counter()
    completed = identical = clean = passed_off = 0
    ttfts: list[float] = []
    moved = {str(e.get("stream")) for e in events if e.get("event") in _MOVES}
    by_id: dict[str, Seen] = {}
    for cap in caps:
        seen = parse(cap)
        text, finish, tokens = cap.ask.answer()
        if seen.stream_id:
            by_id[seen.stream_id] = seen
        if seen.completed:
            completed += 1
            if seen.text == text:
                identical += 1
                usage = (seen.usage or {}).get("completion_tokens")
                clean += (
                    seen.roles == 1
                    and seen.dones == 1
                    and len(seen.ids) == 1
                    and seen.finish == finish
                    and usage == tokens
                )
            else:
                passed_off += 1  # ended as finished, but not the answer
                cut = text.startswith(seen.text)
                problems["completed with a cut answer" if cut else "completed with other text"] += 1
        else:
            problems[_kind(seen.error or "no [DONE] or finish reason")] += 1
        if seen.times and seen.stream_id not in moved:
            ttfts.append((seen.times[0] - cap.t_sent) * 1000)
    row: dict[str, Any] = {
        "front": name,
        "streams": len(caps),
        "completed": completed,
        "completion_rate": completed / len(caps) if caps else None,
        "identical": identical,
        "clean": clean,
        "completed_not_identical": passed_off,
        "problems": dict(problems.most_common()),
        "ttft_ms_p50": _pct(ttfts, 50),
        "ttft_ms_p99": _pct(ttfts, 99),
    }
    row.update(splice_gaps(by_id, events))
    return row


# A stream that one of these names was moved or cut: its first token is not an ordinary one.
_MOVES = ("route.failover", "route.splice", "route.target_failed", "route.no_splice")


def _kind(error: str) -> str:
    """A problem's kind without the parts that differ per stream (ids, ports, counts)."""
    for prefix in ("error event: ", "error chunk: "):
        if error.startswith(prefix):
            try:
                body = orjson.loads(error.removeprefix(prefix))
                inner = body.get("error", body)
                what = inner.get("code") or str(inner.get("message", ""))[:50]
                return f"{prefix[:-2]} {what}"
            except (orjson.JSONDecodeError, AttributeError):
                return prefix[:-2]  # cut at 160 characters: not JSON any more
    return error.split("(", 1)[0].split(":", 1)[0][:60]


def splice_gaps(by_id: dict[str, Seen], events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The client's gap at each logged splice, by what cut the leg before it."""
    cause: dict[tuple[str, int], str] = {}
    for e in events:
        if e.get("event") == "route.target_failed" and e.get("at_token"):
            code = e.get("code")
            cause[(e["stream"], e["at_token"])] = "stall" if code == "upstream_timeout" else "cut"
    gaps: dict[str, list[float]] = {"cut": [], "stall": []}
    splices = unmatched = 0
    no_splice: Counter[str] = Counter()
    for e in events:
        if e.get("event") == "route.no_splice":
            no_splice[str(e.get("reason"))] += 1
        if e.get("event") != "route.splice":
            continue
        splices += 1
        seen, k = by_id.get(e["stream"]), int(e.get("at_token") or 0)
        if seen is None or not 0 < k < len(seen.times):
            unmatched += 1
            continue
        kind = cause.get((e["stream"], k), "cut")
        gaps[kind].append((seen.times[k] - seen.times[k - 1]) * 1000)
    out: dict[str, Any] = {"splices_logged": splices, "splices_unmatched": unmatched}
    for kind, values in gaps.items():
        out[f"splices_{kind}"] = len(values)
        out[f"gap_{kind}_ms_p50"] = _pct(values, 50)
        out[f"gap_{kind}_ms_p99"] = _pct(values, 99)
        out[f"gap_{kind}_ms_max"] = max(values) if values else None
    out["no_splice"] = dict(no_splice)
    return out


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def render(res: dict[str, Any]) -> str:
    meta, rows = res["meta"], res["runs"]
    s = meta["sizes"]
    lines = [
        f"failover — {meta['date']}, commit {meta['commit']}, {meta['cpus']} CPUs, load avg "
        f"{meta['loadavg_start']} → {meta.get('loadavg_end')}",
        f"{s['streams']} streams, {s['concurrency']} at once, {s['tokens_min']}–{s['tokens_max']}"
        f" tokens, upstream TTFT {s['ttft_ms']:g} ms ITL {s['itl_ms']:g} ms; `killed` SIGKILLed "
        f"every {s['kill_every_s']:g} s, `stalling` silent {s['stall_s']:g} s every "
        f"{s['stall_every_s']:g} s; deadlines first token {s['first_token_timeout_s']:g} s, idle "
        f"{s['idle_timeout_s']:g} s; max_splices {s['max_splices']}",
        f"reference: {meta['reference']['identical']}/{meta['reference']['requests']} direct "
        "answers from `steady` equal the synthetic engine's",
        f"LiteLLM: {meta['litellm']['status']}",
        "",
    ]
    names = [r["front"] for r in rows]
    by = {r["front"]: r for r in rows}
    head = f"{'figure':<40}" + "".join(f"{n:>14}" for n in names)
    lines += [head, "-" * len(head)]

    def add(label: str, cell: Any) -> None:
        lines.append(f"{label:<40}" + "".join(f"{cell(by[n]):>14}" for n in names))

    add(
        "kills / stalls during the run",
        lambda r: f"{len(r['schedule']['kills_at_s'])} / {len(r['schedule']['stalls_at_s'])}",
    )
    add("wall (s)", lambda r: f"{r['schedule']['wall_s']:.1f}")
    add("completed ([DONE] + finish)", lambda r: f"{r['completed']}/{r['streams']}")
    add("completion rate", lambda r: f"{r['completion_rate']:.2%}")
    add("byte-identical to uninterrupted", lambda r: f"{r['identical']}/{r['completed']}")
    add("  and clean (id, role, usage, ...)", lambda r: str(r["clean"]))
    add("completed, not the answer", lambda r: str(r["completed_not_identical"]))
    add(
        "TTFT p50 / p99, streams not moved (ms)",
        lambda r: f"{_f(r['ttft_ms_p50'])} / {_f(r['ttft_ms_p99'])}",
    )
    add("splices (route.splice lines)", lambda r: str(r["splices_logged"]))
    for kind, label in (("cut", "after a cut"), ("stall", "after a stall")):
        add(
            f"  {label}: gap p50 / p99 (ms)",
            lambda r, k=kind: (
                f"{_f(r[f'gap_{k}_ms_p50'])} / {_f(r[f'gap_{k}_ms_p99'])}"
                if r[f"splices_{k}"]
                else "—"
            ),
        )
    add(
        "failovers connect/first/mid (metrics)",
        lambda r: (
            "/".join(_f(r["failovers"].get(p)) for p in ("connect", "first_token", "mid_stream"))
            if r.get("failovers")
            else "—"
        ),
    )
    lines.append("")
    lines.append("problems (streams not completed or not the answer, by kind):")
    for r in rows:
        lines.append(f"  {r['front']}: {r['problems'] or 'none'}")
    for r in rows:
        if r.get("no_splice"):
            lines.append(f"  {r['front']} ended without a splice: {r['no_splice']}")
    lines.append("")
    lines.append("TARGETS")
    for t in res["targets"]:
        mark = "n/a" if t["passed"] is None else "PASS" if t["passed"] else "FAIL"
        lines.append(f"  {t['target']}: {t['value']} {mark}")
    return "\n".join(lines)


def targets(rows: Sequence[dict[str, Any]], sizes: Sizes) -> list[dict[str, Any]]:
    gw = next((r for r in rows if r["front"] == "firsttoken"), None)
    if gw is None:
        return []
    out = [
        {
            "target": f"completion rate ≥ {COMPLETION_TARGET:.1%}",
            "value": f"{gw['completion_rate']:.2%}",
            "passed": gw["completion_rate"] >= COMPLETION_TARGET,
        },
        {
            "target": "every completed answer byte-identical",
            "value": f"{gw['identical']}/{gw['completed']}",
            "passed": gw["identical"] == gw["completed"],
        },
    ]
    for q in ("p50", "p99"):
        gap, ttft = gw[f"gap_cut_ms_{q}"], gw[f"ttft_ms_{q}"]
        budget = None if ttft is None else ttft + GAP_ALLOWANCE_MS
        out.append(
            {
                "target": f"gap at a splice after a cut {q} ≤ TTFT {q} + {GAP_ALLOWANCE_MS:g} ms",
                "value": f"{_f(gap)} ms vs {_f(budget)} ms",
                "passed": None if gap is None or budget is None else gap <= budget,
            }
        )
        # A stall is noticed only at the idle deadline; what follows it is the splice's.
        stall = gw[f"gap_stall_ms_{q}"]
        after = None if stall is None else stall - sizes.idle_timeout_s * 1000
        out.append(
            {
                "target": f"gap at a splice after a stall, past the idle deadline, {q} ≤ TTFT "
                f"{q} + {GAP_ALLOWANCE_MS:g} ms",
                "value": f"{_f(after)} ms vs {_f(budget)} ms",
                "passed": None if after is None or budget is None else after <= budget,
            }
        )
    return out


async def measure(
    name: str,
    front: Process,
    fleet: Fleet,
    work: Sequence[Ask],
    sizes: Sizes,
    res: dict[str, Any],
    *,
    control: bool,
) -> None:
    """One front under the faults (and first without them, with `control`): a row each."""
    server = front.server
    assert server is not None
    gateway = name == "firsttoken"
    for faults in (False, True) if control else (True,):
        label = name if faults else f"{name} calm"
        offset = server.log.stat().st_size
        before = failover_metrics(server) if gateway else {}
        caps, schedule = await run_front(label, server, fleet, work, sizes, faults=faults)
        row = summarize(label, caps, gateway_events(server.log, offset) if gateway else [])
        row["schedule"] = schedule
        if gateway:
            after = failover_metrics(server)
            row["failovers"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
        res["runs"].append(row)


# --- main -------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, sizes: Sizes, res: dict[str, Any]) -> None:
    out: Path = args.out
    logs = out / "failover-logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = asks(sizes)
    fleet = Fleet(sizes, logs)
    fronts: list[Process] = []
    try:
        await fleet.start()
        res["meta"]["reference"] = await reference_check(fleet, work, sizes)
        _log(f"upstreams ready {fleet.urls}; reference {res['meta']['reference']}")
        routes = logs / "routes.toml"
        routes.write_text(routes_toml(fleet.urls, sizes))
        cmd = [sys.executable, "-m", "firsttoken", "serve", "--port", "0", "--routes"]
        gateway = Process("gateway", [*cmd, str(routes), *OPEN], logs)
        fronts.append(gateway)
        await asyncio.to_thread(gateway.start().wait_ready, 60.0)
        await measure("firsttoken", gateway, fleet, work, sizes, res, control=args.control)
        gateway.stop()
        if args.no_litellm:
            res["meta"]["litellm"]["status"] = "skipped (--no-litellm)"
            return
        binary = find_litellm(args.litellm)
        if binary is None:
            res["meta"]["litellm"]["status"] = "not installed (see bench/README.md, Proxies)"
            return
        version = litellm_version(binary)
        try:
            lite = await asyncio.to_thread(
                start_litellm, binary, litellm_yaml(fleet.urls, sizes), logs
            )
        except RuntimeError as exc:
            res["meta"]["litellm"]["status"] = f"did not start: {exc}"
            return
        fronts.append(lite)
        res["meta"]["litellm"]["status"] = f"litellm {version}, one model group of three"
        await measure("litellm", lite, fleet, work, sizes, res, control=args.control)
    finally:
        for p in fronts:
            p.stop()
        fleet.stop()


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "firsttoken"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100 streams, kill every 3 s")
    parser.add_argument("--streams", type=int, help="streams in all (default 1000)")
    parser.add_argument("--concurrency", type=int, help="streams at once (default 100)")
    parser.add_argument("--kill-every-s", type=float, help="SIGKILL `killed` this often (10)")
    parser.add_argument("--stall-every-s", type=float, help="stall `stalling` this often (7)")
    parser.add_argument("--litellm", help="path to the `litellm` command")
    parser.add_argument("--no-litellm", action="store_true", help="the gateway only")
    parser.add_argument(
        "--control", action="store_true", help="run each front without faults first, too"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    parser.add_argument("--stall-proxy", help=argparse.SUPPRESS)  # LISTEN:TARGET (internal)
    parser.add_argument("--stall-s", type=float, default=3.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stall_proxy:
        listen, target = (int(p) for p in args.stall_proxy.split(":"))
        asyncio.run(stall_proxy(listen, target, args.stall_s))
        return 0
    sizes = Sizes.quick() if args.quick else Sizes()
    for knob in ("streams", "concurrency", "kill_every_s", "stall_every_s"):
        if getattr(args, knob) is not None:
            sizes = replace(sizes, **{knob: getattr(args, knob)})
    raise_fd_limit(sizes.concurrency * 8 + 1024)
    res: dict[str, Any] = {
        "meta": {
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "commit": _commit(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mode": "quick" if args.quick else "full",
            "loadavg_start": loadavg(),
            "sizes": asdict(sizes),
            "reference": {"requests": 0, "identical": 0},
            "litellm": {"status": "not tried"},
        },
        "runs": [],
    }
    try:
        asyncio.run(bench(args, sizes, res))
    finally:
        res["meta"]["loadavg_end"] = loadavg()
        res["targets"] = targets(res["runs"], sizes)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "failover.json").write_text(json.dumps(res, indent=2, default=str))
        text = render(res)
        print(text, flush=True)
        (args.out / "failover.txt").write_text(text + "\n")
        if args.json:
            print(json.dumps(res, indent=2, default=str))
    print(f"\nwrote {args.out / 'failover.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
