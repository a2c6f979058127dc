"""A bad production day, measured: every deployed part under load, one fault every
`--fault-every-s`, and each answer compared with what an undisturbed deployment says.

    .venv/bin/python -m bench.production_day                         # 10 min, 60 streams
    .venv/bin/python -m bench.production_day --minutes 3 --streams 60 --json /tmp/day.json
    .venv/bin/python -m bench.production_day --faults instance_term   # one kind only

What runs, all on loopback: one redis-server; two synthetic upstreams (`firsttoken serve`,
`--synthetic-ttft-ms`/`--synthetic-itl-ms`) as the two targets of one route (kind openai,
`continuation = "vllm"`: a cut answer is spliced onto the other); three instances with
`--redis --durable --routes --api-keys --usage-db` (a SQLite ledger each: SQLite takes one
writer) behind nginx (deploy/nginx-multi.conf, ports substituted as tests/nginx.py does). The
keys file holds two normal keys and one abusive key; the route has prices.

The normal keys' `--streams` clients stream at once for `--minutes`, each one request after
another, in four formats in turn: Chat Completions and Responses through the official `openai`
SDK, Messages through the official `anthropic` SDK, and native streams through
`firsttoken.client.AsyncClient` (which resumes with Last-Event-ID). The abusive key's
`--abusers` clients beside them open streams and drop them after a few chunks, create native
streams they never read, and burst past their `max_streams`.

Every `--fault-every-s` one fault, in turn (`--faults`): `instance_kill` (SIGKILL the busiest
instance, start it again on its port), `upstream_kill` (SIGKILL an upstream, start it again),
`instance_term` (SIGTERM an instance, start it again once it exited: a rolling deploy's
step), `reload` (SIGHUP every instance after the keys file changed: the abusive key's limit
and a spare key), `redis_restart` (redis-server stopped and started on its port; no
persistence, so it comes back empty).

The reference: before the load and the first fault, the same deployment, undisturbed,
answers every distinct request (`--variants` prompts per format, each its own max_tokens) once,
each in its own format; the synthetic engine is deterministic, so an undisturbed answer is the
answer. Each normal stream ends as one of:
  exact    its terminal event arrived (chat: a finish_reason; Responses: response.completed or
           response.incomplete; Messages: message_stop; native: [DONE]) and its text is the
           reference's, byte for byte;
  wrong    the terminal event arrived with other text;
  error    the SDK or the client raised (counted by exception type, and code where there is
           one): the client was told;
  short    the stream ended with neither a terminal event nor an exception: the client was
           not told (must be 0);
  hung     no event for `--hang-s` (the bench cancels it).
TTFT is request sent → first text; a gap is the time between two text events of one stream.
Each is counted in the window of the fault whose `--after-fault-s` it ended in, or `outside`.
The ledger's completion tokens are compared per stream with the tokens the client received
(the reference's tokens its text holds), and the instances' logs are read for tracebacks and
error lines, and their RSS sampled every second.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import multiprocessing
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, AsyncExitStack, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import httpx
import numpy as np
import openai
import psutil

from bench.procs import check_out
from bench.servers import ServerSpec
from firsttoken.client import AsyncClient, StreamError
from tests.nginx import MULTI_CONF, run_nginx
from tests.redis_server import RedisServer
from tests.servers import ROOT, Server, run_server

T = TypeVar("T")
FORMATS = ("chat", "responses", "messages", "native")
FAULT_KINDS = ("instance_kill", "upstream_kill", "instance_term", "reload", "redis_restart")
ENDINGS = ("exact", "wrong", "error", "short", "hung")
MODEL = "day"
KEYS = {"alice": "sk-alice-day", "bob": "sk-bob-day"}
ABUSER = ("mallory", "sk-mallory-day")
# Load the bench makes on purpose (every client is 127.0.0.1 through nginx): no per-address
# rate limit, no shedding on TTFT. The abusive key meets its own limits from the keys file.
OPEN = ("--rate-limit-per-s", "0", "--ttft-slo-ms", "0")
PRICE = "{ prompt = 0.5, completion = 1.5 }"


@dataclass
class Options:
    minutes: float = 10.0
    streams: int = 60  # the normal keys' streams at once
    fault_every_s: float = 30.0
    faults: tuple[str, ...] = FAULT_KINDS
    seed: int = 49
    ttft_ms: float = 50.0
    itl_ms: float = 20.0
    tokens_min: int = 40
    tokens_max: int = 160
    variants: int = 12  # distinct requests per format (each answered once by the reference)
    abusers: int = 4
    client_procs: int = 4  # processes the normal clients are spread over (0: this one)
    hang_s: float = 30.0
    after_fault_s: float = 10.0
    first_fault_s: float = 0.0  # 0: one interval after the load starts
    rev: str = ""  # run the instances and upstreams on firsttoken as of this commit


# -- the deployment --------------------------------------------------------------------------------


def routes_toml(urls: dict[str, str]) -> str:
    out = ['currency = "USD"']
    for name, url in urls.items():
        out += [
            f"[targets.{name}]",
            'kind = "openai"',
            f'url = "{url}/v1"',
            'model = "synthetic"',
            'continuation = "vllm"',
            "connect_timeout_s = 1",
            "first_token_timeout_s = 2",
            "idle_timeout_s = 2",
            f"price = {PRICE}",
        ]
    out += [f"[models.{MODEL}]", "targets = [" + ", ".join(f'"{n}"' for n in urls) + "]"]
    out += ["max_splices = 3", 'balance = "least_busy"']
    return "\n".join(out) + "\n"


def keys_toml(generation: int) -> str:
    """The keys file; each reload changes the abusive key's limit and adds or drops a spare."""
    out = [f'[[keys]]\nname = "{n}"\nkey = "{k}"\nmax_streams = 1000\n' for n, k in KEYS.items()]
    out.append(
        f'[[keys]]\nname = "{ABUSER[0]}"\nkey = "{ABUSER[1]}"\n'
        f"max_streams = {4 + generation % 2}\nrequests_per_minute = 600\n"
    )
    if generation % 2:
        out.append('[[keys]]\nname = "spare"\nkey = "sk-spare-day"\nmax_streams = 1\n')
    return "\n".join(out)


