"""Edge and center: what a small model at the edge buys in first-token time, and what the
hand-off to the center costs the reader.

    .venv/bin/python -m bench.edge [--quick] [--requests 40] [--concurrency 4]
                                   [--max-tokens 48] [--after-tokens 16] [--cases A,B]
                                   [--seam-requests 30] [--tier-delay-ms 50] [--edge-root DIR]

Processes on loopback (every one a `firsttoken serve`, bar the delay lines and lcpp-center):
- `llama-center`: `--engine llamacpp`, the bundled SmolLM2-135M, the only real model here;
- a delay line in this process, in front of it: every byte towards the center arrives
  `--center-delay-ms` (900) late, so the center starts each answer 900 ms after it was asked
  (a big model's queue and prefill: a prefill cannot shorten it) and then decodes at the small
  model's pace;
- `synth-center`: the synthetic engine, TTFT 900 ms, ITL 20 ms, its TTFT guard off, behind a
  delay line of `--tier-delay-ms` (50) each way (this kernel has no netem). Its requests carry
  `synthetic.continue_any` (it continues the small model's text: the rest of its own answer
  after as many tokens) and, for `synth-seam`, `prefix_cache` (its TTFT is the prompt's
  prefill, which a prefill at the start warms);
- `lcpp-center` (cases `lcpp*`): llama-cpp-python's own server (`python -m llama_cpp.server`,
  the same SmolLM2, one thread, ChatML, `--interrupt_requests False`), behind the same kind of
  delay line; a `continuation = "completions"` target (the edge renders ChatML);
- `edge`: `--routes FILE --canned-answers FILE --heartbeat-s 0.25`, the small model in process
  (`kind = "llamacpp"`, the same SmolLM2), the centers as `kind = "openai"` targets with
  `continuation = "vllm"`. One route per case: the center alone, a hand-off `at = "tokens"`
  (after exactly `--after-tokens`), a hand-off `at = "sentence"` (the first sentence end past
  them); `mix`: `short_prompts` onto the slow center; `mix-handoff`: the same and a sentence
  hand-off. Each llama.cpp process runs one thread (ONE_THREAD below: two tiers would be two
  machines; two llama.cpp processes at their default threads on 2 cores slow each other ×5-11).

Centers by case name: `slow` (llama.cpp behind the delay line), `llama` (llama.cpp, no delay:
the center is as fast as the edge), `synth`, `lcpp`. `-tokens` and `-sentence` are today's
hand-off by count (`prefill = false, pace_ms = 0`); `-seam` the hand-off without a seam (the
defaults: prefill, `pace_ms = 50`, by time, `after_tokens` two thirds of `--max-tokens`);
`-noprefill` the same without the prefill;
`edge` the small model alone. The seam cases (`edge`, `synth*`, `lcpp*`) send
`--seam-requests` (30) unique long prompts (no cache holds an earlier answer's prompt), and
check the text after each seam against the center's own continuation of the text before it,
asked again directly (`seam text exact`). Every case goes through the edge (same client
path): `--requests` Chat Completions streams (`--synth-requests` for `synth`), `--concurrency`
at once, greedy, `--max-tokens`; the `mix` cases send greetings (canned at the edge), short
questions and long prompts, a third each. `--edge-root DIR` runs the edge from another tree.

Figures per case: TTFT (request sent to first content chunk) and total time (to the last byte)
p50/p99; every gap between two content chunks over the whole answer (p99) and each answer's
longest pause (p50, max); hand-offs (the edge's `route.handoff` log lines, matched to the
client's stream by id and `at_token`) and fallbacks (`route.handoff_fallback`: the center
refused, the edge finished);
the gap at the hand-off (the client's time from the last chunk before the seam to the first
after it) beside the stream's ordinary gap between chunks, and the heartbeats that came inside
it; where the seam falls (after a sentence end, or mid-sentence); a few seams as text. For
`mix`: per kind of prompt, how many went to the center at all, so the share answered at the
edge by the rules, and how many of them the hand-off sent to the center anyway. Writes
`bench/results/edge.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.failover import Process, _free_port, gateway_events
from bench.procs import ROOT, ServerProcess
from firsttoken.engines.relay import render_open_chat

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
OPEN = ("--rate-limit-per-s", "0", "--ttft-slo-ms", "0", "--breaker-error-rate", "1")
LLAMA_MODEL = "smollm2-135m-instruct"
LCPP_ALIAS = "smollm2"  # the llama-cpp-python center's name for the same model
# The router's own test of a sentence end (firsttoken/routing/engine.py), applied to the text
# before the seam: a seam right after it is a pause between sentences.
SENTENCE_END = re.compile(r"""[.!?。！？…]["'”’)\]]*\s*$|\n\s*$""")
# Today's hand-off: after exactly after_tokens, no prefill, no pace.
BY_COUNT = ", prefill = false, pace_ms = 0"
# The synthetic center continues any edge's text; with a prefix cache for the seam cases.
SYNTH_KNOBS = {"continue_any": True}
SEAM_KNOBS = {"continue_any": True, "prefix_cache": True}
GREETINGS = ("Hi!", "hello", "Thanks!", "hi there", "Good morning")
CANNED = {
    "hi": "Hello! How can I help you today?",
    "hello": "Hello! How can I help you today?",
    "hi there": "Hi! What can I do for you?",
    "thanks": "You're welcome!",
    "good morning": "Good morning! How can I help?",
}
SHORT = (
    "What is rain?",
    "Name a fruit.",
    "Why is grass green?",
    "What is a verb?",
    "Define gravity.",
    "What is 7 times 8?",
    "Who wrote Hamlet?",
    "What is a comet?",
)
LONG = (
    "I am planning a small vegetable garden on a sunny balcony in a city apartment. "
    "Explain which vegetables grow well in containers and how often to water them.",
    "My team keeps missing deadlines because tasks are vague and priorities change every week. "
    "Suggest a simple way to plan our work so that we finish what we start.",
    "Explain how a refrigerator keeps food cold, step by step, for someone who has never "
    "studied physics, and say why the back of it feels warm.",
    "I want to learn to run five kilometres without stopping. I can run for two minutes now. "
    "Describe a gentle plan for the next six weeks.",
    "Describe the water cycle for a class of ten-year-olds, with an example from everyday "
    "life that they can see at home or at school.",
    "Compare trains and planes for a trip of about five hundred kilometres: time, cost, "
    "comfort and the environment. Which would you choose and why?",
    "Explain what a budget is and how a student with a part-time job can make one that "
    "leaves some money for savings every month.",
    "Tell me how bread rises at home, what the yeast in the dough does, and why the dough "
    "needs to rest in a warm place for an hour before it goes into the oven.",
    "Write a friendly paragraph welcoming new members to a neighbourhood book club and "
    "explaining how the monthly meetings work.",
    "Explain why the seasons change over the year, and why it is summer in Australia when "
    "it is winter in Europe.",
)


