"""Instances that die, or are restarted: three instances behind nginx on one Redis Cluster,
under native streams read by the Python client and by browser EventSource readers, while one
instance is SIGKILLed every `--kill-every-s` (and started again on its port), or every
instance in turn is SIGTERMed and started again (`--faults rolling`: a rolling deploy).
docs/reliability.md, "Instances that die"; bench/README.md, "Instances".

    .venv/bin/python -m bench.instances                          # 1,000 streams, 300 at once
    .venv/bin/python -m bench.instances --durable                # every takeover exact
    .venv/bin/python -m bench.instances --faults rolling         # SIGTERM each in turn
    .venv/bin/python -m bench.instances --streams 60 --concurrency 30 --browsers 2

Everything runs on loopback: a 3-master Redis Cluster (tests/redis_server.py), three
`firsttoken serve --redis … --redis-cluster --rate-limit-per-s 0`, nginx with
deploy/nginx-multi.conf (ports substituted as the tests do). Each reader creates its own native
stream through nginx and reads it: `--concurrency` at once with the Python client
(`firsttoken.client.AsyncClient`, which resumes with Last-Event-ID on a cut) until `--streams`
were made, and `--browsers` with EventSource in headless Chromium (one page: a browser opens 6
connections per host over HTTP/1.1). The first fault comes once every reader of the first wave
has `--kill-after` tokens; a SIGKILL goes to the instance with the most active streams.

Each reader's text is compared with the synthetic engine's (bench/expected.py):
  exact    ended with [DONE], text equal (`resumed` when it reconnected on the way);
  told     ended with an error (`event: error`, the client's StreamInterrupted, EventSource
           closed) and what it got is a prefix of the answer;
  wrong    anything else: [DONE] with other text, or text that is not a prefix (must be 0);
  hung     no end before `--deadline-s` after the last fault;
  refused  the create itself failed (an error before any stream existed), counted apart.
`gap` is a reader's longest time without a token, its end counted as a token (so a told
reader's gap includes the wait before it was told); a cut reader's gap is the seam.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from playwright.async_api import Page, async_playwright

from bench.expected import expected_tokens
from firsttoken.client import AsyncClient, StreamError, StreamInterrupted
from tests.nginx import MULTI_CONF, run_nginx
from tests.redis_server import redis_cluster
from tests.servers import ROOT, Server, run_server

CHROMIUM = Path(os.environ.get("FIRSTTOKEN_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-quic"]


@dataclass
class Options:
    instances: int = 3
    streams: int = 1000  # Python-client streams in all
    concurrency: int = 300  # of them at once
    browsers: int = 6
    max_tokens: int = 200
    ttft_ms: float = 50
    itl_ms: float = 50
    kill_after: int = 30  # tokens every reader of the first wave has before the first fault
    faults: str = "kill"  # kill | rolling | none
    kill_every_s: float = 20.0
    durable: bool = False
    deadline_s: float = 60  # after the last stream began, for every reader to end


@dataclass
class Fault:
    kind: str  # SIGKILL | SIGTERM
    instance: int
    owned: int  # its active streams at the signal
    at_s: float  # since the first stream
    exit_s: float | None = None  # SIGTERM: how long the process took to exit

@dataclass
class Reader:
    kind: str  # "python" or "browser"
    prompt: str
    outcome: str = "hung"  # exact, told, wrong, hung
    code: str = ""  # how a told reader was told
    reconnects: int = 0
    tokens: int = 0
    gap_s: float = 0.0
    started: bool = False
    stream_id: str = ""
    arrivals: list[float] = field(default_factory=list, repr=False)

    def judge(self, text: str, done: bool, told: str, max_tokens: int, end: float) -> None:
        expected = "".join(expected_tokens(self.prompt, None, max_tokens))
        self.tokens = len(self.arrivals)
        times = [*self.arrivals, end] if (done or told) else self.arrivals
        self.gap_s = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        if done:
            self.outcome = "exact" if text == expected else "wrong"
        elif told:
            self.outcome, self.code = (
                ("told", told) if expected.startswith(text) else ("wrong", told)
            )


@dataclass
class Result:
    options: Options
    faults: list[Fault]
    readers: list[Reader]
    takeovers: dict[str, float] = field(default_factory=dict)  # the survivors' counters
    client_lag_s: list[float] = field(default_factory=list)  # the readers' own event loop
    started: str = ""
    commit: str = ""

    @property
    def killed_owned(self) -> int:
        return sum(f.owned for f in self.faults)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "date": self.started,
            "commit": self.commit,
            "options": asdict(self.options),
            "faults": [asdict(f) for f in self.faults],
            "takeovers": self.takeovers,
            # Past the client's 5 s connect timeout, a create fails on the client's side.
            "client_loop_lag_s": _pcts(self.client_lag_s),
        }
        for kind in ("python", "browser"):
            rs = [r for r in self.readers if r.kind == kind]
            cut = [r for r in rs if r.reconnects > 0]
            judged = [r for r in rs if r.outcome != "refused"]
            out[kind] = {
                "readers": len(rs),
                "exact": sum(r.outcome == "exact" for r in rs),
                "exact_share": round(sum(r.outcome == "exact" for r in judged) / len(judged), 4)
                if judged
                else None,
                "exact_after_resume": sum(r.outcome == "exact" and r.reconnects > 0 for r in rs),
                "told": dict(Counter(r.code for r in rs if r.outcome == "told")),
                "wrong": sum(r.outcome == "wrong" for r in rs),
                "hung": sum(r.outcome == "hung" for r in rs),
                "refused": dict(Counter(r.code for r in rs if r.outcome == "refused")),
                "cut": len(cut),
                "gap_s_all": _pcts([r.gap_s for r in rs]),
                "gap_s_resumed_exact": _pcts([r.gap_s for r in cut if r.outcome == "exact"]),
                "gap_s_told": _pcts([r.gap_s for r in rs if r.outcome == "told"]),
            }
        return out


def _pcts(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    s = sorted(values)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))], 3)

    return {"p50": at(0.5), "p99": at(0.99), "max": round(s[-1], 3), "n": len(s)}


def _synthetic(opts: Options) -> dict[str, Any]:
    return {
        "max_tokens": opts.max_tokens,
        "synthetic": {"ttft_ms": opts.ttft_ms, "itl_ms": opts.itl_ms},
    }


async def python_reader(base: str, reader: Reader, opts: Options) -> None:
    text, done, told = "", False, ""
    async with AsyncClient(base, timeout_s=60, max_retries=8) as client:
        answer = None
        try:
            answer = await client.stream(reader.prompt, **_synthetic(opts))
            reader.stream_id = answer.stream_id or ""
            async for _delta in answer:
                reader.arrivals.append(time.monotonic())
            done = True
        except StreamError as exc:
            told = exc.code if answer is not None else f"create {exc.code}"
        except StreamInterrupted as exc:
            told = f"interrupted ({exc.reason[:40]})"
        except httpx.HTTPError as exc:  # the create itself failed
            told = f"create failed ({type(exc).__name__})"
        if answer is None:  # refused before any stream existed: not the kill's doing
            reader.outcome, reader.code = "refused", told
            return
        text, reader.reconnects = answer.text, answer.reconnects
    reader.judge(text, done, told, opts.max_tokens, time.monotonic())


# One page, `bodies` native streams read by EventSource; each reader's state in window.readers
# (times in performance.now() ms). `event: error` comes as a MessageEvent (it has data); a
# dropped connection as a plain error event, after which EventSource reconnects by itself
# (Last-Event-ID) unless it gave up (readyState CLOSED).
EVENT_SOURCES = """async (bodies) => {
  window.readers = [];
  const made = [];
  for (const body of bodies) {  // created first: 6 open EventSources take every connection
    made.push(await (await fetch('/v1/streams', {method: 'POST',
        headers: {'content-type': 'application/json'}, body: JSON.stringify(body)})).json());
  }
  for (const m of made) {
    const r = {tokens: [], times: [], opens: 0, drops: 0, done: false, error: '', end: null};
    window.readers.push(r);
    const source = new EventSource(m.events_url);
    const finish = () => { source.close(); r.end = performance.now(); };
    source.onopen = () => r.opens++;
    source.addEventListener('error', (e) => {
      if (typeof e.data === 'string') {
        try { r.error = JSON.parse(e.data).error.code; } catch { r.error = 'error'; }
        finish();
      } else {
        r.drops++;
        if (source.readyState === EventSource.CLOSED) { r.error = 'eventsource_closed'; finish(); }
      }
    });
    source.onmessage = (e) => {
      if (e.data === '[DONE]') { r.done = true; return finish(); }
      const d = JSON.parse(e.data);
      if (d.token !== undefined) { r.tokens.push(d.token); r.times.push(performance.now()); }
    };
  }
  return made.length;
}"""
BROWSER_STATE = "() => (window.readers || []).map(r => [r.tokens.length, r.end !== null])"
BROWSER_RESULT = "() => window.readers"


async def browser_progress(page: Page | None) -> list[tuple[int, bool]]:
    if page is None:
        return []
    return [(n, ended) for n, ended in await page.evaluate(BROWSER_STATE)]


def judge_browsers(raw: list[dict[str, Any]], readers: list[Reader], opts: Options) -> None:
    for r, got in zip(readers, raw, strict=True):
        r.arrivals = [t / 1000 for t in got["times"]]
        r.reconnects = max(0, got["opens"] - 1)
        end = got["end"] / 1000 if got["end"] is not None else 0.0
        ended = got["end"] is not None
        r.judge(
            "".join(got["tokens"]), got["done"], got["error"] if ended else "", opts.max_tokens, end
        )


def active_streams(server: Server) -> float:
    try:
        return server.metric("firsttoken_active_streams")
    except httpx.HTTPError:
        return -1.0


async def scenario(opts: Options, log: Any = print) -> Result:
    with ExitStack() as stack:
        cluster = stack.enter_context(redis_cluster(masters=3))
        args = ["--redis-cluster", "--rate-limit-per-s", "0"]  # the bench's burst is no abuse
        args += ["--synthetic-ttft-ms", str(opts.ttft_ms), "--synthetic-itl-ms", str(opts.itl_ms)]
        if opts.durable:
            args.append("--durable")
        # Each names a different node: any one finds the rest.
        urls = [f"redis://127.0.0.1:{cluster.ports[i % 3]}/0" for i in range(opts.instances)]
        servers = [stack.enter_context(run_server("--redis", u, *args)) for u in urls]
        ports = [s.port for s in servers]

        def restart(i: int) -> None:  # on its own port: nginx's upstream list stays true
            servers[i] = stack.enter_context(
                run_server("--redis", urls[i], *args, "--port", str(ports[i]))
            )

        prefix = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        ng = stack.enter_context(run_nginx(ports, prefix, base=MULTI_CONF))
        log(f"cluster on {cluster.ports}, instances on {ports}, nginx {ng.url}")
        async with async_playwright() as pw:
            page = None
            browser_readers = [
                Reader("browser", f"browser reader {i}") for i in range(opts.browsers)
            ]
            if opts.browsers:
                browser = await pw.chromium.launch(
                    executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
                )
                page = await browser.new_page()
                await page.goto(ng.url + "/healthz")
            py_readers = [Reader("python", f"python reader {i}") for i in range(opts.streams)]
            queue = iter(py_readers)

            async def worker() -> None:
                for reader in queue:
                    reader.started = True
                    await python_reader(ng.url, reader, opts)

            lags: list[float] = []
            sampler = asyncio.create_task(_sample_lag(lags))
            began = time.monotonic()
            workers = [
                asyncio.create_task(worker()) for _ in range(min(opts.concurrency, opts.streams))
            ]
            if page is not None:
                bodies = [{"prompt": r.prompt, **_synthetic(opts)} for r in browser_readers]
                await page.evaluate(EVENT_SOURCES, bodies)
            await _first_wave(py_readers[: opts.concurrency], page, opts, log)
            faults: list[Fault] = []
            if opts.faults == "kill":
                await _kills(servers, restart, workers, faults, began, opts, log)
            elif opts.faults == "rolling":
                await _rolling(servers, restart, faults, began, log)
            last = time.monotonic()
            per_stream = (opts.ttft_ms + opts.max_tokens * opts.itl_ms) / 1000
            left = opts.streams / max(1, opts.concurrency) * per_stream
            deadline = last + opts.deadline_s + left
            while time.monotonic() < deadline:
                browsers_ended = all(e for _, e in await browser_progress(page))
                if all(w.done() for w in workers) and browsers_ended:
                    break
                await asyncio.sleep(0.1)
            for w in [*workers, sampler]:
                w.cancel()
            await asyncio.gather(*workers, sampler, return_exceptions=True)
            if page is not None:
                judge_browsers(await page.evaluate(BROWSER_RESULT), browser_readers, opts)
            log(f"readers ended {time.monotonic() - last:.1f} s after the last fault")
            takeovers: Counter[str] = Counter()
            for s in servers:
                for outcome in ("continued", "lost", "refused"):
                    name = f'firsttoken_takeovers_total{{outcome="{outcome}"}}'
                    takeovers[outcome] += await asyncio.to_thread(_metric, s, name)
            error_log = prefix / "error.log"
            lines = error_log.read_text(errors="replace").splitlines() if error_log.exists() else []
            upstream = [x for x in lines if "upstream" in x and ("[error]" in x or "[crit]" in x)]
            if upstream:
                log(f"nginx: {len(upstream)} upstream errors, e.g. {upstream[-1][:300]}")
            for i, s in enumerate(servers):
                warned: Counter[str] = Counter()
                for line in s.log:
                    if '"level":"error"' in line or "Traceback" in line:
                        log(f"instance {i}: {line[:200]} … {line[-700:]}")
                    if '"level":"warning"' in line:
                        warned[json.loads(line).get("event", "?")] += 1
                if warned:
                    log(f"instance {i} (the last on its port) warned: {dict(warned)}")
    readers = [r for r in py_readers if r.started] + browser_readers
    hung = [r for r in readers if r.outcome == "hung"]
    for r in hung[:5]:
        log(f"hung: {r.kind} {r.prompt!r} {r.stream_id}, {len(r.arrivals)} tokens")
    return Result(opts, faults, readers, dict(takeovers), lags)


async def _first_wave(wave: list[Reader], page: Page | None, opts: Options, log: Any) -> None:
    """Until every reader of the first wave (and every browser) has `kill_after` tokens."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # Readers already ended (a refused create) do not hold the fault back.
        progress = [len(r.arrivals) for r in wave if r.outcome == "hung"]
        progress += [n for n, ended in await browser_progress(page) if not ended]
        if progress and min(progress) >= opts.kill_after:
            return
        await asyncio.sleep(0.05)
    log("not every reader reached --kill-after tokens in 60 s; the fault comes anyway")