@dataclass
class Slot:
    """One process of the deployment and every run of it (a restart is a new run)."""

    name: str
    args: list[str]
    cwd: Path = ROOT  # another build's folder with --rev
    runs: list[Server] = field(default_factory=list)
    port: int = 0
    rss_peak: int = 0

    @property
    def now(self) -> Server:
        return self.runs[-1]

    def start(self, stack: ExitStack) -> Server:
        extra = ["--port", str(self.port)] if self.port else []
        return self.started(stack.enter_context(self.run(*extra)))

    def run(self, *extra: str) -> AbstractContextManager[Server]:
        return run_server(*self.args, *extra, cwd=self.cwd, timeout=60)

    def started(self, server: Server) -> Server:
        self.port = server.port
        self.runs.append(server)
        return server

    def alive(self) -> bool:
        return bool(self.runs) and self.now.proc.poll() is None

    def sample_rss(self) -> None:
        if not self.alive():
            return
        try:
            self.rss_peak = max(self.rss_peak, psutil.Process(self.now.proc.pid).memory_info().rss)
        except psutil.Error:
            pass

    def log_lines(self) -> Iterator[str]:
        for run in self.runs:
            yield from list(run.log)


@dataclass
class Deployment:
    redis: RedisServer
    upstreams: list[Slot]
    instances: list[Slot]
    url: str  # nginx's
    keys_file: Path
    dbs: list[str]
    stack: ExitStack


def enter_together(stack: ExitStack, cms: Sequence[AbstractContextManager[T]]) -> list[T]:
    """Enter the context managers at once, each in a thread (a server's start waits for its
    `listening` line: started one after another on a busy machine, the set takes long)."""
    with ThreadPoolExecutor(max_workers=len(cms)) as pool:
        futures = [pool.submit(cm.__enter__) for cm in cms]
        wait(futures)
    for cm, f in zip(cms, futures, strict=True):
        if f.exception() is None:
            stack.push(cm)
    for f in futures:
        if (exc := f.exception()) is not None:
            raise exc
    return [f.result() for f in futures]


def other_build(rev: str, tmp: Path) -> Path:
    """A folder holding `firsttoken/` as of `rev` (`git archive`): the servers started there
    run it (the cwd comes first on their sys.path); the clients stay this tree's."""
    spec = check_out(ServerSpec(rev, rev, "firsttoken", True, rev=rev), tmp)
    assert spec.cwd is not None
    return spec.cwd


@contextmanager
def deployment(opts: Options, log: Callable[[str], None]) -> Iterator[Deployment]:
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        redis = RedisServer(str(tmp))
        redis.start()
        stack.callback(redis.stop)
        pace = ["--synthetic-ttft-ms", str(opts.ttft_ms), "--synthetic-itl-ms", str(opts.itl_ms)]
        cwd = other_build(opts.rev, tmp) if opts.rev else ROOT
        upstreams = [Slot(f"upstream {n}", [*pace, *OPEN], cwd) for n in ("a", "b")]
        servers = [u.run() for u in upstreams]
        for slot, server in zip(upstreams, enter_together(stack, servers), strict=True):
            slot.started(server)
        routes = tmp / "routes.toml"
        routes.write_text(routes_toml({"a": upstreams[0].now.url, "b": upstreams[1].now.url}))
        keys = tmp / "keys.toml"
        keys.write_text(keys_toml(0))
        common = ["--redis", redis.url, "--durable", "--routes", str(routes)]
        common += ["--api-keys", str(keys), *OPEN]
        dbs = [f"sqlite:///{tmp}/usage-{i}.db" for i in range(3)]
        instances = [
            Slot(f"instance {i}", [*common, "--usage-db", db], cwd) for i, db in enumerate(dbs)
        ]
        servers = [slot.run() for slot in instances]
        for slot, server in zip(instances, enter_together(stack, servers), strict=True):
            slot.started(server)
        ng = stack.enter_context(
            run_nginx([s.port for s in instances], tmp / "nginx", base=MULTI_CONF)
        )
        log(
            f"redis :{redis.port}; upstreams {[s.port for s in upstreams]}; instances "
            f"{[s.port for s in instances]}; nginx {ng.url}"
        )
        yield Deployment(redis, upstreams, instances, ng.url, keys, dbs, stack)


# -- one stream, in each format --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    fmt: str
    variant: int
    max_tokens: int

    @property
    def prompt(self) -> str:
        return f"A bad production day, {self.fmt} question {self.variant}: what happened?"


@dataclass
class Reading:
    """One stream as its client saw it."""

    ask: Ask
    key: str
    sent: float = 0.0
    text: str = ""
    chunks: int = 0
    terminal: bool = False
    error: str = ""  # the exception's type (and code), when the client raised
    hung: bool = False
    stream_id: str = ""
    usage_tokens: int | None = None  # completion tokens the client was told
    ttft_s: float | None = None
    first_at: float = 0.0
    last_at: float = 0.0
    longest_gap_s: float = 0.0
    longest_gap_at: float = 0.0
    progress: float = 0.0  # the last time anything arrived (the hang watchdog reads it)
    reconnects: int = 0
    ending: str = ""
    pieces: list[str] | None = None  # each text event's text (kept for the references only)

    def got(self, piece: str, gaps: Callable[[float, float], None] | None) -> None:
        now = time.monotonic()
        self.progress = now
        if not piece:
            return
        if self.chunks == 0:
            self.ttft_s, self.first_at = now - self.sent, now
        else:
            gap = now - self.last_at
            if gaps is not None:
                gaps(gap, now)
            if gap > self.longest_gap_s:
                self.longest_gap_s, self.longest_gap_at = gap, now
        self.last_at = now
        self.chunks += 1
        self.text += piece
        if self.pieces is not None:
            self.pieces.append(piece)