def _log(msg: str) -> None:
    print(f"[edge {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    requests: int = 40
    synth_requests: int = 8  # its hand-offs are refused: enough to show it
    concurrency: int = 4
    max_tokens: int = 48
    after_tokens: int = 16
    center_delay_ms: int = 900  # the slow center: the delay line before llama.cpp
    center_ttft_ms: int = 900  # the synthetic center
    center_itl_ms: int = 20
    max_prompt_tokens: int = 16  # short_prompts: at most this many prompt tokens, counted here
    heartbeat_s: float = 0.25  # the edge's: pings inside a long seam show it stays warm
    seam_requests: int = 30  # the seam cases (edge, synth-*, seam): answers a case
    tier_delay_ms: int = 50  # between the tiers for the seam cases, each way (a delay line)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            requests=3,
            synth_requests=2,
            concurrency=2,
            max_tokens=16,
            after_tokens=4,
            seam_requests=3,
        )


@dataclass(slots=True)
class Seen:
    """One stream as the client saw it: content chunks and heartbeats with their times."""

    kind: str
    prompt: str = ""
    t_sent: float = 0.0
    t_end: float = 0.0
    stream: str | None = None
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    pings: list[float] = field(default_factory=list)
    finish: str | None = None
    done: bool = False
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.done and self.finish is not None and self.error is None


async def stream_chat(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    kind: str,
    max_tokens: int,
    synthetic: dict[str, Any] | None = None,
) -> Seen:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    if synthetic:
        body["synthetic"] = synthetic
    seen = Seen(kind, prompt)
    seen.t_sent = time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                seen.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return seen
            event = ""
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if line.startswith(":"):
                    seen.pings.append(now)
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    _data(seen, event, line[5:].strip(), now)
                elif not line:
                    event = ""
    except httpx.HTTPError as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
    seen.t_end = time.perf_counter()
    return seen


def _data(seen: Seen, event: str, data: str, now: float) -> None:
    if data == "[DONE]":
        seen.done = True
        return
    chunk = json.loads(data)
    if event == "error" or "error" in chunk:
        seen.error = seen.error or data[:300]
        return
    if chunk.get("id"):
        seen.stream = str(chunk["id"]).removeprefix("chatcmpl-")
    for choice in chunk.get("choices") or ():
        text = (choice.get("delta") or {}).get("content")
        if text:
            seen.texts.append(text)
            seen.times.append(now)
        if choice.get("finish_reason"):
            seen.finish = choice["finish_reason"]