async def _kills(
    servers: list[Server],
    restart: Any,
    workers: list[asyncio.Task[None]],
    faults: list[Fault],
    began: float,
    opts: Options,
    log: Any,
) -> None:
    """SIGKILL the busiest instance every `kill_every_s` while streams are being read, and
    start it again on its port a second later."""
    while not all(w.done() for w in workers):
        owned = await asyncio.gather(*(asyncio.to_thread(active_streams, s) for s in servers))
        victim = max(range(len(servers)), key=lambda i: owned[i])
        servers[victim].proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        faults.append(Fault("SIGKILL", victim, int(owned[victim]), round(killed_at - began, 2)))
        log(
            f"SIGKILL instance {victim} (port {servers[victim].port}), owning "
            f"{owned[victim]:.0f} of {sum(owned):.0f} active streams"
        )
        await asyncio.to_thread(servers[victim].proc.wait, 10)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(restart, victim)
        while time.monotonic() < killed_at + opts.kill_every_s:
            if all(w.done() for w in workers):
                return
            await asyncio.sleep(0.1)


async def _rolling(
    servers: list[Server], restart: Any, faults: list[Fault], began: float, log: Any
) -> None:
    """A rolling deploy: SIGTERM each instance in turn, wait for it to exit, start it again
    on its port, and go on to the next once it listens."""
    for i in range(len(servers)):
        owned = await asyncio.to_thread(active_streams, servers[i])
        servers[i].proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        await asyncio.to_thread(servers[i].proc.wait, 60)
        exited = time.monotonic() - sent
        faults.append(Fault("SIGTERM", i, int(owned), round(sent - began, 2), round(exited, 3)))
        log(f"SIGTERM instance {i}: {owned:.0f} active streams, exited in {exited:.2f} s")
        await asyncio.to_thread(restart, i)
        await asyncio.sleep(2.0)