def error_name(exc: BaseException) -> str:
    kind = type(exc)
    name = f"{kind.__module__.split('.')[0]}.{kind.__name__}"
    if isinstance(exc, openai.APIStatusError | anthropic.APIStatusError):
        return f"{name} {exc.status_code}"
    if isinstance(exc, StreamError):
        return f"{name} {exc.code}"
    return name


@dataclass
class Clients:
    openai: dict[str, openai.AsyncOpenAI]
    anthropic: dict[str, anthropic.AsyncAnthropic]
    native: dict[str, AsyncClient]

    @classmethod
    async def open(cls, base: str, keys: dict[str, str], stack: Any) -> Clients:
        timeout = 120.0  # the SDKs take a number (openai wraps httpx2, not httpx)
        oa = {
            n: openai.AsyncOpenAI(base_url=base + "/v1", api_key=k, timeout=timeout)
            for n, k in keys.items()
        }
        an = {
            n: anthropic.AsyncAnthropic(base_url=base, api_key=k, timeout=timeout)
            for n, k in keys.items()
        }
        na = {
            n: AsyncClient(base, api_key=k, timeout_s=120, max_retries=8) for n, k in keys.items()
        }
        for c in na.values():
            await stack.enter_async_context(c)
        return cls(oa, an, na)

    async def close(self) -> None:
        for o in self.openai.values():
            await o.close()
        for a in self.anthropic.values():
            await a.close()


async def read_stream(
    clients: Clients, r: Reading, gaps: Callable[[float, float], None] | None = None
) -> None:
    """Read one stream to its end; every ending is recorded on `r`, nothing raises."""
    ask, key = r.ask, r.key
    r.sent = r.progress = time.monotonic()
    try:
        if ask.fmt == "chat":
            raw = await clients.openai[key].chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": ask.prompt}],
                max_tokens=ask.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
            )
            r.stream_id = raw.headers.get("x-stream-id", "")
            async with raw.parse() as chat:
                async for chunk in chat:
                    piece = ""
                    for choice in chunk.choices:
                        piece += choice.delta.content or ""
                        r.terminal |= choice.finish_reason is not None
                    if chunk.usage is not None:
                        r.usage_tokens = chunk.usage.completion_tokens
                    r.got(piece, gaps)
        elif ask.fmt == "responses":
            resp = await clients.openai[key].responses.with_raw_response.create(
                model=MODEL, input=ask.prompt, max_output_tokens=ask.max_tokens, stream=True
            )
            r.stream_id = resp.headers.get("x-stream-id", "")
            async with resp.parse() as events:
                async for ev in events:
                    if ev.type == "response.output_text.delta":
                        r.got(ev.delta, gaps)
                        continue
                    if ev.type in ("response.completed", "response.incomplete"):
                        r.terminal = True
                        if ev.response.usage is not None:
                            r.usage_tokens = ev.response.usage.output_tokens
                    r.got("", gaps)
        elif ask.fmt == "messages":
            msgs = await clients.anthropic[key].messages.with_raw_response.create(
                model=MODEL,
                max_tokens=ask.max_tokens,
                messages=[{"role": "user", "content": ask.prompt}],
                stream=True,
            )
            r.stream_id = msgs.headers.get("x-stream-id", "")
            async with await msgs.parse() as messages:
                async for mev in messages:
                    if mev.type == "content_block_delta" and mev.delta.type == "text_delta":
                        r.got(mev.delta.text, gaps)
                        continue
                    if mev.type == "message_delta":
                        r.usage_tokens = mev.usage.output_tokens
                    r.terminal |= mev.type == "message_stop"
                    r.got("", gaps)
        else:
            answer = await clients.native[key].stream(
                ask.prompt, model=MODEL, max_tokens=ask.max_tokens
            )
            r.stream_id = answer.stream_id or ""
            try:
                async for delta in answer:
                    r.got(delta, gaps)
            finally:
                r.reconnects = answer.reconnects
                r.terminal = bool(answer.state.done)
                usage = answer.state.usage
                if isinstance(usage, dict) and "completion_tokens" in usage:
                    r.usage_tokens = usage["completion_tokens"]
    except asyncio.CancelledError:
        if not r.hung:
            raise
    except Exception as exc:  # what the SDK raised is the ending, counted by its type
        r.error = error_name(exc)


def judge(r: Reading, reference: str) -> str:
    if r.hung:
        return "hung"
    if r.error:
        return "error"
    if not r.terminal:
        return "short"
    return "exact" if r.text == reference else "wrong"


class SdkRetries(logging.Handler):
    """The retries the official SDKs made on their own (their debug and info log lines): a
    retried request's TTFT includes the SDK's wait, Retry-After included."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: Counter[str] = Counter()
        self.loggers = [logging.getLogger(n) for n in ("openai", "anthropic")]

    def emit(self, record: logging.LogRecord) -> None:
        sdk = record.name.split(".")[0]
        msg = str(record.msg)
        if msg.startswith("Retrying due to status code"):
            self.counts[f"{sdk}: status {record.args[0]}"] += 1  # type: ignore[index]
        elif msg.startswith("Retrying request"):  # "… in %f seconds" or "… to %s in %f …"
            wait = next((a for a in record.args or () if isinstance(a, float)), 0.0)  # type: ignore[union-attr]
            self.counts[f"{sdk}: waited {wait:.1f} s"] += 1

    def __enter__(self) -> SdkRetries:
        for lg in self.loggers:
            lg.addHandler(self)
            lg.setLevel(logging.DEBUG)
            lg.propagate = False
        return self

    def __exit__(self, *exc: object) -> None:
        for lg in self.loggers:
            lg.removeHandler(self)


# -- the load --------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    at_s: float  # since the load began
    what: str
    took_s: float = 0.0  # until the part was back (or the reload sent)


class Windows:
    """Which fault's after-window a moment falls in (`outside` when none)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.marks: list[tuple[float, str]] = []

    def of(self, start: float, end: float | None = None) -> str:
        """The fault a wait from `start` to `end` is counted after: the last one before its
        start if the start is in its window, else the first one during the wait."""
        end = start if end is None else end
        found = "outside"
        for at, kind in reversed(self.marks):
            if at <= start:
                return kind if start <= at + self.after_s else found
            if at <= end:
                found = kind
        return found

    def file(self, gaps: np.ndarray, ends: np.ndarray) -> dict[str, np.ndarray]:
        """`of` for many waits at once: each gap (ending at `ends`) under its window."""
        if not self.marks:
            return {"outside": gaps}
        at = np.asarray([a for a, _ in self.marks])
        starts = ends - gaps
        last = np.searchsorted(at, starts, side="right") - 1  # the last fault before the start
        nxt = last + 1  # the first after it
        in_last = (last >= 0) & (starts <= at[np.maximum(last, 0)] + self.after_s)
        in_next = (nxt < len(at)) & (at[np.minimum(nxt, len(at) - 1)] <= ends)
        label = np.full(len(gaps), -1)
        label[in_next] = nxt[in_next]
        label[in_last] = last[in_last]
        out = {"outside": gaps[label == -1]}
        for kind in dict.fromkeys(k for _, k in self.marks):
            which = [i for i, (_, k) in enumerate(self.marks) if k == kind]
            out[kind] = gaps[np.isin(label, which)]
        return out