async def drive(
    url: str,
    model: str,
    work: Sequence[tuple[str, str]],
    sizes: Sizes,
    synthetic: dict[str, Any] | None = None,
) -> list[Seen]:
    """Every (kind, prompt), `sizes.concurrency` at a time."""
    slots = asyncio.Semaphore(sizes.concurrency)
    timeout = httpx.Timeout(300.0, connect=5.0)
    async with httpx.AsyncClient(timeout=timeout) as http:

        async def one(kind: str, prompt: str) -> Seen:
            async with slots:
                return await stream_chat(
                    http, url, model, prompt, kind, sizes.max_tokens, synthetic
                )

        return list(await asyncio.gather(*(one(k, p) for k, p in work)))


# --- the delay line ---------------------------------------------------------------------------


class DelayLine:
    """A TCP proxy that delivers every byte towards the target `delay_s` late (order kept),
    and the answers at once: the target starts each request that much later, as a center
    whose queue and prefill take that long would."""

    def __init__(self, target_port: int, delay_s: float, back_s: float = 0.0) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.back_s = back_s  # the answers' way back, as late (0: at once)
        self.server: asyncio.Server | None = None
        self.port = 0
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self._handlers.add(me)
        me.add_done_callback(self._handlers.discard)
        loop = asyncio.get_running_loop()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def take() -> None:  # client → line, stamped with when it may go on
            while True:
                data = await reader.read(65536)
                line.put_nowait((loop.time() + self.delay_s, data))
                if not data:
                    return

        async def give() -> None:  # line → target, each piece at its time
            while True:
                due, data = await line.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    up_writer.close()
                    return
                up_writer.write(data)
                await up_writer.drain()

        returns: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def back() -> None:  # target → client, `back_s` late (order kept)
            while data := await up_reader.read(65536):
                if not self.back_s:
                    writer.write(data)
                    await writer.drain()
                    continue
                returns.put_nowait((loop.time() + self.back_s, data))
            returns.put_nowait((loop.time() + self.back_s, b""))
            if not self.back_s:
                writer.close()

        async def home() -> None:
            while self.back_s:
                due, data = await returns.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.create_task(t()) for t in (take, give, back, home)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            pass  # stop(): a handler that ends cancelled is logged by asyncio's streams
        finally:
            for t in tasks:
                t.cancel()
            writer.close()
            up_writer.close()


# --- figures ----------------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


def figures(
    seen: Sequence[Seen], events: Sequence[dict[str, Any]], center_ttft: dict[str, float]
) -> dict[str, Any]:
    """One case's figures from the client's streams, the edge's `route.*` log lines and the
    center's own first-token times (by the edge's stream id, its trace id there)."""
    ok = [s for s in seen if s.completed]
    by_id = {s.stream: s for s in seen if s.stream}
    seams = {
        e["stream"]: int(e.get("at_token") or 0)
        for e in events
        if e.get("event") == "route.handoff"
    }
    ttft = [(s.times[0] - s.t_sent) * 1000 for s in ok if s.times]
    total = [(s.t_end - s.t_sent) * 1000 for s in ok]
    gaps: list[float] = []
    ratios: list[float] = []
    pings: list[int] = []
    after_sentence = unmatched = 0
    samples: list[str] = []
    for stream, k in seams.items():
        s = by_id.get(stream)
        if s is None or not 0 < k < len(s.times):
            unmatched += 1
            continue
        a, b = s.times[k - 1], s.times[k]
        gaps.append((b - a) * 1000)
        pings.append(sum(a < t < b for t in s.pings))
        steps = enumerate(zip(s.times, s.times[1:], strict=False))
        others = [(y - x) * 1000 for i, (x, y) in steps if i != k - 1]
        if others:
            ratios.append(gaps[-1] / max(statistics.median(others), 0.001))
        before = "".join(s.texts[:k])
        after_sentence += bool(SENTENCE_END.search(before))
        if len(samples) < 4:
            samples.append(f"{before[-60:]}‖{''.join(s.texts[k:])[:50]}".replace("\n", "⏎"))
    itl = [
        (y - x) * 1000
        for s in ok
        for i, (x, y) in enumerate(zip(s.times, s.times[1:], strict=False))
        if i != seams.get(s.stream or "", 0) - 1
    ]
    # Over the whole answer: every gap between two content chunks, and each answer's longest.
    all_gaps = [
        (y - x) * 1000 for s in ok for x, y in zip(s.times, s.times[1:], strict=False)
    ]
    longest = [
        max((y - x) * 1000 for x, y in zip(s.times, s.times[1:], strict=False))
        for s in ok
        if len(s.times) > 1
    ]
    return {
        "requests": len(seen),
        "completed": len(ok),
        "chunk_gap_ms_p99": _pct(all_gaps, 99),
        "longest_pause_ms_p50": _pct(longest, 50),
        "longest_pause_ms_max": max(longest) if longest else None,
        "errors": sorted({s.error[:160] for s in seen if s.error}),
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "total_ms_p50": _pct(total, 50),
        "total_ms_p99": _pct(total, 99),
        "chunks_p50": _pct([len(s.times) for s in ok], 50),
        "itl_ms_p50": _pct(itl, 50),
        "handoffs": len(gaps),
        "at_token_p50": _pct(list(seams.values()), 50),
        "at_token_max": max(seams.values()) if seams else None,
        "handoffs_unmatched": unmatched,
        "fallbacks": sum(e.get("event") == "route.handoff_fallback" for e in events),
        "refusals": sorted(
            {
                str(e.get("code"))
                for e in events
                if e.get("event") == "route.target_failed" and e.get("at_token")
            }
        ),
        "gap_ms_p50": _pct(gaps, 50),
        "gap_ms_p99": _pct(gaps, 99),
        "gap_ms_max": max(gaps) if gaps else None,
        "gap_over_itl_p50": _pct(ratios, 50),
        "center_ttft_ms_p50": _pct([center_ttft[x] for x in seams if x in center_ttft], 50),
        "pings_in_gap_p50": _pct(pings, 50),
        "seam_after_sentence_end": after_sentence,
        "seams": samples,
    }


