"""Background Responses resumed the OpenAI SDK's way: many at once, each dropped and read on
with `starting_after`; what the resume adds to the time to the first event, and what a stored
response costs.

    .venv/bin/python -m bench.responses [--streams N] [--tokens T] [--drop-after K]

Per mode, `memory` (one server) and `redis` (two servers on one redis-server, each response
resumed through the instance that did not make it): `--streams` streamed background Responses
(`stream: true, background: true`) are POSTed at once; each connection is dropped after
`--drop-after` events, and after `--pause-s` (the answer goes on: a backlog to replay) read on
with `GET /v1/responses/{id}?stream=true&starting_after=<the last sequence_number read>`.

Figures: the live stream's time to its first event (POST sent → first event), the resume's
(GET sent → first event), p50 and p99, and the resume's added p50/p99 over the live's; lost or
duplicated events (each response's sequence numbers, both connections, must be 0..last once
each, and the bytes equal the whole log replayed from its start afterwards); bytes per stored
response: the server's RSS growth over the run ÷ N (memory), and Redis's `MEMORY USAGE` of
each response's keys (redis).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.procs import RedisProcess, ServerProcess, raise_fd_limit
from bench.servers import OPEN, ServerSpec

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
SEQ = re.compile(rb'"sequence_number":(\d+)')


def _log(msg: str) -> None:
    print(f"[responses {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class One:
    """One response: what its first connection read, and its resume."""

    id: str = ""
    live_ttfe_s: float | None = None
    first: list[bytes] = field(default_factory=list)
    resume_ttfe_s: float | None = None
    rest: list[bytes] = field(default_factory=list)
    error: str | None = None


def _events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The whole events in `buffer` (each with its blank line), and what is left."""
    *whole, left = buffer.split(b"\n\n")
    return [e + b"\n\n" for e in whole if e.strip()], left


async def _first_leg(
    http: httpx.AsyncClient, base: str, one: One, body: dict[str, Any], k: int
) -> None:
    started = time.perf_counter()
    buffer = b""
    async with http.stream("POST", base + "/responses", json=body) as answer:
        if answer.status_code != 200:
            one.error = f"POST {answer.status_code}"
            return
        one.id = "resp_" + answer.headers["x-stream-id"]
        async for chunk in answer.aiter_raw():
            buffer += chunk
            events, buffer = _events(buffer)
            if events and one.live_ttfe_s is None:
                one.live_ttfe_s = time.perf_counter() - started
            one.first.extend(events)
            if len(one.first) >= k:
                one.first = one.first[:k]
                break  # the connection drops here; the answer goes on


async def _resume(http: httpx.AsyncClient, base: str, one: One) -> None:
    match = SEQ.search(one.first[-1]) if one.first else None
    if match is None:
        one.error = one.error or "no event read before the drop"
        return
    after = int(match.group(1))
    started = time.perf_counter()
    buffer = b""
    url = f"{base}/responses/{one.id}"
    async with http.stream("GET", url, params={"stream": "true", "starting_after": after}) as got:
        if got.status_code != 200:
            one.error = f"resume {got.status_code}: {(await got.aread())[:200]!r}"
            return
        async for chunk in got.aiter_raw():
            buffer += chunk
            events, buffer = _events(buffer)
            if events and one.resume_ttfe_s is None:
                one.resume_ttfe_s = time.perf_counter() - started
            one.rest.extend(events)


async def _whole_log(http: httpx.AsyncClient, base: str, one: One) -> list[bytes]:
    got = await http.get(f"{base}/responses/{one.id}", params={"stream": "true"})
    return _events(got.content + b"\n\n")[0] if got.status_code == 200 else []


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