async def references(
    clients: Clients, asks: list[Ask], log: Callable[[str], None]
) -> dict[Ask, Reading]:
    out: dict[Ask, Reading] = {}
    todo = list(asks)

    async def worker() -> None:
        while todo:
            ask = todo.pop()
            for _attempt in range(3):
                r = Reading(ask, "alice", pieces=[])
                await read_stream(clients, r)
                if r.terminal and not r.error:
                    out[ask] = r
                    break
            else:
                raise RuntimeError(f"the reference did not answer {ask}: {r.error or 'short'}")

    await asyncio.gather(*(worker() for _ in asks))
    tokens = sum(1 for r in out.values() if r.usage_tokens == r.chunks)
    log(f"{len(out)} references; {tokens} of them one text event per token")
    return out


def delivered_tokens(text: str, reference: Reading) -> int | None:
    """How many of the reference's tokens `text` holds (None: not a prefix of it, or the
    reference's events are not one token each)."""
    pieces = reference.pieces or []
    if reference.usage_tokens != len(pieces) or not reference.text.startswith(text):
        return None
    n = length = 0
    for piece in pieces:
        if length + len(piece) > len(text):
            break
        length += len(piece)
        n += 1
    return n


@dataclass
class Share:
    """One client process's part of the normal load (`ids`: which of the `--streams` clients),
    and what it saw: its readings, every text gap as (gap, end) pairs, its loop's lag, the
    SDKs' retries."""

    url: str
    asks: dict[str, list[Ask]]
    ids: list[int]
    opts: Options
    end: float
    readings: list[Reading] = field(default_factory=list)
    gaps: array[float] = field(default_factory=lambda: array("d"))
    lags: list[float] = field(default_factory=list)
    retries: Counter[str] = field(default_factory=Counter)

    def gap(self, gap: float, t: float) -> None:
        self.gaps.append(gap)
        self.gaps.append(t)