def _ttfts(server: ServerProcess, offset: int) -> dict[str, float]:
    """A server's first-token times since `offset`, by trace id (the edge's stream id)."""
    out: dict[str, float] = {}
    with server.log.open("rb") as f:
        f.seek(offset)
        for line in f.read().splitlines():
            if b'"stream.finished"' in line:
                record = json.loads(line)
                if record.get("trace_id") and record.get("ttft_ms") is not None:
                    out[record["trace_id"]] = float(record["ttft_ms"])
    return out


def _streams(server: ServerProcess) -> float:
    metrics = server.metrics().items()
    return sum(v for k, v in metrics if k.startswith("firsttoken_streams_total{"))


# --- the deployment ---------------------------------------------------------------------------


def routes_toml(centers: dict[str, tuple[str, str]], sizes: Sizes) -> str:
    """The edge's routes file: the small model in process, each center (url, model), a route
    per case."""
    out = ["[targets.small]", 'kind = "llamacpp"', ""]
    for name, (url, model) in centers.items():
        # llama-cpp-python cannot continue a final assistant message: the gateway renders the
        # chat (ChatML) and asks its /v1/completions.
        how = "completions" if name == "lcpp" else "vllm"
        out += [
            f"[targets.{name}-center]",
            'kind = "openai"',
            f'url = "{url}/v1"',
            f'model = "{model}"',
            f'continuation = "{how}"',
            "first_token_timeout_s = 120",
            "",
        ]
    n = sizes.after_tokens
    for name in centers:
        out += [f"[models.{name}]", f'targets = ["{name}-center"]', ""]
        for at in ("tokens", "sentence"):
            out += [
                f"[models.{name}-{at}]",
                f'targets = ["{name}-center"]',
                f'handoff = {{ from = "small", after_tokens = {n}, at = "{at}"{BY_COUNT} }}',
                "",
            ]
        # The hand-off without a seam: prefilled, paced, by time (at most 2/3 of the answer).
        out += [
            f"[models.{name}-seam]",
            f'targets = ["{name}-center"]',
            f'handoff = {{ from = "small", after_tokens = {sizes.max_tokens * 2 // 3} }}',
            "",
            # The same without the prefill: what the prefill itself costs and buys.
            f"[models.{name}-noprefill]",
            f'targets = ["{name}-center"]',
            f'handoff = {{ from = "small", after_tokens = {sizes.max_tokens * 2 // 3}'
            ", prefill = false }",
            "",
        ]
    out += ["[models.edge]", 'targets = ["small"]', ""]
    short = f'short_prompts = {{ target = "small", max_prompt_tokens = {sizes.max_prompt_tokens} }}'
    out += ["[models.mix]", 'targets = ["slow-center"]', short, ""]
    out += [
        "[models.mix-handoff]",
        'targets = ["slow-center"]',
        short,
        f'handoff = {{ from = "small", after_tokens = {n}, at = "sentence"{BY_COUNT} }}',
    ]
    return "\n".join(out) + "\n"


def canned_toml() -> str:
    return "[answers]\n" + "".join(f'"{k}" = "{v}"\n' for k, v in CANNED.items())


