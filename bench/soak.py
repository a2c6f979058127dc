"""`python -m bench.soak`: mixed traffic against a real server for a set time, watching for leaks.

Streams of many lengths, cancels, disconnects, resumes, slow readers, engine errors,
non-streaming answers and bad requests, `--concurrency` at a time, against
`firsttoken serve` on 127.0.0.1. Every stream's outcome is checked (token-exact text,
`[DONE]` or the expected error); one that is not is *lost*. Every `--interval` seconds it
prints the server's RSS, open descriptors, event-loop tasks and active streams.

It fails (exit 1) if a stream was lost, if the server's counters miss a stream, or if
anything grows without bound: RSS over the last quarter of the run above its second quarter
by more than max(10%, 16 MiB); descriptors, tasks or active streams not back to their idle
level once traffic stops.

    python -m bench.soak --duration 600 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.procs import ROOT
from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder

__all__ = ["SoakResult", "main", "soak"]

SERVER_ARGS = (
    "--synthetic-ttft-ms",
    "10",
    "--synthetic-itl-ms",
    "2",
    "--resume-grace-s",
    "2",
    "--send-timeout-s",
    "5",
    "--rate-limit-per-s",
    "0",
    "--breaker-error-rate",
    "1",  # engine errors are injected on purpose
    "--ttft-slo-ms",
    "0",
    "--heartbeat-s",
    "1",
)
LENGTHS = (1, 2, 5, 20, 60, 150, 400, 1000)
TIMEOUT = httpx.Timeout(60.0, connect=10.0)


class Lost(Exception):
    """A stream whose outcome is not what the request asked for."""


@dataclass
class Sample:
    t: float
    rss_mib: float
    fds: int
    tasks: int
    active: int
    done: int
    lost: int


@dataclass
class SoakResult:
    duration_s: float
    concurrency: int
    scenarios: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    lost_examples: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    idle_before: dict[str, float] = field(default_factory=dict)
    idle_after: dict[str, float] = field(default_factory=dict)
    server_streams: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    redis: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures


# -- one stream of each kind ------------------------------------------------------------------


def _events(decoder: EventDecoder, chunk: bytes) -> list[tuple[str | None, str]]:
    return [(e.event, e.data or "") for e in decoder.feed(chunk)]


async def _chat(client: httpx.AsyncClient, rng: random.Random, *, read: int | None = None,
                fail_after: int | None = None, slow: bool = False) -> None:  # fmt: skip
    n, seed = rng.choice(LENGTHS), rng.randrange(1 << 30)
    body: dict[str, Any] = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": f"soak {seed}"}],
        "stream": True,
        "max_tokens": n,
        "seed": seed,
    }
    if fail_after is not None:
        body["synthetic"] = {"fail_after": fail_after, "error_code": "soak_fault"}
    expected = synthetic_tokens(f"user: soak {seed}", seed, n)[0]
    got: list[str] = []
    error: str | None = None
    done = False
    decoder = EventDecoder()
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise Lost(f"chat: HTTP {resp.status_code}")
        async for chunk in resp.aiter_raw():
            for name, data in _events(decoder, chunk):
                if name == "error":
                    error = json.loads(data)["error"]["code"]
                elif data == "[DONE]":
                    done = True
                elif name is None:
                    choices = json.loads(data)["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        got.append(choices[0]["delta"]["content"])
            if read is not None and len(got) >= read:
                return  # a disconnect: leave mid-stream
            if slow:
                await asyncio.sleep(0.01)
    if fail_after is not None:
        if error != "soak_fault" or got != expected[: min(fail_after, n)] or done:
            if not (fail_after >= n and done and got == expected):
                raise Lost(f"error stream: {error} after {len(got)} tokens, done={done}")
        return
    if error is not None or not done or got != expected:
        raise Lost(f"chat: error={error} done={done} {len(got)}/{len(expected)} tokens")


def _native_tokens(body: bytes) -> tuple[list[str], str, bool, str | None]:
    decoder = EventDecoder()
    tokens, done, error = [], False, None
    for event in decoder.feed(body):
        if event.event == "error":
            error = json.loads(event.data or "")["error"]["code"]
        elif event.data == "[DONE]":
            done = True
        elif event.event is None and event.data:
            tokens.append(json.loads(event.data)["token"])
    return tokens, decoder.last_event_id, done, error


async def _create(client: httpx.AsyncClient, prompt: str, n: int) -> dict[str, Any]:
    r = await client.post("/v1/streams", json={"prompt": prompt, "max_tokens": n})
    if r.status_code != 201:
        raise Lost(f"create: HTTP {r.status_code}")
    return r.json()


async def _read_native(
    client: httpx.AsyncClient, url: str, last_id: str = "0", stop_after: int | None = None
) -> bytes:
    body = b""
    async with client.stream("GET", url, headers={"Last-Event-ID": last_id}) as resp:
        if resp.status_code == 204:
            return b""
        if resp.status_code != 200:
            raise Lost(f"events: HTTP {resp.status_code}")
        async for chunk in resp.aiter_raw():
            body += chunk
            if stop_after is not None and body.count(b'{"token":') >= stop_after:
                # Cut at the last complete event, as a reader that drops would have seen it.
                return body[: body.rfind(b"\n\n") + 2]
    return body


async def _resume(client: httpx.AsyncClient, rng: random.Random) -> None:
    n = rng.choice(LENGTHS[3:])
    prompt = f"resume {rng.randrange(1 << 30)}"
    created = await _create(client, prompt, n)
    first, last_id, done1, _ = _native_tokens(
        await _read_native(client, created["events_url"], stop_after=n // 2)
    )
    rest, _, done2, error = _native_tokens(
        await _read_native(client, created["events_url"], last_id or "0")
    )
    if (
        error is not None
        or not (done1 or done2)
        or first + rest != synthetic_tokens(prompt, None, n)[0]
    ):
        raise Lost(f"resume: {len(first)}+{len(rest)}/{n} error={error}")  # fmt: skip


async def _native(client: httpx.AsyncClient, rng: random.Random) -> None:
    n = rng.choice(LENGTHS)
    prompt = f"native {rng.randrange(1 << 30)}"
    created = await _create(client, prompt, n)
    tokens, _, done, error = _native_tokens(await _read_native(client, created["events_url"]))
    if error is not None or not done or tokens != synthetic_tokens(prompt, None, n)[0]:
        raise Lost(f"native: error={error} done={done} {len(tokens)}/{n}")


async def _cancel(client: httpx.AsyncClient, rng: random.Random) -> None:
    created = await _create(client, f"cancel {rng.randrange(1 << 30)}", 2000)
    url = created["events_url"]
    body = b""
    async with client.stream("GET", url) as resp:
        cancelled = False
        async for chunk in resp.aiter_raw():
            body += chunk
            if not cancelled and body.count(b'{"token":') >= 5:
                cancelled = True
                r = await client.post(f"/v1/streams/{created['id']}/cancel?token=" +
                                      created["resume_token"])  # fmt: skip
                if r.status_code != 200 or r.json()["outcome"] != "cancelled":
                    raise Lost(f"cancel: {r.status_code} {r.text[:100]}")
    _, _, done, error = _native_tokens(body)
    if done or error != "cancelled":
        raise Lost(f"cancel: the reader saw done={done} error={error}")


async def _plain(client: httpx.AsyncClient, rng: random.Random) -> None:
    n, seed = rng.choice(LENGTHS[:6]), rng.randrange(1 << 30)
    body = {"model": "synthetic", "prompt": "plain", "max_tokens": n, "seed": seed}
    r = await client.post("/v1/completions", json=body)
    text = "".join(synthetic_tokens("plain", seed, n)[0])
    if r.status_code != 200 or r.json()["choices"][0]["text"] != text:
        raise Lost(f"non-streaming: HTTP {r.status_code}")


async def _bad(client: httpx.AsyncClient, rng: random.Random) -> None:
    body = rng.choice([b"{", b"[]", b'{"prompt": 5}', b'{"messages": []}', b"\xff"])
    r = await client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    if r.status_code != 400:
        raise Lost(f"bad request answered {r.status_code}")


Scenario = Callable[[httpx.AsyncClient, random.Random], Awaitable[None]]
SCENARIOS: dict[str, tuple[int, Scenario]] = {
    "complete": (30, lambda c, r: _chat(c, r)),
    "native": (15, _native),
    "resume": (10, _resume),
    "cancel": (8, _cancel),
    "disconnect": (12, lambda c, r: _chat(c, r, read=r.randint(1, 5))),
    "slow_reader": (5, lambda c, r: _chat(c, r, slow=True)),
    "engine_error": (8, lambda c, r: _chat(c, r, fail_after=r.randint(0, 30))),
    "non_streaming": (7, _plain),
    "bad_request": (5, _bad),
}


# -- the run ------------------------------------------------------------------------------------


class Server:
    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        with log.open("wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "firsttoken", "serve", "--port", "0", *SERVER_ARGS, *args],
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
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

    async def metrics(self, client: httpx.AsyncClient) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in (await client.get("/metrics")).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _idle(server: Server, client: httpx.AsyncClient) -> dict[str, float]:
    m = await server.metrics(client)
    return {
        "rss_mib": round(server.ps.memory_info().rss / 2**20, 1),
        "fds": server.ps.num_fds(),
        "tasks": m.get("firsttoken_event_loop_tasks", 0),
        "active": m.get("firsttoken_active_streams", 0),
    }


async def soak(
    duration_s: float,
    concurrency: int,
    interval_s: float,
    *,
    seed: int = 1,
    resume_ttl_s: float = 10.0,
    redis: str | None = None,
    log: Path | None = None,
) -> SoakResult:
    """Run the traffic; `resume_ttl_s` short enough that finished streams leave memory well
    within the run (the RSS comparison starts after the first quarter)."""
    log = log or Path("/tmp") / f"firsttoken-soak-{int(time.time())}.log"
    extra = ("--redis", redis) if redis else ()
    server = Server(log, "--resume-ttl-s", str(resume_ttl_s), *extra)
    result = SoakResult(duration_s, concurrency, redis=bool(redis))
    counts: Counter[str] = Counter()
    names = list(SCENARIOS)
    weights = [SCENARIOS[n][0] for n in names]
    limits = httpx.Limits(max_connections=concurrency * 3, max_keepalive_connections=concurrency)
    try:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits) as client,
            httpx.AsyncClient(base_url=server.url, timeout=10) as probe,
        ):
            result.idle_before = await _idle(server, probe)
            start = time.monotonic()
            deadline = start + duration_s

            async def worker(i: int) -> None:
                rng = random.Random(seed * 1000 + i)
                while time.monotonic() < deadline:
                    name = rng.choices(names, weights)[0]
                    try:
                        await SCENARIOS[name][1](client, rng)
                    except (Lost, httpx.HTTPError, ValueError, KeyError) as exc:
                        result.lost += 1
                        if len(result.lost_examples) < 10:
                            result.lost_examples.append(f"{name}: {type(exc).__name__}: {exc}")
                    counts[name] += 1

            async def sampler() -> None:
                while time.monotonic() < deadline:
                    await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
                    m = await server.metrics(probe)
                    sample = Sample(
                        t=round(time.monotonic() - start, 1),
                        rss_mib=round(server.ps.memory_info().rss / 2**20, 1),
                        fds=server.ps.num_fds(),
                        tasks=int(m.get("firsttoken_event_loop_tasks", 0)),
                        active=int(m.get("firsttoken_active_streams", 0)),
                        done=sum(counts.values()),
                        lost=result.lost,
                    )
                    result.samples.append(sample)
                    print(
                        f"t={sample.t:7.1f}s rss={sample.rss_mib:7.1f} MiB fds={sample.fds:4d} "
                        f"tasks={sample.tasks:4d} active={sample.active:3d} "
                        f"streams={sample.done:6d} lost={sample.lost}",
                        flush=True,
                    )

            await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
            # Traffic stopped: grace windows and resume TTLs run out, then it must be idle.
            settle = time.monotonic() + 30
            while True:
                await asyncio.sleep(1)
                result.idle_after = await _idle(server, probe)
                if result.idle_after["active"] == 0 and (
                    result.idle_after["fds"] <= result.idle_before["fds"] + 2
                    and result.idle_after["tasks"] <= result.idle_before["tasks"] + 2
                ):
                    break
                if time.monotonic() > settle:
                    break
            m = await server.metrics(probe)
            result.server_streams = {
                k.split('"')[1]: v
                for k, v in m.items()
                if k.startswith("firsttoken_streams_total{")
            }
    finally:
        server.stop()
    result.scenarios = dict(counts)
    if server.proc.returncode not in (0, -15):
        result.failures.append(f"the server exited with {server.proc.returncode}")
    _judge(result)
    return result


def _judge(result: SoakResult) -> None:
    if result.lost:
        result.failures.append(f"{result.lost} streams lost: {result.lost_examples[:3]}")
    before, after = result.idle_before, result.idle_after
    samples = result.samples
    for key in ("fds", "tasks"):
        # Back to idle; with Redis, its client keeps the connections the peak needed (a pool
        # as large as the most concurrent commands, not growing past it).
        allowed = before.get(key, 0) + 2
        if result.redis and samples:
            allowed = max(allowed, max(getattr(s, key) for s in samples))
        if after.get(key, 0) > allowed:
            result.failures.append(f"{key} did not return to idle: {before[key]} -> {after[key]}")
    if after.get("active", 0) != 0:
        result.failures.append(f"{after['active']} streams still active after the traffic")
    # Every stream the server started is accounted for by an outcome.
    started = sum(v for k, v in result.server_streams.items() if k != "rejected")
    streaming = sum(n for k, n in result.scenarios.items() if k != "bad_request")
    if started < streaming:
        result.failures.append(f"the server counted {started} streams of {streaming} started")
    if len(samples) >= 8:
        q = len(samples) // 4
        mid = max(s.rss_mib for s in samples[q : 2 * q])
        late = max(s.rss_mib for s in samples[-q:])
        if late - mid > max(0.10 * mid, 16.0):
            result.failures.append(f"RSS grew {mid} -> {late} MiB over the second half")
        for key in ("fds", "tasks"):
            mid_n = max(getattr(s, key) for s in samples[q : 2 * q])
            late_n = max(getattr(s, key) for s in samples[-q:])
            if late_n > mid_n + 5:
                result.failures.append(f"{key} grew {mid_n} -> {late_n} under steady load")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (600)")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once (8)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples (10)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--resume-ttl-s", type=float, default=10.0, help="the server's resume TTL (10)")
    p.add_argument("--redis", default=None, help="run the server with --redis URL")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = p.parse_args(argv)
    result = asyncio.run(
        soak(
            args.duration,
            args.concurrency,
            args.interval,
            seed=args.seed,
            resume_ttl_s=args.resume_ttl_s,
            redis=args.redis,
        )
    )
    summary = {**asdict(result), "ok": result.ok}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=2))
    print("soak: " + ("ok" if result.ok else "FAILED: " + "; ".join(result.failures)))
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