async def run_share(share: Share) -> Share:
    active: dict[int, tuple[Reading, asyncio.Task[None]]] = {}

    async def client(clients: Clients, i: int) -> None:
        fmt, key = FORMATS[i % len(FORMATS)], list(KEYS)[(i // len(FORMATS)) % len(KEYS)]
        rng = random.Random(share.opts.seed * 1000 + i)
        await asyncio.sleep(i * 0.02)  # not all at the same instant
        while time.monotonic() < share.end:
            r = Reading(rng.choice(share.asks[fmt]), key)
            r.sent = r.progress = time.monotonic()  # the watchdog may look before it starts
            share.readings.append(r)
            task = asyncio.create_task(read_stream(clients, r, share.gap))
            active[id(r)] = (r, task)
            try:
                await task
            finally:
                active.pop(id(r), None)
            if r.error and not r.stream_id:  # refused (a 503 while draining): as a user would,
                await asyncio.sleep(1.0)  # wait a little before asking again

    async def watchdog() -> None:
        """Cancel a stream that saw nothing for `hang_s`: it is counted hung. And how late
        this process's loop runs a timer (the clients' own saturation)."""
        while True:
            due = time.monotonic() + 0.5
            await asyncio.sleep(0.5)
            now = time.monotonic()
            share.lags.append(max(0.0, now - due))
            for r, task in list(active.values()):
                if now - r.progress > share.opts.hang_s and not r.hung:
                    r.hung = True
                    task.cancel()

    opts = share.opts
    async with AsyncExitStack() as astack:
        clients = await Clients.open(share.url, KEYS, astack)
        with SdkRetries() as retries:
            dog = asyncio.create_task(watchdog())
            tasks = [asyncio.create_task(client(clients, i)) for i in share.ids]
            longest = (opts.ttft_ms + opts.tokens_max * opts.itl_ms) / 1000
            left = max(0.0, share.end - time.monotonic())
            await asyncio.wait(tasks, timeout=left + longest + opts.hang_s + 30)
            for t in [*tasks, dog]:
                t.cancel()
            await asyncio.gather(*tasks, dog, return_exceptions=True)
        share.retries = retries.counts
        await clients.close()
    return share


def _share_process(conn: Connection) -> None:
    """A client process: one Share in, the same Share with what it saw out."""
    share = conn.recv()
    conn.send(asyncio.run(run_share(share)))
    conn.close()


@dataclass
class Day:
    """What the load and the faults left, for `summarize`."""

    opts: Options
    dep: Deployment
    asks: dict[str, list[Ask]]
    refs: dict[Ask, Reading]
    shares: list[Share] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    windows: Windows = field(default_factory=lambda: Windows(10.0))
    abuse: Counter[str] = field(default_factory=Counter)
    lags: list[float] = field(default_factory=list)  # this (the faults') process's loop
    busy: set[str] = field(default_factory=set)  # slots being restarted: no fault's victim
    restarts: list[asyncio.Task[None]] = field(default_factory=list)
    began: float = 0.0
    end: float = 0.0
    load_s: float = 0.0

    @property
    def readings(self) -> list[Reading]:
        return [r for share in self.shares for r in share.readings]


async def sampler(day: Day) -> None:
    """Every second: each process's RSS, and how late this process's loop runs."""
    while True:
        due = time.monotonic() + 1.0
        await asyncio.sleep(1.0)
        day.lags.append(max(0.0, time.monotonic() - due))
        for slot in [*day.dep.instances, *day.dep.upstreams]:
            slot.sample_rss()


async def abuser(day: Day, i: int) -> None:
    """The abusive key: streams dropped after a few chunks, native streams never read, bursts
    past its max_streams. Its endings are counted, not judged."""
    rng = random.Random(day.opts.seed * 7919 + i)
    headers = {"authorization": f"Bearer {ABUSER[1]}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"abuse {i}"}]}
    async with httpx.AsyncClient(base_url=day.dep.url, headers=headers, timeout=30) as c:
        while time.monotonic() < day.end:
            what = rng.choice(("dropped", "unread", "burst"))
            try:
                if what == "dropped":
                    req = {**body, "stream": True, "max_tokens": 2000}
                    async with c.stream("POST", "/v1/chat/completions", json=req) as resp:
                        seen = 0
                        async for line in resp.aiter_lines():
                            seen += line.startswith("data: ")
                            if seen >= 5:
                                break
                        day.abuse[f"dropped {resp.status_code}"] += 1
                elif what == "unread":
                    req = {"model": MODEL, "prompt": f"never read {i}", "max_tokens": 500}
                    resp = await c.post("/v1/streams", json=req)
                    day.abuse[f"unread {resp.status_code}"] += 1
                else:
                    req = {**body, "max_tokens": 5}
                    burst = [c.post("/v1/chat/completions", json=req) for _ in range(8)]
                    for resp in await asyncio.gather(*burst):
                        day.abuse[f"burst {resp.status_code}"] += 1
            except httpx.HTTPError as exc:
                day.abuse[f"{what} {type(exc).__name__}"] += 1
            await asyncio.sleep(rng.uniform(0.1, 0.5))


def _active_streams(server: Server) -> float:
    try:
        return server.metric("firsttoken_active_streams")
    except httpx.HTTPError:
        return -1.0


async def restart(day: Day, slot: Slot) -> None:
    """Start `slot` again on its port (in a thread: the start waits for its `listening`)."""
    cm = slot.run("--port", str(slot.port))
    server = await asyncio.to_thread(cm.__enter__)
    day.dep.stack.push(cm)  # stopped with the rest at the end
    slot.started(server)


def later(day: Day, f: Fault, slot: Slot, at: float, after: Any) -> None:
    """Start `slot` again once `after` is done, in the background: the next fault keeps its
    time however long a start takes on a busy machine."""

    async def step() -> None:
        try:
            await after
            await restart(day, slot)
            f.took_s = round(time.monotonic() - at, 2)
        finally:
            day.busy.discard(slot.name)

    day.busy.add(slot.name)
    day.restarts.append(asyncio.create_task(step()))


async def fault(day: Day, kind: str, n: int) -> Fault:
    dep, at = day.dep, time.monotonic()
    f = Fault(kind, round(at - day.began, 1), "")
    day.windows.marks.append((at, kind))
    if kind in ("instance_kill", "instance_term"):
        ready = [s for s in dep.instances if s.name not in day.busy and s.alive()]
        if not ready:
            f.what = "none: every instance is being restarted"
            return f
        owned = await asyncio.gather(*(asyncio.to_thread(_active_streams, s.now) for s in ready))
        if kind == "instance_kill":  # the busiest
            slot, streams = max(zip(ready, owned, strict=True), key=lambda p: p[1])
            slot.now.kill(signal.SIGKILL)
            f.what = f"SIGKILL {slot.name} ({streams:.0f} streams)"
            later(day, f, slot, at, asyncio.sleep(1.0))
        else:  # a rolling deploy's step, in turn: started again once it exited
            slot, streams = next(
                ((s, o) for s, o in zip(ready, owned, strict=True) if int(s.name[-1]) >= n % 3),
                (ready[0], owned[0]),
            )
            proc = slot.now.proc
            proc.send_signal(signal.SIGTERM)
            f.what = f"SIGTERM {slot.name} ({streams:.0f} streams)"

            async def exited() -> None:
                try:
                    await asyncio.to_thread(proc.wait, 90)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    f.what += ", did not exit in 90 s: SIGKILLed"
                f.what += f", exited in {time.monotonic() - at:.1f} s"

            later(day, f, slot, at, exited())
    elif kind == "upstream_kill":
        ready = [s for s in dep.upstreams if s.name not in day.busy]
        if not ready:
            f.what = "none: every upstream is being restarted"
            return f
        slot = ready[n % len(ready)]
        slot.now.kill(signal.SIGKILL)
        f.what = f"SIGKILL {slot.name}"
        later(day, f, slot, at, asyncio.sleep(1.0))
    elif kind == "reload":
        dep.keys_file.write_text(keys_toml(n + 1))
        sent = 0
        for slot in dep.instances:
            if slot.alive():
                slot.now.proc.send_signal(signal.SIGHUP)
                sent += 1
        f.what = f"keys file changed, SIGHUP to {sent} instances"
    elif kind == "redis_restart":
        await asyncio.to_thread(dep.redis.stop)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(dep.redis.start)
        f.what = "redis-server stopped and started (empty)"
        f.took_s = round(time.monotonic() - at, 2)
    else:
        raise ValueError(kind)
    return f


async def fault_loop(day: Day, log: Callable[[str], None]) -> None:
    opts = day.opts
    due = day.began + (opts.first_fault_s or opts.fault_every_s)
    n = 0
    while due < day.end - 1:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        kind = opts.faults[n % len(opts.faults)]
        f = await fault(day, kind, n)
        day.faults.append(f)
        log(f"{f.at_s:6.1f} s {kind}: {f.what}")
        n += 1
        due += opts.fault_every_s
    await asyncio.gather(*day.restarts)


async def run_day(opts: Options, log: Callable[[str], None] = print) -> dict[str, Any]:
    t0 = time.monotonic()
    # The client processes start first: their imports overlap the deployment's start.
    procs: list[tuple[BaseProcess, Connection]] = []
    ctx = multiprocessing.get_context("spawn")
    for _ in range(opts.client_procs):
        mine, theirs = ctx.Pipe()
        proc: BaseProcess = ctx.Process(target=_share_process, args=(theirs,), daemon=True)
        proc.start()
        procs.append((proc, mine))
    try:
        with deployment(opts, log) as dep:
            log(f"deployed in {time.monotonic() - t0:.1f} s")
            day = await load(opts, dep, procs, log)
            log(f"load ended at {time.monotonic() - t0:.1f} s")
            ledger = await asyncio.to_thread(read_ledger, dep)
            log(f"ledger read at {time.monotonic() - t0:.1f} s")
            return summarize(day, ledger)
    finally:
        for proc, _ in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


async def load(
    opts: Options,
    dep: Deployment,
    procs: list[tuple[BaseProcess, Connection]],
    log: Callable[[str], None],
) -> Day:
    async with AsyncExitStack() as astack:
        clients = await Clients.open(dep.url, KEYS, astack)
        rng = random.Random(opts.seed)
        asks = {
            f: [
                Ask(f, v, rng.randint(opts.tokens_min, opts.tokens_max))
                for v in range(opts.variants)
            ]
            for f in FORMATS
        }
        refs = await references(clients, [a for v in asks.values() for a in v], log)
        await clients.close()
    day = Day(opts, dep, asks, refs, windows=Windows(opts.after_fault_s))
    day.began = time.monotonic()
    day.end = day.began + opts.minutes * 60
    parts = max(1, len(procs))
    shares = [
        Share(dep.url, asks, list(range(k, opts.streams, parts)), opts, day.end)
        for k in range(parts)
    ]
    for (_, conn), share in zip(procs, shares, strict=False):
        conn.send(share)
    if procs:
        running = [asyncio.to_thread(conn.recv) for _, conn in procs]
    else:
        running = [run_share(shares[0])]
    side = [asyncio.create_task(sampler(day))]
    side += [asyncio.create_task(abuser(day, i)) for i in range(opts.abusers)]
    faults = asyncio.create_task(fault_loop(day, log))
    day.shares = list(await asyncio.gather(*running))
    await faults
    day.load_s = time.monotonic() - day.began
    for t in side:
        t.cancel()
    await asyncio.gather(*side, return_exceptions=True)
    return day


def read_ledger(dep: Deployment) -> dict[str, list[tuple[str, str, int]]]:
    """request id → (instance's db, outcome, completion tokens) of every record, once every
    instance's queue is written."""
    deadline = time.monotonic() + 30
    for slot in dep.instances:
        while time.monotonic() < deadline and slot.alive():
            try:
                if slot.now.metric("firsttoken_usage_records_queued") == 0:
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.2)
    time.sleep(0.5)  # the last batch's commit
    rows: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    for i, db in enumerate(dep.dbs):
        path = db.removeprefix("sqlite:///")
        if not Path(path).exists():
            continue
        with sqlite3.connect(path) as conn:
            sql = "SELECT request_id, outcome, completion_tokens FROM usage_requests"
            for rid, outcome, tokens in conn.execute(sql):
                # A taken-over stream's part is its own record, `<stream id>:<suffix>`.
                rows[rid.split(":", 1)[0]].append((str(i), outcome, int(tokens)))
    return rows


# -- figures ---------------------------------------------------------------------------------------


def _pcts(values: Any) -> dict[str, float] | None:
    a = np.asarray(values, dtype=float)
    if not a.size:
        return None
    return {
        "p50": round(float(np.percentile(a, 50)) * 1000, 1),
        "p99": round(float(np.percentile(a, 99)) * 1000, 1),
        "max": round(float(a.max()) * 1000, 1),
        "n": int(a.size),
    }


def summarize(day: Day, ledger: dict[str, list[tuple[str, str, int]]]) -> dict[str, Any]:
    opts, dep = day.opts, day.dep
    normal = day.readings
    for r in normal:
        r.ending = judge(r, day.refs[r.ask].text)
    formats: dict[str, Any] = {}
    for fmt in FORMATS:
        rs = [r for r in normal if r.ask.fmt == fmt]
        ends = Counter(r.ending for r in rs)
        formats[fmt] = {
            "started": len(rs),
            **{e: ends[e] for e in ENDINGS},
            "errors": dict(Counter(r.error for r in rs if r.ending == "error").most_common()),
            "exact_share": round(ends["exact"] / len(rs), 5) if rs else None,
            "resumed": sum(r.reconnects > 0 for r in rs),
        }
    windows: dict[str, Any] = {}
    kinds = ["outside", *dict.fromkeys(k for _, k in day.windows.marks)]
    pairs = np.concatenate([np.frombuffer(sh.gaps, dtype=float) for sh in day.shares])
    all_gaps = pairs[0::2]
    filed = day.windows.file(all_gaps, pairs[1::2])
    with_text = [r for r in normal if r.chunks]
    for w in ["all", *kinds]:

        def inside(start: float, end: float, w: str = w) -> bool:
            return w == "all" or day.windows.of(start, end) == w

        gaps = all_gaps if w == "all" else filed.get(w, np.zeros(0))
        windows[w] = {
            "ttft_ms": _pcts([r.ttft_s for r in with_text if inside(r.sent, r.first_at)]),
            "longest_gap_ms": _pcts(
                [
                    r.longest_gap_s
                    for r in with_text
                    if r.chunks > 1 and inside(r.longest_gap_at - r.longest_gap_s, r.longest_gap_at)
                ]
            ),
            "gap_ms": _pcts(gaps),
        }
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "options": asdict(opts),
        "load_s": round(day.load_s, 1),
        "faults": [asdict(f) for f in day.faults],
        "formats": formats,
        "windows": windows,
        "ledger": ledger_check(day, ledger),
        "logs": {s.name: log_check(s) for s in [*dep.instances, *dep.upstreams]},
        "abuse": dict(sorted(day.abuse.items())),
        "client_loop_lag_ms": _pcts([x for sh in day.shares for x in sh.lags]),
        "faults_loop_lag_ms": _pcts(day.lags),
        "sdk_retries": dict(sorted(sum((sh.retries for sh in day.shares), Counter()).items())),
        "examples": examples(day),
        "slowest_first_text": [
            {
                "format": r.ask.fmt,
                "stream": r.stream_id,
                "ttft_ms": round((r.ttft_s or 0) * 1000),
                "at_s": round(r.sent - day.began, 1),
                "window": day.windows.of(r.sent, r.first_at),
            }
            for r in sorted(with_text, key=lambda r: -(r.ttft_s or 0))[:5]
        ],
        "longest_gaps": [
            {
                "format": r.ask.fmt,
                "stream": r.stream_id,
                "gap_ms": round(r.longest_gap_s * 1000),
                "at_s": round(r.longest_gap_at - r.longest_gap_s - day.began, 1),
                "window": day.windows.of(r.longest_gap_at - r.longest_gap_s, r.longest_gap_at),
                "resumed": r.reconnects,
            }
            for r in sorted(with_text, key=lambda r: -r.longest_gap_s)[:20]
        ],
    }


def ledger_check(day: Day, ledger: dict[str, list[tuple[str, str, int]]]) -> dict[str, Any]:
    """The ledger's completion tokens for each normal stream against what its client got."""
    relations: Counter[str] = Counter()
    unequal: Counter[str] = Counter()  # by format too
    odd: list[dict[str, Any]] = []
    billed = delivered_all = 0
    for r in day.readings:
        if not r.stream_id:
            relations[f"{r.ending}: no stream id (no answer began)"] += 1
            continue
        rows = ledger.get(r.stream_id, [])
        got = delivered_tokens(r.text, day.refs[r.ask])
        tokens = sum(t for _, _, t in rows)
        billed += tokens
        delivered_all += got or 0
        if not rows:
            rel = "no record"
        elif len(rows) > 1 and got is not None and tokens == got:
            rel = "equal"  # billed in parts by the owners of a takeover, once in all
        elif len(rows) > 1:
            rel = f"{len(rows)} records"
        elif got is None:
            rel = "text not the reference's"
        else:
            rel = "equal" if tokens == got else ("ledger more" if tokens > got else "ledger less")
        relations[f"{r.ending}: {rel}"] += 1
        if rel != "equal":
            unequal[f"{r.ask.fmt} {r.ending}: {rel}"] += 1
        if rel != "equal" and len(odd) < 20:
            odd.append(
                {
                    "stream": r.stream_id,
                    "format": r.ask.fmt,
                    "ending": r.ending,
                    "error": r.error,
                    "records": rows,
                    "delivered": got,
                }
            )
    trail(day, odd)
    return {
        "ledger_tokens": billed,
        "delivered_tokens": delivered_all,
        "relations": dict(sorted(relations.items())),
        "unequal_by_format": dict(sorted(unequal.items())),
        "differences": odd,
    }


def trail(day: Day, entries: list[dict[str, Any]]) -> None:
    """Each entry's stream as the instances logged it (which run of which instance, what
    event, what outcome): where a record went missing."""
    wanted = {e["stream"]: e for e in entries if e.get("stream")}
    for e in wanted.values():
        e["logged"] = []
    for slot in day.dep.instances:
        for run, server in enumerate(slot.runs):
            for line in list(server.log):
                if '"stream":"' not in line:
                    continue
                sid = line.split('"stream":"', 1)[1][:32]
                if sid not in wanted:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                what = f"{slot.name} run {run}: {rec.get('event')}"
                if rec.get("outcome"):
                    what += f" {rec['outcome']} ({rec.get('tokens_sent')} sent)"
                wanted[sid]["logged"].append(what)


def log_check(slot: Slot) -> dict[str, Any]:
    """Tracebacks and error lines in every run's log; the first few lines of each, Redis's
    own (`redis.down` while it restarts: expected) apart."""
    tracebacks = 0
    errors: Counter[str] = Counter()
    first: list[str] = []
    redis_first: dict[str, str] = {}  # the first line of each of Redis's own error events
    lines = list(slot.log_lines())
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):  # a plain line: a traceback printed by Python
            if line.startswith("Traceback"):
                tracebacks += 1
                first.append(" | ".join(lines[i : i + 30])[-3000:])
            continue
        if record.get("traceback") or "Traceback" in str(record.get("message", "")):
            tracebacks += 1
            first.append(f"{line[:300]} … {str(record.get('traceback', ''))[-2500:]}")
        elif record.get("level") == "error":
            event = str(record.get("event", ""))
            if not event.startswith("redis."):
                first.append(line[:600])
            elif event not in redis_first:
                redis_first[event] = line[:600]
        if record.get("level") == "error":
            errors[str(record.get("event", "?"))] += 1
    return {
        "runs": len(slot.runs),
        "tracebacks": tracebacks,
        "errors": dict(errors),
        "rss_peak_mib": round(slot.rss_peak / 2**20, 1),
        "first": first[:5],
        "redis_first": redis_first,
    }