# llama-cpp-python takes its thread counts from multiprocessing.cpu_count() (half for decoding,
# all for prompts), and the engine has no knob for them. Two llama.cpp processes at those
# defaults on this 2-core machine slowed each other ×5-11 (48 tokens: 4.7-11.5 s, 1.0 alone);
# at one thread each ×1.7. Edge and center would be separate machines: one thread each.
ONE_THREAD = (
    "import multiprocessing, runpy; multiprocessing.cpu_count = lambda: 1; "
    "runpy.run_module('firsttoken', run_name='__main__', alter_sys=True)"
)


def _serve(name: str, args: Sequence[str], logs: Path, cwd: Path = ROOT) -> Process:
    port = _free_port()
    start = ["-c", ONE_THREAD] if "llamacpp" in args or name == "edge" else ["-m", "firsttoken"]
    cmd = [sys.executable, *start, "serve", "--port", str(port), *args, *OPEN]
    return Process(name, cmd, logs, cwd=cwd)


def _work(n: int) -> list[tuple[str, str]]:
    return [("long", LONG[i % len(LONG)]) for i in range(n)]


def _unique(n: int, tag: str = "") -> list[tuple[str, str]]:
    """Long prompts made unique, at their start (a prefix cache holds no earlier answer's
    prompt, nor another case's)."""
    return [("long", f"(Question {i + 1}{tag}.) {LONG[i % len(LONG)]}") for i in range(n)]