async def _sample_lag(lags: list[float], every_s: float = 0.1) -> None:
    """How late this process's event loop runs a timer: the readers' own saturation."""
    while True:
        due = time.monotonic() + every_s
        await asyncio.sleep(every_s)
        lags.append(max(0.0, time.monotonic() - due))


def _metric(server: Server, name: str) -> float:
    try:
        return server.metric(name)
    except httpx.HTTPError:
        return 0.0


def report(summary: dict[str, Any]) -> str:
    opts = summary["options"]
    faults = ", ".join(
        f"{f['kind']} {f['instance']} at {f['at_s']:.0f} s ({f['owned']} streams"
        + (f", exited in {f['exit_s']:.2f} s)" if f["exit_s"] is not None else ")")
        for f in summary["faults"]
    )
    lines = [
        f"{summary['date']}, commit {summary['commit']}; {opts['faults']}"
        f"{' --durable' if opts['durable'] else ''}: {faults or 'no fault'}",
        f"takeovers (survivors' counters): {summary['takeovers']}; the readers' own loop lag "
        f"{summary['client_loop_lag_s']}",
        f"{'reader':8} {'n':>5} {'cut':>4} {'exact':>6} {'share':>7} {'resumed':>8} {'wrong':>6} "
        f"{'hung':>5}  told; longest gap p50/p99 s (all | resumed exact | told)",
    ]
    for kind in ("python", "browser"):
        k = summary[kind]
        if not k["readers"]:
            continue

        def g(p: dict[str, float] | None) -> str:
            return f"{p['p50']:.2f}/{p['p99']:.2f}" if p else "-"

        share = f"{k['exact_share']:.2%}" if k["exact_share"] is not None else "-"
        lines.append(
            f"{kind:8} {k['readers']:>5} {k['cut']:>4} {k['exact']:>6} {share:>7} "
            f"{k['exact_after_resume']:>8} {k['wrong']:>6} {k['hung']:>5}  {k['told'] or '-'}; "
            f"{g(k['gap_s_all'])} | {g(k['gap_s_resumed_exact'])} | {g(k['gap_s_told'])}"
            + (f"; refused {k['refused']}" if k["refused"] else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.instances", description=__doc__.split("\n")[0]
    )
    d = Options()
    p.add_argument("--streams", type=int, default=d.streams, help="Python-client streams")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="of them at once")
    p.add_argument("--browsers", type=int, default=d.browsers, help="EventSource readers (≤ 6)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--itl-ms", type=float, default=d.itl_ms)
    p.add_argument("--kill-after", type=int, default=d.kill_after)
    p.add_argument("--faults", choices=("kill", "rolling", "none"), default=d.faults)
    p.add_argument("--kill-every-s", type=float, default=d.kill_every_s)
    p.add_argument("--durable", action="store_true", help="instances run with --durable")
    p.add_argument("--deadline-s", type=float, default=d.deadline_s)
    p.add_argument("--out", type=Path, help="write the summary as JSON here")
    a = p.parse_args(argv)
    opts = Options(
        streams=a.streams,
        concurrency=a.concurrency,
        browsers=min(6, a.browsers),
        max_tokens=a.max_tokens,
        itl_ms=a.itl_ms,
        kill_after=a.kill_after,
        faults=a.faults,
        kill_every_s=a.kill_every_s,
        durable=a.durable,
        deadline_s=a.deadline_s,
    )
    result = asyncio.run(scenario(opts, log=lambda m: print(m, file=sys.stderr)))
    result.started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    result.commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    summary = result.summary()
    print(report(summary))
    if a.out:
        a.out.write_text(json.dumps(summary, indent=2))
    return 0 if all(summary[k]["wrong"] == 0 for k in ("python", "browser")) else 1


if __name__ == "__main__":
    sys.exit(main())
