"""Instances that die: three instances behind nginx on one Redis Cluster, one SIGKILLed while
it serves native streams (issue 27.2; docs/reliability.md, "Instances that die").

    .venv/bin/python -m bench.instances                  # 300 Python readers, 6 EventSource
    .venv/bin/python -m bench.instances --streams 30 --browsers 2 --out /tmp/instances.json

Everything runs on loopback: a 3-master Redis Cluster (tests/redis_server.py), three
`firsttoken serve --redis … --redis-cluster`, nginx with deploy/nginx-multi.conf (ports
substituted as the tests do). Each reader creates its own native stream through nginx and
reads it: `--streams` with the Python client (`firsttoken.client.AsyncClient`, which resumes
with Last-Event-ID on a cut) and `--browsers` with EventSource in headless Chromium (one page:
a browser opens 6 connections per host over HTTP/1.1). Once every reader has `--kill-after`
tokens, the instance with the most streams of its own is SIGKILLed.

Each reader's text is compared with the synthetic engine's (bench/expected.py):
  exact    ended with [DONE], text equal (`resumed` when it reconnected on the way);
  told     ended with an error (`event: error`, the client's StreamInterrupted, EventSource
           closed) and what it got is a prefix of the answer;
  wrong    anything else: [DONE] with other text, or text that is not a prefix (must be 0);
  hung     no end before `--deadline-s` after the kill;
  refused  the create itself failed (an error before any stream existed), counted apart.
`gap` is a reader's longest time without a token, its end counted as a token (so a told
reader's gap includes the wait before it was told).
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
    streams: int = 300
    browsers: int = 6
    max_tokens: int = 200
    ttft_ms: float = 50
    itl_ms: float = 50
    kill_after: int = 30  # tokens every reader has before the kill
    deadline_s: float = 60  # after the kill, for every reader to end


@dataclass
class Reader:
    kind: str  # "python" or "browser"
    prompt: str
    outcome: str = "hung"  # exact, told, wrong, hung
    code: str = ""  # how a told reader was told
    reconnects: int = 0
    tokens: int = 0
    gap_s: float = 0.0
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
    killed_owned: int  # streams the killed instance owned (active) at the kill
    readers: list[Reader]
    started: str = ""
    commit: str = ""

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "date": self.started,
            "commit": self.commit,
            "options": asdict(self.options),
            "killed_instance_owned": self.killed_owned,
        }
        for kind in ("python", "browser"):
            rs = [r for r in self.readers if r.kind == kind]
            cut = [r for r in rs if r.reconnects > 0]
            out[kind] = {
                "readers": len(rs),
                "exact": sum(r.outcome == "exact" for r in rs),
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
        args = ["--redis-cluster", "--synthetic-ttft-ms", str(opts.ttft_ms)]
        args += ["--synthetic-itl-ms", str(opts.itl_ms)]
        servers = [
            # Each names a different node: any one finds the rest.
            stack.enter_context(
                run_server("--redis", f"redis://127.0.0.1:{cluster.ports[i % 3]}/0", *args)
            )
            for i in range(opts.instances)
        ]
        prefix = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        ng = stack.enter_context(run_nginx([s.port for s in servers], prefix, base=MULTI_CONF))
        log(f"cluster on {cluster.ports}, instances on {[s.port for s in servers]}, nginx {ng.url}")
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
            tasks = [asyncio.create_task(python_reader(ng.url, r, opts)) for r in py_readers]
            if page is not None:
                bodies = [{"prompt": r.prompt, **_synthetic(opts)} for r in browser_readers]
                await page.evaluate(EVENT_SOURCES, bodies)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                # Readers already ended (a refused create) do not hold the kill back.
                running = zip(py_readers, tasks, strict=True)
                progress = [len(r.arrivals) for r, t in running if not t.done()]
                progress += [n for n, ended in await browser_progress(page) if not ended]
                if progress and min(progress) >= opts.kill_after:
                    break
                await asyncio.sleep(0.05)
            else:
                log("not every reader reached --kill-after tokens in 60 s; killing anyway")
            owned = await asyncio.gather(*(asyncio.to_thread(active_streams, s) for s in servers))
            victim = max(range(len(servers)), key=lambda i: owned[i])
            servers[victim].proc.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            log(
                f"SIGKILL instance {victim} (port {servers[victim].port}), owning "
                f"{owned[victim]:.0f} of {sum(owned):.0f} active streams"
            )
            deadline = killed_at + opts.deadline_s
            while time.monotonic() < deadline:
                browsers_ended = all(e for _, e in await browser_progress(page))
                if all(t.done() for t in tasks) and browsers_ended:
                    break
                await asyncio.sleep(0.1)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if page is not None:
                judge_browsers(await page.evaluate(BROWSER_RESULT), browser_readers, opts)
            log(f"readers ended {time.monotonic() - killed_at:.1f} s after the kill")
            for i, s in enumerate(servers):
                for line in s.log:
                    if '"level":"error"' in line or "Traceback" in line:
                        log(f"instance {i}: {line[:200]} … {line[-700:]}")
        servers[victim].proc.wait(timeout=10)
    return Result(opts, int(owned[victim]), py_readers + browser_readers)


def report(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['date']}, commit {summary['commit']}; killed instance owned "
        f"{summary['killed_instance_owned']} streams",
        f"{'reader':8} {'n':>4} {'cut':>4} {'exact':>6} {'resumed':>8} {'wrong':>6} {'hung':>5}  "
        "told; longest gap p50/p99 s (all | resumed exact | told)",
    ]
    for kind in ("python", "browser"):
        k = summary[kind]
        if not k["readers"]:
            continue

        def g(p: dict[str, float] | None) -> str:
            return f"{p['p50']:.2f}/{p['p99']:.2f}" if p else "-"

        lines.append(
            f"{kind:8} {k['readers']:>4} {k['cut']:>4} {k['exact']:>6} "
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
    p.add_argument("--streams", type=int, default=d.streams, help="Python-client readers")
    p.add_argument("--browsers", type=int, default=d.browsers, help="EventSource readers (≤ 6)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--itl-ms", type=float, default=d.itl_ms)
    p.add_argument("--kill-after", type=int, default=d.kill_after)
    p.add_argument("--deadline-s", type=float, default=d.deadline_s)
    p.add_argument("--out", type=Path, help="write the summary as JSON here")
    a = p.parse_args(argv)
    opts = Options(
        streams=a.streams,
        browsers=min(6, a.browsers),
        max_tokens=a.max_tokens,
        itl_ms=a.itl_ms,
        kill_after=a.kill_after,
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