def _mix(n: int) -> list[tuple[str, str]]:
    kinds = ("greeting", "short", "long")
    pools = {"greeting": GREETINGS, "short": SHORT, "long": LONG}
    return [
        (kinds[i % 3], pools[kinds[i % 3]][(i // 3) % len(pools[kinds[i % 3]])]) for i in range(n)
    ]


async def run_case(
    edge: ServerProcess,
    center: ServerProcess | LlamaCppServer,
    model: str,
    work: Sequence[tuple[str, str]],
    sizes: Sizes,
) -> dict[str, Any]:
    ours = not isinstance(center, LlamaCppServer)  # a firsttoken: its log and metrics
    offset, center_offset = edge.log.stat().st_size, center.log.stat().st_size
    before = _streams(center) if ours else 0.0
    canned_before = edge.metrics().get("firsttoken_canned_answers_total", 0.0)
    t0 = time.perf_counter()
    seen = await drive(edge.url, model, work, sizes, _knobs(model))
    wall = time.perf_counter() - t0
    await asyncio.sleep(0.3)  # the last lines reach the log
    events = gateway_events(edge.log, offset)
    ttfts = _ttfts(center, center_offset) if ours else {}
    row = {"case": model, "wall_s": wall, **figures(seen, events, ttfts)}
    if model.startswith("synth"):
        row["seam_text_exact"] = await seam_texts(center.url, seen, events, sizes)
    elif model.startswith("lcpp"):
        row["seam_text_exact"] = await lcpp_seam_texts(center.url, seen, events, sizes)
    row["center_streams"] = _streams(center) - before if ours else None
    row["canned"] = edge.metrics().get("firsttoken_canned_answers_total", 0.0) - canned_before
    # A stream whose edge leg reached the hand-off point asked the center (whether or not
    # the center took it); one without a hand-off line of any kind stayed at the edge.
    asked = {
        e["stream"] for e in events if e.get("event") in ("route.handoff", "route.handoff_fallback")
    }
    kinds: dict[str, dict[str, int]] = {}
    for s in seen:
        k = kinds.setdefault(s.kind, {"requests": 0, "center_asked": 0})
        k["requests"] += 1
        k["center_asked"] += s.stream in asked
    row["by_kind"] = kinds
    return row


async def run_interleaved(
    edge: ServerProcess,
    cases: Sequence[tuple[str, ServerProcess | LlamaCppServer, list[tuple[str, str]]]],
    sizes: Sizes,
) -> list[dict[str, Any]]:
    """One answer of each case in turn, round after round (one at a time): on a shared
    machine whose load drifts, every case meets the same load."""
    offset = edge.log.stat().st_size
    seen: dict[str, list[Seen]] = {model: [] for model, _, _ in cases}
    t0 = time.perf_counter()
    rounds = max(len(work) for _, _, work in cases)
    for i in range(rounds):
        for model, _, work in cases:
            if i < len(work):
                seen[model] += await drive(edge.url, model, [work[i]], sizes, _knobs(model))
        if (i + 1) % 10 == 0:
            _log(f"  round {i + 1}/{rounds}")
    wall = time.perf_counter() - t0
    await asyncio.sleep(0.3)  # the last lines reach the log
    events = gateway_events(edge.log, offset)
    rows = []
    for model, center, _ in cases:
        ids = {s.stream for s in seen[model]}
        mine = [e for e in events if e.get("stream") in ids]
        row = {"case": model, "wall_s": wall, **figures(seen[model], mine, {})}
        if model.startswith("synth"):
            row["seam_text_exact"] = await seam_texts(center.url, seen[model], mine, sizes)
        elif model.startswith("lcpp"):
            row["seam_text_exact"] = await lcpp_seam_texts(center.url, seen[model], mine, sizes)
        row["center_streams"] = None
        row["canned"] = 0.0
        row["by_kind"] = {}
        rows.append(row)
        _log(
            f"{model}: {row['completed']}/{row['requests']} completed, TTFT p50 "
            f"{_f(row['ttft_ms_p50'])} ms, longest pause p50 {_f(row['longest_pause_ms_p50'])}"
        )
    return rows


def _knobs(model: str) -> dict[str, Any] | None:
    if model.startswith("synth"):
        return SEAM_KNOBS if model.endswith("-seam") else SYNTH_KNOBS
    return None


async def seam_texts(
    center_url: str, seen: Sequence[Seen], events: Sequence[dict[str, Any]], sizes: Sizes
) -> str:
    """For each handed-off answer: is the text after the seam the center's own continuation
    of exactly the text before it? (The center asked again, directly, for that.)"""
    seams = {e["stream"]: int(e["at_token"]) for e in events if e.get("event") == "route.handoff"}
    exact = asked = 0
    async with httpx.AsyncClient(timeout=60) as http:
        for s in seen:
            k = seams.get(s.stream or "")
            if not s.completed or not k:
                continue
            asked += 1
            before, after = "".join(s.texts[:k]), "".join(s.texts[k:])
            body = {
                "model": "synthetic",
                "messages": [
                    {"role": "user", "content": s.prompt},
                    {"role": "assistant", "content": before},
                ],
                "continue_final_message": True,
                "add_generation_prompt": False,
                "max_tokens": sizes.max_tokens - k,
                "synthetic": SYNTH_KNOBS,
            }
            resp = await http.post(center_url + "/v1/chat/completions", json=body)
            exact += resp.json()["choices"][0]["message"]["content"] == after
    return f"{exact}/{asked}"


async def lcpp_seam_texts(
    center_url: str, seen: Sequence[Seen], events: Sequence[dict[str, Any]], sizes: Sizes
) -> str:
    """As `seam_texts`, for llama-cpp-python: its greedy /v1/completions on the ChatML
    rendering of the conversation with the text before the seam left open (what the edge
    asked it)."""
    seams = {e["stream"]: int(e["at_token"]) for e in events if e.get("event") == "route.handoff"}
    exact = asked = 0
    async with httpx.AsyncClient(timeout=120) as http:
        for s in seen:
            k = seams.get(s.stream or "")
            if not s.completed or not k:
                continue
            asked += 1
            before, after = "".join(s.texts[:k]), "".join(s.texts[k:])
            messages = [
                {"role": "user", "content": s.prompt},
                {"role": "assistant", "content": before},
            ]
            body = {
                "model": LCPP_ALIAS,
                "prompt": render_open_chat(messages, "chatml"),
                "max_tokens": sizes.max_tokens - k,
                "temperature": 0,
            }
            resp = await http.post(center_url + "/v1/completions", json=body)
            exact += resp.json()["choices"][0]["text"] == after
    return f"{exact}/{asked}"


class LlamaCppServer:
    """`python -m llama_cpp.server` (llama-cpp-python's own OpenAI-compatible server) with
    the bundled SmolLM2, one thread: a center that is not a firsttoken."""

    def __init__(self, logs: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = logs / "lcpp-center.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LlamaCppServer:
        from firsttoken.engines.llamacpp import default_model_path

        cmd = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(default_model_path()),
            "--model_alias",
            LCPP_ALIAS,
            "--chat_format",
            "chatml",
            "--n_threads",
            "1",
            "--n_threads_batch",
            "1",
            # Its default cuts a running answer off when another request comes: the edge's
            # prefill for one answer would cut another's continuation.
            "--interrupt_requests",
            "False",
            "--port",
            str(self.port),
        ]
        with self.log.open("wb") as sink:
            self.proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"llama-cpp-python server not ready (see {self.log})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


CASES = (
    "edge",
    "synth-seam",
    "lcpp",
    "lcpp-tokens",
    "lcpp-seam",
    "lcpp-noprefill",
    "synth-noprefill",
    "slow-seam",
    "slow",
    "slow-tokens",
    "slow-sentence",
    "llama",
    "llama-tokens",
    "llama-sentence",
    "mix",
    "mix-handoff",
    "synth",
    "synth-tokens",
)


async def bench(
    sizes: Sizes,
    out: Path,
    edge_root: Path = ROOT,
    only: Sequence[str] = CASES,
    interleave: bool = False,
) -> dict[str, Any]:
    logs = out / "edge-logs"
    logs.mkdir(parents=True, exist_ok=True)
    synth_args = [
        "--synthetic-ttft-ms",
        str(sizes.center_ttft_ms),
        "--synthetic-itl-ms",
        str(sizes.center_itl_ms),
    ]
    procs = {
        "llama": _serve("llama-center", ["--engine", "llamacpp"], logs),
        "synth": _serve("synth-center", synth_args, logs),
    }
    servers = {name: p.start() for name, p in procs.items()}
    lcpp = LlamaCppServer(logs).start() if any(c.startswith("lcpp") for c in only) else None
    line: DelayLine | None = None
    tier_line: DelayLine | None = None
    lcpp_line: DelayLine | None = None
    edge_proc: Process | None = None
    res: dict[str, Any] = {"runs": []}
    try:
        for s in servers.values():
            await asyncio.to_thread(s.wait_ready, 180.0)
        line = DelayLine(servers["llama"].port, sizes.center_delay_ms / 1000)
        await line.start()
        # No netem in this kernel: the synthetic center sits behind a delay line both ways.
        tier = sizes.tier_delay_ms / 1000
        tier_line = DelayLine(servers["synth"].port, tier, back_s=tier)
        await tier_line.start()
        centers = {
            "slow": (f"http://127.0.0.1:{line.port}", LLAMA_MODEL),
            "llama": (servers["llama"].url, LLAMA_MODEL),
            "synth": (f"http://127.0.0.1:{tier_line.port}", "synthetic"),
        }
        if lcpp is not None:
            await asyncio.to_thread(lcpp.wait_ready, 180.0)
            lcpp_line = DelayLine(lcpp.port, tier, back_s=tier)
            await lcpp_line.start()
            centers["lcpp"] = (f"http://127.0.0.1:{lcpp_line.port}", LCPP_ALIAS)
        routes, canned = logs / "routes.toml", logs / "canned.toml"
        routes.write_text(routes_toml(centers, sizes))
        canned.write_text(canned_toml())
        args = [
            "--routes",
            str(routes),
            "--canned-answers",
            str(canned),
            "--heartbeat-s",
            str(sizes.heartbeat_s),
        ]
        edge_proc = _serve("edge", args, logs, edge_root)
        edge = edge_proc.start()
        await asyncio.to_thread(edge.wait_ready, 180.0)
        _log(f"edge {edge.url}; llama.cpp center {servers['llama'].url} (slow: :{line.port})")
        cases: list[tuple[str, ServerProcess | LlamaCppServer, list[tuple[str, str]]]] = []
        for model in only:
            tag = chr(ord("a") + len(cases)) if interleave else ""
            if model.startswith("synth") or model == "edge":
                cases.append((model, servers["synth"], _unique(sizes.seam_requests, tag)))
            elif model.startswith("lcpp"):
                assert lcpp is not None
                cases.append((model, lcpp, _unique(sizes.seam_requests, tag)))
            elif model.startswith("mix"):
                cases.append((model, servers["llama"], _mix(sizes.requests)))
            else:
                cases.append((model, servers["llama"], _work(sizes.requests)))
        if interleave:
            res["runs"] = await run_interleaved(edge, cases, sizes)
            cases = []
        for model, center, work in cases:
            _log(f"case {model}: {len(work)} streams, {sizes.concurrency} at once")
            row = await run_case(edge, center, model, work, sizes)
            res["runs"].append(row)
            _log(
                f"  {row['completed']}/{row['requests']} completed, TTFT p50 "
                f"{_f(row['ttft_ms_p50'])} ms, hand-offs {row['handoffs']}, "
                f"fallbacks {row['fallbacks']}, {row['wall_s']:.1f} s"
            )
    finally:
        if edge_proc is not None:
            edge_proc.stop()
        if line is not None:
            await line.stop()
        if tier_line is not None:
            await tier_line.stop()
        if lcpp_line is not None:
            await lcpp_line.stop()
        if lcpp is not None:
            lcpp.stop()
        for p in procs.values():
            p.stop()
    return res


# --- report -----------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def render(res: dict[str, Any]) -> str:
    rows = res["runs"]
    sizes = res["meta"]["sizes"]
    lines = [
        "EDGE AND CENTER  " + "  ".join(f"{k}={v}" for k, v in sizes.items()),
        f"{'':30}" + "".join(f"{r['case']:>15}" for r in rows),
    ]

    def add(label: str, cell: Any) -> None:
        lines.append(f"{label:30}" + "".join(f"{cell(r):>15}" for r in rows))

    def pair(r: dict[str, Any], a: str, b: str) -> str:
        return f"{_f(r[a])} / {_f(r[b])}"

    add("completed", lambda r: f"{r['completed']}/{r['requests']}")
    add("TTFT p50 / p99 ms", lambda r: pair(r, "ttft_ms_p50", "ttft_ms_p99"))
    add("total p50 / p99 ms", lambda r: pair(r, "total_ms_p50", "total_ms_p99"))
    add("chunks p50", lambda r: _f(r["chunks_p50"]))
    add("gap between chunks p99 ms", lambda r: _f(r["chunk_gap_ms_p99"]))
    add(
        "longest pause p50 / max ms",
        lambda r: pair(r, "longest_pause_ms_p50", "longest_pause_ms_max"),
    )
    add("seam text exact", lambda r: r.get("seam_text_exact", ""))
    add("gap between chunks p50 ms", lambda r: _f(r["itl_ms_p50"], "{:.1f}"))
    add("hand-offs / fallbacks", lambda r: f"{r['handoffs']} / {r['fallbacks']}")
    add("hand-off at token p50 / max", lambda r: pair(r, "at_token_p50", "at_token_max"))
    add("gap at hand-off p50 / p99 ms", lambda r: pair(r, "gap_ms_p50", "gap_ms_p99"))
    add("gap at hand-off max ms", lambda r: _f(r["gap_ms_max"]))
    add("gap / own gap p50", lambda r: _f(r["gap_over_itl_p50"], "{:.0f}x"))
    add("center's own TTFT there p50", lambda r: _f(r["center_ttft_ms_p50"]))
    add("heartbeats in the gap p50", lambda r: _f(r["pings_in_gap_p50"]))
    add("seam after a sentence end", lambda r: f"{r['seam_after_sentence_end']}/{r['handoffs']}")
    add("streams the center saw", lambda r: _f(r["center_streams"]))
    add("wall s", lambda r: _f(r["wall_s"], "{:.1f}"))
    for r in rows:
        if r["case"].startswith("mix"):
            lines.append(
                f"{r['case']}, by kind of prompt (how many asked the center at a hand-off):"
            )
            for kind, k in r["by_kind"].items():
                lines.append(f"  {kind:9} {k['requests']:>4}, center asked {k['center_asked']}")
            edge_only = r["requests"] - r["center_streams"]
            lines.append(
                f"  answered wholly at the edge: {edge_only:.0f}/{r['requests']} "
                f"({edge_only / r['requests']:.0%}); canned {r['canned']:.0f}"
            )
    lines.append("seams (before ‖ the edge's text, after it the center's):")
    for r in rows:
        for sample in r["seams"][:2]:
            lines.append(f"  {r['case']:15} …{sample}…")
    for r in rows:
        if r["errors"] or r["refusals"]:
            lines.append(f"  {r['case']}: errors {r['errors']}, center refused {r['refusals']}")
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="3 streams a case, 16 tokens")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--synth-requests", type=int)
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--after-tokens", type=int)
    ap.add_argument("--center-delay-ms", type=int)
    ap.add_argument("--seam-requests", type=int)
    ap.add_argument("--tier-delay-ms", type=int, help="between the tiers, each way")
    ap.add_argument(
        "--interleave", action="store_true", help="one answer of each case in turn (one at a time)"
    )
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: %(default)s")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--edge-root", type=Path, default=ROOT, help="run the edge from this tree (a patched copy)"
    )
    args = ap.parse_args(argv)
    only = [c for c in args.cases.split(",") if c]
    if unknown := set(only) - set(CASES):
        ap.error(f"--cases: unknown {sorted(unknown)}")
    sizes = Sizes.quick() if args.quick else Sizes()
    given = {
        k: getattr(args, k)
        for k in (
            "requests",
            "synth_requests",
            "concurrency",
            "max_tokens",
            "after_tokens",
            "center_delay_ms",
            "seam_requests",
            "tier_delay_ms",
        )
        if getattr(args, k) is not None
    }
    sizes = Sizes(**{**asdict(sizes), **given})
    args.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "sizes": asdict(sizes),
    }
    if args.edge_root.resolve() != ROOT:
        meta["edge_root"] = str(args.edge_root)
    if args.interleave:
        meta["interleaved"] = True
    res = asyncio.run(bench(sizes, args.out, args.edge_root.resolve(), only, args.interleave))
    res["meta"] = {**meta, "loadavg_end": os.getloadavg()}
    (args.out / "edge.json").write_text(json.dumps(res, indent=2, ensure_ascii=False))
    print(render(res))


if __name__ == "__main__":
    main()