def examples(day: Day) -> list[dict[str, Any]]:
    """A few streams of each bad ending, to start a reproduction from."""
    out: list[dict[str, Any]] = []
    seen: Counter[str] = Counter()
    for r in day.readings:
        if r.ending in ("exact",) or seen[f"{r.ask.fmt} {r.ending}"] >= 3:
            continue
        seen[f"{r.ask.fmt} {r.ending}"] += 1
        ref = day.refs[r.ask].text
        common = next(
            (i for i, (a, b) in enumerate(zip(r.text, ref, strict=False)) if a != b),
            min(len(r.text), len(ref)),
        )
        out.append(
            {
                "format": r.ask.fmt,
                "ending": r.ending,
                "error": r.error,
                "stream": r.stream_id,
                "at_s": round(r.sent - day.began, 1),
                "window": day.windows.of(r.sent, r.last_at or r.sent),
                "chars": len(r.text),
                "reference_chars": len(ref),
                "first_difference": common,
                "reconnects": r.reconnects,
            }
        )
    trail(day, out)
    return out


def _ms(p: dict[str, float] | None) -> str:
    return f"{p['p50']:.0f}/{p['p99']:.0f}" if p else "-"


def report(s: dict[str, Any]) -> str:
    o = s["options"]
    lines = [
        f"{s['date']}, commit {s['commit']}"
        + (f" (the servers at {o['rev']})" if o["rev"] else "")
        + f": {o['minutes']:g} min, {o['streams']} streams at once "
        f"(+{o['abusers']} abusive), a fault every {o['fault_every_s']:g} s, engine TTFT "
        f"{o['ttft_ms']:g} ms ITL {o['itl_ms']:g} ms, {o['tokens_min']}-{o['tokens_max']} tokens",
        "faults: "
        + "; ".join(
            f"{f['at_s']:.0f} s {f['what']}"
            + (f" (back at +{f['took_s']:.1f} s)" if f["took_s"] else "")
            for f in s["faults"]
        ),
        "",
        f"{'format':10} {'started':>7} {'exact':>6} {'wrong':>6} {'error':>6} {'short':>6} "
        f"{'hung':>5} {'exact%':>8} {'resumed':>8}  errors by type",
    ]
    for fmt, k in s["formats"].items():
        share = f"{k['exact_share']:.2%}" if k["exact_share"] is not None else "-"
        lines.append(
            f"{fmt:10} {k['started']:>7} {k['exact']:>6} {k['wrong']:>6} {k['error']:>6} "
            f"{k['short']:>6} {k['hung']:>5} {share:>8} {k['resumed']:>8}  {k['errors'] or '-'}"
        )
    lines += [
        "",
        f"{'window':14} {'TTFT p50/p99 ms':>16} {'longest gap p50/p99':>20} "
        f"{'gap p50/p99 ms':>15} {'streams':>8}",
    ]
    for w, k in s["windows"].items():
        n = k["ttft_ms"]["n"] if k["ttft_ms"] else 0
        lines.append(
            f"{w:14} {_ms(k['ttft_ms']):>16} {_ms(k['longest_gap_ms']):>20} "
            f"{_ms(k['gap_ms']):>15} {n:>8}"
        )
    led = s["ledger"]
    lines += [
        "",
        f"ledger: {led['ledger_tokens']} completion tokens billed for the normal streams, "
        f"{led['delivered_tokens']} delivered",
    ]
    lines += [f"  {rel}: {n}" for rel, n in led["relations"].items()]
    lines.append("")
    for name, k in s["logs"].items():
        lines.append(
            f"{name:11} runs {k['runs']}, tracebacks {k['tracebacks']}, error lines "
            f"{k['errors'] or 0}, peak RSS {k['rss_peak_mib']} MiB"
        )
        lines += [f"    {line[:200]} … {line[-300:]}" for line in k["first"][:3]]
    lines.append(f"abusive key: {s['abuse']}")
    lines.append(f"the SDKs' own retries: {s['sdk_retries'] or 0}")
    procs = o["client_procs"] or 1
    lines.append(
        f"loop lag p50/p99 ms: the clients' {_ms(s['client_loop_lag_ms'])} ({procs} "
        f"processes), the faults' {_ms(s['faults_loop_lag_ms'])}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    d = Options()
    p = argparse.ArgumentParser(
        prog="python -m bench.production_day", description=__doc__.split("\n")[0]
    )
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--streams", type=int, default=d.streams, help="normal streams at once")
    p.add_argument("--fault-every-s", type=float, default=d.fault_every_s)
    p.add_argument("--faults", default=",".join(d.faults), help="kinds, in turn")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--ttft-ms", type=float, default=d.ttft_ms)
    p.add_argument("--itl-ms", type=float, default=d.itl_ms)
    p.add_argument("--tokens-min", type=int, default=d.tokens_min)
    p.add_argument("--tokens-max", type=int, default=d.tokens_max)
    p.add_argument("--variants", type=int, default=d.variants)
    p.add_argument("--abusers", type=int, default=d.abusers)
    p.add_argument("--client-procs", type=int, default=d.client_procs, help="0: in this one")
    p.add_argument("--hang-s", type=float, default=d.hang_s)
    p.add_argument("--rev", default="", help="the servers' firsttoken as of this commit")
    p.add_argument("--json", type=Path, help="write the summary as JSON here")
    a = p.parse_args(argv)
    faults = tuple(x for x in a.faults.split(",") if x)
    unknown = [x for x in faults if x not in FAULT_KINDS]
    if unknown:
        p.error(f"--faults: unknown {unknown}; kinds: {','.join(FAULT_KINDS)}")
    opts = Options(
        minutes=a.minutes,
        streams=a.streams,
        fault_every_s=a.fault_every_s,
        faults=faults,
        seed=a.seed,
        ttft_ms=a.ttft_ms,
        itl_ms=a.itl_ms,
        tokens_min=a.tokens_min,
        tokens_max=a.tokens_max,
        variants=a.variants,
        abusers=a.abusers,
        client_procs=a.client_procs,
        rev=a.rev,
        hang_s=a.hang_s,
    )
    summary = asyncio.run(run_day(opts, log=lambda m: print(m, file=sys.stderr, flush=True)))
    print(report(summary))
    if a.json:
        a.json.write_text(json.dumps(summary, indent=2))
    bad = sum(k["short"] + k["wrong"] + k["hung"] for k in summary["formats"].values())
    return 1 if bad or any(k["tracebacks"] for k in summary["logs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