async def _run_mode(
    args: argparse.Namespace, make: ServerProcess, read: ServerProcess
) -> dict[str, Any]:
    body = {
        "model": "synthetic",
        "input": "What outlives its connection?",
        "stream": True,
        "background": True,
        "synthetic": {"answer_tokens": args.tokens, "itl_ms": args.itl_ms},
    }
    limits = httpx.Limits(max_connections=args.streams * 2 + 10, max_keepalive_connections=0)
    timeout = httpx.Timeout(60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        ones = [One() for _ in range(args.streams)]
        await asyncio.gather(
            *(
                _first_leg(http, make.url + "/v1", one, body | {"seed": n}, args.drop_after)
                for n, one in enumerate(ones)
            )
        )
        await asyncio.sleep(args.pause_s)
        await asyncio.gather(*(_resume(http, read.url + "/v1", one) for one in ones))
        lost = duplicated = unequal = 0
        for one in ones:
            if one.error:
                continue
            seqs = [int(m.group(1)) for e in one.first + one.rest if (m := SEQ.search(e))]
            expected = set(range(max(seqs) + 1)) if seqs else set()
            lost += len(expected - set(seqs))
            duplicated += len(seqs) - len(set(seqs))
            whole = await _whole_log(http, read.url + "/v1", one)
            unequal += int(b"".join(whole) != b"".join(one.first + one.rest))
    live = [o.live_ttfe_s for o in ones if o.live_ttfe_s is not None]
    resumed = [o.resume_ttfe_s for o in ones if o.resume_ttfe_s is not None]
    errors = [o.error for o in ones if o.error]
    result: dict[str, Any] = {
        "streams": args.streams,
        "completed": sum(
            1 for o in ones if not o.error and o.rest and b"response.completed" in o.rest[-1]
        ),
        "errors": errors[:5],
        "error_count": len(errors),
        "live_ttfe_ms": {"p50": _pct(live, 50), "p99": _pct(live, 99)},
        "resume_ttfe_ms": {"p50": _pct(resumed, 50), "p99": _pct(resumed, 99)},
        "lost_events": lost,
        "duplicated_events": duplicated,
        "not_byte_exact": unequal,
        "ids": [o.id for o in ones if o.id],
    }
    for q in ("p50", "p99"):
        a, b = result["resume_ttfe_ms"][q], result["live_ttfe_ms"][q]
        result.setdefault("resume_added_ms", {})[q] = None if a is None or b is None else a - b
    return result


def _spec(name: str, redis_url: str | None, more: str = "") -> ServerSpec:
    extra: tuple[str, ...] = (*OPEN, "--responses-ttl-s", "120", *more.split())
    if redis_url is not None:
        extra += ("--redis", redis_url)
    return ServerSpec(name, name, "firsttoken", has_metrics=True, extra=extra)


def _launch(spec: ServerSpec, out: Path, ttft_ms: float, itl_ms: float) -> ServerProcess:
    server = ServerProcess.launch(
        spec, out / f"{spec.name}.log", ttft_ms=ttft_ms, itl_ms=itl_ms, heartbeat_s=15
    )
    server.wait_ready()
    return server


def _redis_bytes(url: str, ids: list[str]) -> float | None:
    """Redis's `MEMORY USAGE` of every key of the responses, ÷ their number."""
    import redis

    client = redis.Redis.from_url(url)
    total = 0
    for response_id in ids:
        stream_id = response_id.removeprefix("resp_")
        for key in client.scan_iter(match=f"*{stream_id}*", count=1000):
            total += client.memory_usage(key) or 0
    client.close()
    return total / len(ids) if ids else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    raise_fd_limit(args.streams * 4 + 256)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if "memory" in args.modes:
        server = _launch(_spec("memory", None, args.server_args), out, args.ttft_ms, args.itl_ms)
        try:
            before = server.rss_bytes()
            result = asyncio.run(_run_mode(args, server, server))
            result["bytes_per_response_rss"] = (server.rss_bytes() - before) / args.streams
        finally:
            server.stop()
        result.pop("ids")
        report["memory"] = result
        _log(json.dumps(result))
    if "redis" in args.modes:
        store = RedisProcess.start(out / "redis.log")
        try:
            a = _launch(
                _spec("redis-a", store.url, args.server_args), out, args.ttft_ms, args.itl_ms
            )
            b = _launch(
                _spec("redis-b", store.url, args.server_args), out, args.ttft_ms, args.itl_ms
            )
            try:
                result = asyncio.run(_run_mode(args, a, b))  # made on a, resumed through b
                result["bytes_per_response_redis"] = _redis_bytes(store.url, result.pop("ids"))
            finally:
                a.stop()
                b.stop()
        finally:
            store.stop()
        report["redis"] = result
        _log(json.dumps(result))
    (out / "responses.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.responses", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=60, help="each answer's tokens")
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--drop-after", type=int, default=10, help="events read before the drop")
    parser.add_argument("--pause-s", type=float, default=0.3, help="from the drops to the resumes")
    parser.add_argument("--modes", default="memory,redis")
    parser.add_argument("--server-args", default="", help="more `serve` options, one string")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.modes = tuple(args.modes.split(","))
    report = run(args)
    bad = sum(
        report[m]["lost_events"]
        + report[m]["duplicated_events"]
        + report[m]["not_byte_exact"]
        + report[m]["error_count"]
        for m in args.modes
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
