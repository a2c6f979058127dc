"""`python -m bench.abuse`: what one unfriendly client does to everyone else (issues 25, 37).

A well-behaved key (`alice`: streaming chat answers, a few at a time) runs alone for a
baseline phase, then beside an unfriendly key (`mallory`) running every client of issue 25 at
once, against one `firsttoken serve` on 127.0.0.1:

- streams whose engine fails to open (tool-call arguments nested past orjson's limit);
- huge `answer_tokens` (the most the synthetic engine takes; streamed, and cut by the client
  after 2 MB);
- huge non-streaming answers (the same, whole: held until they end, up to
  `--max-response-bytes`);
- readers that never read (raw sockets asking for a finished long stream's events);
- long native streams that are never opened (their resume buffers fill the server);
- bad `Last-Event-ID` values (a superscript digit, 5,000 digits);
- pipelined non-readers (raw sockets that send a huge streamed answer's request with a second
  request pipelined behind it, and read nothing);
- upgrade holds (raw sockets that POST with `Upgrade: websocket` and wait);
- big prompts (878 KiB of 450,000 words, `max_tokens: 1`: counted once per request, from
  samples, off the loop's way);
- budget leaks (`max_tokens: 1` beside `max_completion_tokens: 5000`: the answer may run to
  the smaller, what was admitted; `budget_leak billed>1` counts any that ran past it).

It reports alice's completion rate and TTFT p99 and the server's peak RSS in each phase, and
the abuse phase's ratios to the baseline: a ratio near 1 is a server that kept one client's
doing to that client.

    python -m bench.abuse --duration-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from bench.procs import ROOT
from firsttoken.engines import synthetic

# The most the synthetic engine takes (more is refused with 400, issue 25.2).
HUGE = getattr(synthetic, "MAX_KNOB_TOKENS", 1_000_000)

__all__ = ["AbuseResult", "Phase", "abuse", "main"]

KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"

[[keys]]
name = "mallory"
key = "sk-mallory"
"""
SERVER_ARGS = (
    "--synthetic-ttft-ms", "20",
    "--synthetic-itl-ms", "5",
    "--max-streams-per-key", "16",
    "--send-timeout-s", "5",
    "--resume-grace-s", "5",
)  # fmt: skip
ALICE_CONCURRENCY = 4
ALICE_TOKENS = 40
NEVER_READERS = 50  # raw sockets at once that never read
PIPELINED_READERS = 20  # raw sockets at once with a request pipelined behind a stream
UPGRADERS = 20  # raw sockets at once asking for a WebSocket upgrade
READER_BATCH_S = 8.0  # a fresh batch of them this often
TIMEOUT = httpx.Timeout(30.0, connect=10.0)


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@dataclass
class Phase:
    name: str
    duration_s: float = 0.0
    attempted: int = 0
    completed: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    peak_rss_mib: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)

    @property
    def completion_rate(self) -> float:
        return self.completed / self.attempted if self.attempted else 0.0

    @property
    def ttft_p99_ms(self) -> float | None:
        if not self.ttft_ms:
            return None
        ordered = sorted(self.ttft_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "duration_s": round(self.duration_s, 1),
            "attempted": self.attempted,
            "completed": self.completed,
            "completion_rate": round(self.completion_rate, 4),
            "ttft_p50_ms": _round(sorted(self.ttft_ms)[len(self.ttft_ms) // 2])
            if self.ttft_ms
            else None,
            "ttft_p99_ms": _round(self.ttft_p99_ms),
            "peak_rss_mib": round(self.peak_rss_mib, 1),
            "failures": dict(self.failures),
        }


@dataclass
class AbuseResult:
    baseline: Phase
    abuse: Phase
    unfriendly: Counter[str] = field(default_factory=Counter)  # "client status" -> count
    server_metrics: dict[str, float] = field(default_factory=dict)

    def ratios(self) -> dict[str, float | None]:
        b, a = self.baseline, self.abuse
        return {
            "completion_rate": _ratio(a.completion_rate, b.completion_rate),
            "ttft_p99": _ratio(a.ttft_p99_ms, b.ttft_p99_ms),
            "peak_rss": _ratio(a.peak_rss_mib, b.peak_rss_mib),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline.summary(),
            "abuse": self.abuse.summary(),
            "ratios_abuse_to_baseline": self.ratios(),
            "unfriendly_requests": dict(sorted(self.unfriendly.items())),
            "server_metrics": self.server_metrics,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _ratio(x: float | None, y: float | None) -> float | None:
    return None if x is None or not y else round(x / y, 3)


# -- the server -----------------------------------------------------------------------------------


class Server:
    def __init__(self, log: Path, keys: Path, *args: str) -> None:
        self.log = log
        with log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "firsttoken", "serve", "--port", "0", "--api-keys",
                 str(keys), *SERVER_ARGS, *args],
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        self.ps = psutil.Process(self.proc.pid)
        self.url = ""
        deadline = time.monotonic() + 30
        while not self.url:
            for line in log.read_text(errors="replace").splitlines():
                if '"listening"' in line:
                    self.url = json.loads(line)["url"]
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start:\n" + log.read_text()[-2000:])
            time.sleep(0.05)
        self.port = int(self.url.rsplit(":", 1)[1])

    def rss_mib(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    async def metrics(self) -> dict[str, float]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            text = (await client.get(self.url + "/metrics")).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- alice: the well-behaved key ---------------------------------------------------------------


async def _alice_once(client: httpx.AsyncClient, phase: Phase) -> None:
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": f"hello {phase.attempted}"}],
        "max_tokens": ALICE_TOKENS,
        "stream": True,
    }
    phase.attempted += 1
    started = time.perf_counter()
    first: float | None = None
    done = False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                phase.failures[f"status {r.status_code}"] += 1
                await r.aread()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = time.perf_counter()
    except httpx.HTTPError as exc:
        phase.failures[type(exc).__name__] += 1
        return
    if not done:
        phase.failures["no [DONE]"] += 1
        return
    phase.completed += 1
    if first is not None:
        phase.ttft_ms.append((first - started) * 1000)


async def _alice(server: Server, phase: Phase, until: float) -> None:
    headers = {"authorization": "Bearer sk-alice"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=TIMEOUT) as c:

        async def loop() -> None:
            while time.monotonic() < until:
                await _alice_once(c, phase)

        await asyncio.gather(*(loop() for _ in range(ALICE_CONCURRENCY)))


async def _watch_rss(server: Server, phase: Phase, until: float) -> None:
    while time.monotonic() < until:
        phase.peak_rss_mib = max(phase.peak_rss_mib, server.rss_mib())
        await asyncio.sleep(0.25)


async def _run_phase(server: Server, phase: Phase, seconds: float, *others: Any) -> None:
    started = time.monotonic()
    until = started + seconds
    await asyncio.gather(
        _alice(server, phase, until), _watch_rss(server, phase, until), *(o(until) for o in others)
    )
    phase.duration_s = time.monotonic() - started


# -- mallory: every unfriendly client at once --------------------------------------------------

Unfriendly = Callable[[httpx.AsyncClient, Server, Counter[str]], Awaitable[None]]


async def _failed_open(client: httpx.AsyncClient, server: Server, seen: Counter[str]) -> None:
    body = {"prompt": "x", "synthetic": {"tool_call": {"name": "f", "arguments": _nested(300)}}}
    r = await client.post("/v1/streams", json=body)
    seen[f"failed_open {r.status_code}"] += 1


async def _huge_stream(client: httpx.AsyncClient, server: Server, seen: Counter[str]) -> None:
    body = {
        "messages": [{"role": "user", "content": "everything"}],
        "stream": True,
        "synthetic": {"answer_tokens": HUGE, "itl_ms": 0},
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        seen[f"huge_answer_tokens {r.status_code}"] += 1
        with contextlib.suppress(httpx.HTTPError):
            got = 0
            async for chunk in r.aiter_bytes():
                got += len(chunk)
                if got > 2_000_000:  # then hang up: the engine must stop
                    break


async def _huge_whole(client: httpx.AsyncClient, server: Server, seen: Counter[str]) -> None:
    body = {
        "messages": [{"role": "user", "content": "everything, at once"}],
        "synthetic": {"answer_tokens": HUGE, "itl_ms": 0},
    }
    # At the synthetic engine's fastest (a token a millisecond) it takes ~100 s to end.
    r = await client.post("/v1/chat/completions", json=body, timeout=300)
    seen[f"huge_whole_answer {r.status_code}"] += 1


async def _never_opened(client: httpx.AsyncClient, server: Server, seen: Counter[str]) -> None:
    body = {"prompt": "keep this", "synthetic": {"answer_tokens": 8000, "itl_ms": 0}}
    r = await client.post("/v1/streams", json=body)
    seen[f"never_opened {r.status_code}"] += 1


async def _bad_last_event_id(client: httpx.AsyncClient, server: Server, seen: Counter[str]) -> None:
    r = await client.post("/v1/streams", json={"prompt": "x", "max_tokens": 2})
    if r.status_code != 201:
        seen[f"bad_last_event_id create {r.status_code}"] += 1
        return
    url = r.json()["events_url"]
    for bad in ("²".encode(), b"9" * 5000):  # passes isdigit(); past Python's int limit
        got = await client.get(url, headers={"last-event-id": bad})
        seen[f"bad_last_event_id {got.status_code}"] += 1


BIG_PROMPT = "a " * 450_000


async def _big_prompt(client: httpx.AsyncClient, server: Server, seen: Counter[str]) -> None:
    body = {"messages": [{"role": "user", "content": BIG_PROMPT}], "max_tokens": 1}
    r = await client.post("/v1/chat/completions", json=body)
    seen[f"big_prompt {r.status_code}"] += 1


async def _budget_leak(client: httpx.AsyncClient, server: Server, seen: Counter[str]) -> None:
    body = {
        "messages": [{"role": "user", "content": "as long as you like"}],
        "max_tokens": 1,
        "max_completion_tokens": 5000,
    }
    r = await client.post("/v1/chat/completions", json=body)
    seen[f"budget_leak {r.status_code}"] += 1
    if r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 1:
        seen["budget_leak billed>1"] += 1


async def _loop(
    kind: Unfriendly, server: Server, seen: Counter[str], until: float, pause_s: float = 0.05
) -> None:
    headers = {"authorization": "Bearer sk-mallory"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=TIMEOUT) as c:
        while time.monotonic() < until:
            try:
                await kind(c, server, seen)
            except httpx.HTTPError as exc:
                seen[f"{kind.__name__.strip('_')} {type(exc).__name__}"] += 1
            await asyncio.sleep(pause_s)


async def _never_readers(server: Server, seen: Counter[str], until: float) -> None:
    """NEVER_READERS raw sockets at a time ask for a long stream's events and read nothing;
    a fresh batch replaces them every READER_BATCH_S (the server cuts a stalled one after its
    send timeout, but the client is only told once the unread bytes drain)."""
    headers = {"authorization": "Bearer sk-mallory"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=TIMEOUT) as c:
        body = {"prompt": "long", "synthetic": {"answer_tokens": 8000, "itl_ms": 0}}
        r = await c.post("/v1/streams", json=body)
        if r.status_code != 201:
            seen[f"never_reader create {r.status_code}"] += 1
            return
        path = r.json()["events_url"]
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    await _raw_batches(server, seen, until, "never_reader", request, NEVER_READERS)


def _raw_post(path: str, body: dict[str, Any], extra: str = "") -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-mallory\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{extra}\r\n"
    )
    return head.encode() + payload


async def _pipelined_readers(server: Server, seen: Counter[str], until: float) -> None:
    """Issue 37's worst: a huge streamed answer's request with a second request pipelined
    behind it, and nothing read. The stream must stay bounded and be cut (`closed` below)."""
    messages = [{"role": "user", "content": "everything, pipelined"}]
    knobs = {"answer_tokens": HUGE, "itl_ms": 0}
    stream = {"messages": messages, "stream": True, "synthetic": knobs}
    behind = {"messages": messages, "max_tokens": 2}
    request = _raw_post("/v1/chat/completions", stream) + _raw_post("/v1/chat/completions", behind)
    await _raw_batches(server, seen, until, "pipelined_non_reader", request, PIPELINED_READERS)


async def _upgraders(server: Server, seen: Counter[str], until: float) -> None:
    """A POST asking for a WebSocket upgrade, then waiting: answered and closed, or held."""
    extra = (
        "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    )
    body = {"messages": [{"role": "user", "content": "upgrade me"}], "stream": True}
    request = _raw_post("/v1/chat/completions", body, extra)
    await _raw_batches(server, seen, until, "upgrade", request, UPGRADERS)


async def _raw_batches(
    server: Server, seen: Counter[str], until: float, name: str, request: bytes, count: int
) -> None:
    """`count` raw sockets at a time send `request` and read nothing; a fresh batch replaces
    them every READER_BATCH_S. When a batch goes, those the server had closed by then are
    counted `closed`, the others `held`."""
    loop = asyncio.get_running_loop()
    batch: list[socket.socket] = []

    def replace() -> None:
        for sock in batch:
            seen[f"{name} {'closed' if _closed(sock) else 'held'}"] += 1
            sock.close()
        batch.clear()

    try:
        while time.monotonic() < until:
            replace()
            for _ in range(count):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                await loop.sock_connect(sock, ("127.0.0.1", server.port))
                await loop.sock_sendall(sock, request)
                batch.append(sock)
                seen[f"{name} opened"] += 1
            await asyncio.sleep(min(READER_BATCH_S, max(0.0, until - time.monotonic())))
    finally:
        replace()


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed (or reset) `sock`: what it sent is read first."""
    try:
        for _ in range(64):
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    return False


# -- the run ------------------------------------------------------------------------------------


async def abuse(
    duration_s: float = 60.0,
    *,
    mallory_resume_bytes: int = 0,
    resume_max_bytes: int = 0,
    log: Path | None = None,
) -> AbuseResult:
    """A third of `duration_s` for alice alone, the rest beside mallory (whose keys-file
    `resume_max_bytes` is `mallory_resume_bytes`, when given; the server's
    `--resume-max-bytes` is `resume_max_bytes`, when given)."""
    log = log or Path(tempfile.gettempdir()) / f"firsttoken-abuse-{int(time.time())}.log"
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.toml"
        own = f"resume_max_bytes = {mallory_resume_bytes}\n" if mallory_resume_bytes else ""
        keys.write_text(KEYS + own)
        bound = ("--resume-max-bytes", str(resume_max_bytes)) if resume_max_bytes else ()
        server = Server(log, keys, *bound)
        try:
            result = AbuseResult(Phase("baseline"), Phase("abuse"))
            await _run_phase(server, result.baseline, duration_s / 3)
            seen = result.unfriendly
            kinds: list[Unfriendly] = [
                _failed_open, _huge_stream, _huge_whole, _never_opened, _bad_last_event_id,
                _big_prompt, _budget_leak,
            ]  # fmt: skip
            others = [
                *(lambda until, k=k: _loop(k, server, seen, until) for k in kinds),
                lambda until: _never_readers(server, seen, until),
                lambda until: _pipelined_readers(server, seen, until),
                lambda until: _upgraders(server, seen, until),
            ]
            await _run_phase(server, result.abuse, duration_s * 2 / 3, *others)
            metrics = await server.metrics()
            for name in (
                "firsttoken_active_streams",
                "firsttoken_readers_paused",
                "firsttoken_readers_stalled_total",
                "firsttoken_resume_buffer_bytes",
                'firsttoken_resume_buffers_dropped_total{key="alice"}',
                'firsttoken_resume_buffers_dropped_total{key="mallory"}',
                'firsttoken_streams_total{outcome="error"}',
                'firsttoken_streams_total{outcome="rejected"}',
                'firsttoken_shedding{reason="breaker"}',
            ):
                if name in metrics:
                    result.server_metrics[name] = metrics[name]
            return result
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.abuse", description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds in all (60)")
    p.add_argument(
        "--mallory-resume-bytes",
        type=int,
        default=0,
        help="the unfriendly key's resume_max_bytes in the keys file (default: none)",
    )
    p.add_argument(
        "--resume-max-bytes",
        type=int,
        default=0,
        help="the server's --resume-max-bytes (default: the server's default, 128 MiB); small "
        "enough that mallory fills it, it shows whose buffers are dropped",
    )
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = p.parse_args(argv)
    result = asyncio.run(
        abuse(
            args.duration_s,
            mallory_resume_bytes=args.mallory_resume_bytes,
            resume_max_bytes=args.resume_max_bytes,
        )
    )
    summary = result.summary()
    if args.json:
        args.json.write_text(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    print(json.dumps(summary, indent=2))
    b, a, r = result.baseline, result.abuse, result.ratios()
    m = result.server_metrics

    def dropped_of(key: str) -> float:
        return m.get('firsttoken_resume_buffers_dropped_total{key="' + key + '"}', 0.0)

    print(
        f"alice alone: {b.completion_rate:.1%} completed, TTFT p99 {b.ttft_p99_ms} ms, "
        f"peak RSS {b.peak_rss_mib:.0f} MiB\n"
        f"beside mallory: {a.completion_rate:.1%} completed, TTFT p99 {a.ttft_p99_ms} ms, "
        f"peak RSS {a.peak_rss_mib:.0f} MiB\n"
        f"ratios (abuse ÷ alone): completion {r['completion_rate']}, TTFT p99 {r['ttft_p99']}, "
        f"peak RSS {r['peak_rss']}\n"
        "resume buffers dropped: "
        + ", ".join(f"{k} {dropped_of(k):.0f}" for k in ("alice", "mallory"))
        + f" (held at the end: {m.get('firsttoken_resume_buffer_bytes', 0) / 2**20:.1f} MiB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
