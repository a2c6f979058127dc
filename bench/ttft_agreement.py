"""An outside client's TTFT against the server's own: AIPerf vs firsttoken's log and histogram.

    .venv/bin/python -m bench.ttft_agreement [--quick] [--levels 1,10] [--requests N] [--setup]
    .venv/bin/python -m bench.ttft_agreement --floor --pin --levels 10 --rounds 2

One `firsttoken serve` (synthetic engine, TTFT 200 ms, ITL 20 ms, admission control off) on a
loopback port; AIPerf (NVIDIA's LLM benchmark client) runs one streaming chat profile against it
per concurrency level. For the same requests (AIPerf sends `X-Request-ID`, which firsttoken takes
as the trace id) three TTFTs are compared:

- client: AIPerf's own export (`profile_export_aiperf.json`, time_to_first_token p50/p90/p99):
  from just before aiohttp starts the request to the first SSE chunk whose delta has non-empty
  content (the role chunk `delta: {role, content: ""}` does not count; no tokenizer involved);
- server: the exact percentiles of the `ttft_ms` that `stream.first_token` logs per stream
  (the server runs at `--log-level debug` for those lines), from the request's first byte
  (`on_message_begin`) to the engine's first token;
- histogram: `firsttoken_ttft_seconds` from /metrics, scraped before and after the level,
  interpolated inside its bucket (as Prometheus' histogram_quantile does).

Verdict per level: |client p50 - server p50| <= max(2% of the client p50, 1 ms).

`--floor` runs the same AIPerf profiles against the reference floor too (`uvicorn_floor`:
uvicorn, one shared ticker, logging its own TTFT from the request's first byte as firsttoken
does, `--log-ttft`), the two servers' rounds interleaved (`--rounds`, the order turning each
round); the verdict is then firsttoken's client - server p50 gap against the floor's: at most
2 ms more (median over rounds). `--pin` puts AIPerf (and its workers) on the first core and
the servers on the others, so neither's loop runs the other's work.

Where a gap comes from, per request: both processes stamp wall time on the same host (AIPerf's
`request_start_ns` and per-chunk perf_ns in its raw export; the server's `ts` at the first
token), so the gap splits into `pre` (client start -> server's first byte: aiohttp's request
path, plus the TCP connect on a cold connection) and `post` (server's first token -> AIPerf has
parsed it: the write path, loopback, AIPerf's read loop and SSE parser). Cold and reused
connections are reported apart. A lean raw-socket client (one keep-alive connection, clock
started at the write) then runs a few streams, for scale: its pre bounds what the server's
clock cannot see before the request's first byte.

AIPerf lives in its own venv, `.venv/aiperf` (like LiteLLM in `.venv/litellm` for
bench/proxies.py): it pins its own transformers/aiohttp/numpy stack and is not a project
dependency. It is looked for in `--aiperf`, `$BENCH_AIPERF`, then `.venv/aiperf/bin/aiperf`;
`--setup` makes the venv (`python3.11 -m venv .venv/aiperf && .venv/aiperf/bin/pip install
aiperf==0.13.0`). AIPerf needs a tokenizer to synthesise prompts and count tokens, and the Hub
is not reachable here (`--tokenizer builtin` downloads tiktoken's BPE file on first use), so a
small byte-level BPE is trained once on the Shakespeare text AIPerf ships and kept in
`.venv/aiperf/firsttoken-tokenizer/`; it does not touch TTFT (AIPerf's TTFT is the first
non-empty content delta, not a token count).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.procs import ROOT, ServerProcess
from bench.servers import SERVERS, SUBJECT
from bench.stats import loadavg

AIPERF_VERSION = "0.13.0"
AIPERF_VENV = ROOT / ".venv" / "aiperf"
SETUP = f"python3.11 -m venv .venv/aiperf && .venv/aiperf/bin/pip install aiperf=={AIPERF_VERSION}"
TOKENIZER_DIR = AIPERF_VENV / "firsttoken-tokenizer"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
HIST = "firsttoken_ttft_seconds_bucket"
QUANTILES = (50, 90, 99)
REL_TOL, ABS_TOL_MS = 0.02, 1.0
OWN_FLAGS = ("--log-level", "debug", "--trust-trace-headers")
OVER_FLOOR_MS = 2.0  # firsttoken's client-server gap may exceed the floor's by this much

# Run inside .venv/aiperf: train a byte-level BPE on the text AIPerf ships (offline, ~2 s).
_TOKENIZER_CODE = """
import sys
from pathlib import Path
import aiperf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
corpus = Path(aiperf.__file__).parent / "dataset" / "generator" / "assets" / "shakespeare.txt"
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=2000,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    special_tokens=["<|endoftext|>"],
    show_progress=False,
)
tok.train([str(corpus)], trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
fast.save_pretrained(sys.argv[1])
"""


def _log(msg: str) -> None:
    print(f"[ttft_agreement {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    ttft_ms: float = 200.0
    itl_ms: float = 20.0
    tokens: int = 10  # max_completion_tokens per request: TTFT is the point, keep streams short
    prompt_tokens: int = 64
    levels: tuple[int, ...] = (1, 10)
    requests: tuple[tuple[int, int], ...] = ((1, 200), (10, 400))
    default_requests: int = 200
    lean: int = 50  # streams of the lean raw-socket client after the AIPerf levels (0: none)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            ttft_ms=50.0, itl_ms=5.0, tokens=5, levels=(1, 4), requests=((1, 30), (4, 40)), lean=20
        )

    def requests_at(self, level: int) -> int:
        return dict(self.requests).get(level, self.default_requests)

    @property
    def stream_s(self) -> float:
        return (self.ttft_ms + self.tokens * self.itl_ms) / 1000


# --- AIPerf: where it is, its tokenizer, one profile -------------------------------------------


def find_aiperf(given: str | None) -> Path | None:
    for c in (given, os.environ.get("BENCH_AIPERF"), str(AIPERF_VENV / "bin" / "aiperf")):
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


def make_venv() -> Path:
    _log(f"making {AIPERF_VENV} with aiperf=={AIPERF_VERSION} (a few minutes)")
    subprocess.run(["python3.11", "-m", "venv", str(AIPERF_VENV)], check=True)
    pip = AIPERF_VENV / "bin" / "pip"
    subprocess.run([str(pip), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return AIPERF_VENV / "bin" / "aiperf"


def aiperf_version(binary: Path) -> str | None:
    code = "import importlib.metadata as m; print(m.version('aiperf'))"
    try:
        out = subprocess.run(
            [str(binary.parent / "python"), "-c", code], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def ensure_tokenizer(binary: Path) -> Path:
    if (TOKENIZER_DIR / "tokenizer.json").is_file():
        return TOKENIZER_DIR
    _log(f"training a local tokenizer for AIPerf into {TOKENIZER_DIR}")
    subprocess.run(
        [str(binary.parent / "python"), "-c", _TOKENIZER_CODE, str(TOKENIZER_DIR)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return TOKENIZER_DIR


def _client_env() -> dict[str, str]:
    # aiohttp may honour proxy variables: loopback traffic goes straight to the server.
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy")}
    env.update(
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_aiperf(
    binary: Path,
    tokenizer: Path,
    url: str,
    level: int,
    n: int,
    sizes: Sizes,
    art: Path,
    cpus: set[int] | None = None,
) -> float:
    """One `aiperf profile` of N streaming chat requests at LEVEL concurrent; returns seconds."""
    art.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(binary), "profile",
        "--model", "synthetic",
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(tokenizer),
        "--concurrency", str(level),
        "--request-count", str(n),
        "--prompt-input-tokens-mean", str(sizes.prompt_tokens),
        "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(sizes.tokens),
        "--prompt-output-tokens-stddev", "0",
        "--random-seed", "13",
        "--request-timeout-seconds", "30",
        "--output-artifact-dir", str(art),
        "--export-level", "raw",  # per-chunk perf_ns, for the pre/post split
        "--ui-type", "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--no-auto-plot",
        # One worker and one record processor: fewer processes on a 2-core machine.
        "--workers-max", "1",
        "--record-processor-service-count", "1",
    ]  # fmt: skip
    budget = 120.0 + 3 * n / level * sizes.stream_s
    t0 = time.monotonic()
    with (art / "aiperf.out").open("wb") as sink:
        proc = subprocess.run(
            cmd,
            cwd=art,
            env=_client_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=budget,
            # Its worker processes inherit the core.
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )
    if proc.returncode != 0:
        tail = (art / "aiperf.out").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"aiperf exited {proc.returncode}:\n" + "\n".join(tail))
    return time.monotonic() - t0


# --- reading what each side recorded ------------------------------------------------------------


def read_client(art: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """AIPerf's summary TTFT, and per request id: its TTFT, connection, chunk timings."""
    summary = json.loads((art / "profile_export_aiperf.json").read_text())["time_to_first_token"]
    per: dict[str, dict[str, Any]] = {}
    for line in (art / "profile_export.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rid = rec["metadata"].get("x_request_id")
        m = rec.get("metrics") or {}
        if not rid or "time_to_first_token" not in m:
            continue
        per[rid] = {
            "client_ms": float(m["time_to_first_token"]["value"]),
            "reused": bool(m.get("http_req_connection_reused", {}).get("value", 0)),
            "connecting_ms": float(m.get("http_req_connecting", {}).get("value", 0.0)),
        }
    for line in (art / "profile_export_raw.jsonl").read_text().splitlines():
        rec = json.loads(line)
        row = per.get(rec["metadata"].get("x_request_id"))
        if row is None or not rec.get("responses"):
            continue
        start_perf, start_wall = rec["start_perf_ns"], rec["metadata"]["request_start_ns"]
        first = _first_content_ns(rec["responses"])
        row["start_wall_s"] = start_wall / 1e9
        row["role_ms"] = (rec["responses"][0]["perf_ns"] - start_perf) / 1e6
        if first is not None:
            row["first_wall_s"] = (start_wall + first - start_perf) / 1e9
    return summary, per


def _first_content_ns(responses: list[dict[str, Any]]) -> int | None:
    """perf_ns of the first SSE message whose delta has non-empty content (AIPerf's rule)."""
    for msg in responses:
        for packet in msg.get("packets") or ():
            if packet.get("name") != "data" or packet.get("value") in (None, "", "[DONE]"):
                continue
            try:
                choices = json.loads(packet["value"]).get("choices") or []
            except ValueError:
                continue
            if choices and (choices[0].get("delta") or {}).get("content"):
                return int(msg["perf_ns"])
    return None


def read_server(log: Path) -> dict[str, dict[str, float]]:
    """trace id -> {server_ms, first_wall_s} from the server's `stream.first_token` lines."""
    out: dict[str, dict[str, float]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"stream.first_token"' not in line:
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        out[ev["trace_id"]] = {"server_ms": float(ev["ttft_ms"]), "first_wall_s": float(ev["ts"])}
    return out


def histogram(server: ServerProcess) -> dict[float, float]:
    """Cumulative bucket counts of firsttoken_ttft_seconds, by upper edge in seconds."""
    out: dict[float, float] = {}
    for name, value in server.metrics().items():
        if name.startswith(HIST + "{"):
            edge = name.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if edge == "+Inf" else float(edge)] = value
    return out


def hist_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """Prometheus histogram_quantile over the counts added between two scrapes, in ms."""
    edges = sorted(after)
    cum = [after[e] - before.get(e, 0.0) for e in edges]
    total = cum[-1] if cum else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for edge, c in zip(edges, cum, strict=True):
        if c >= rank:
            if edge == float("inf"):
                return lower * 1000
            inside = c - below
            frac = (rank - below) / inside if inside > 0 else 1.0
            return (lower + (edge - lower) * frac) * 1000
        lower, below = edge, c
    return None


# --- one level ----------------------------------------------------------------------------------


def _pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def compare(
    level: int,
    summary: dict[str, Any],
    client: dict[str, dict[str, Any]],
    server: dict[str, dict[str, float]],
    before: dict[float, float],
    after: dict[float, float],
) -> dict[str, Any]:
    ids = [rid for rid in client if rid in server]
    srv = [server[r]["server_ms"] for r in ids]
    row: dict[str, Any] = {
        "concurrency": level,
        "aiperf_requests": int(summary.get("count") or len(client)),
        "matched": len(ids),
        "hist_count": round(after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)),
    }
    for q in QUANTILES:
        row[f"client_p{q}_ms"] = summary.get(f"p{q}")
        row[f"server_p{q}_ms"] = _pct(srv, q)
        row[f"hist_p{q}_ms"] = hist_quantile(q / 100, before, after)
    # AIPerf's p50 recomputed from its own records: the same method as the server's.
    row["client_p50_ms_records"] = _pct([client[r]["client_ms"] for r in ids], 50)
    c50, s50 = row["client_p50_ms"], row["server_p50_ms"]
    if c50 is not None and s50 is not None:
        diff = c50 - s50
        tol = max(REL_TOL * c50, ABS_TOL_MS)
        row.update(diff_ms=diff, diff_pct=100 * diff / c50, tol_ms=tol, ok=abs(diff) <= tol)
    # Where the per-request gap goes: pre (client start -> server's first byte) and post
    # (server's first token -> client parsed it), both on the host's wall clock.
    gap, pre, post, cold_gap, warm_gap, role = [], [], [], [], [], []
    for r in ids:
        c, s = client[r], server[r]
        g = c["client_ms"] - s["server_ms"]
        gap.append(g)
        (warm_gap if c["reused"] else cold_gap).append(g)
        if "role_ms" in c:
            role.append(c["role_ms"])
        if "first_wall_s" in c and "start_wall_s" in c:
            arrived = s["first_wall_s"] - s["server_ms"] / 1000
            pre.append((arrived - c["start_wall_s"]) * 1000)
            post.append((c["first_wall_s"] - s["first_wall_s"]) * 1000)
    for name, xs in (("gap", gap), ("pre", pre), ("post", post), ("warm_gap", warm_gap)):
        for q in QUANTILES:
            row[f"{name}_p{q}_ms"] = _pct(xs, q)
    row["cold"] = len(cold_gap)
    row["cold_gap_p50_ms"] = _pct(cold_gap, 50)
    row["cold_connecting_p50_ms"] = _pct(
        [client[r]["connecting_ms"] for r in ids if not client[r]["reused"]], 50
    )
    row["role_chunk_p50_ms"] = _pct(role, 50)
    return row


# --- a lean client, for scale ----------------------------------------------------------------


_TOKEN_FRAME = b'"delta":{"content":'  # a token chunk; the role chunk has "role" first


async def _lean(host: str, port: int, n: int, tokens: int) -> list[dict[str, float | str]]:
    """N sequential streams on one keep-alive connection, raw asyncio: the clock starts just
    before the request's bytes are written, and stops at the read holding the first token."""
    reader, writer = await asyncio.open_connection(host, port)
    out: list[dict[str, float | str]] = []
    try:
        for i in range(n):
            rid = f"lean-{uuid.uuid4()}"
            body = json.dumps(
                {
                    "model": "synthetic",
                    "messages": [{"role": "user", "content": f"lean probe {i}"}],
                    "stream": True,
                    "max_tokens": tokens,
                }
            ).encode()
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nX-Request-ID: {rid}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            buf, first = b"", 0.0
            wall, t0 = time.time(), time.perf_counter()
            writer.write(head + body)
            while not (buf.endswith(b"0\r\n\r\n") and b"[DONE]" in buf):
                chunk = await reader.read(65536)
                now = time.perf_counter()
                if not chunk:
                    raise RuntimeError("lean probe: the server closed the connection")
                buf += chunk
                if not first and _TOKEN_FRAME in buf:
                    first = now
            ms = (first - t0) * 1000
            out.append(
                {
                    "rid": rid,
                    "client_ms": ms,
                    "start_wall_s": wall,
                    "first_wall_s": wall + ms / 1000,
                }
            )
    finally:
        writer.close()
    return out


def lean_probe(url: str, n: int, tokens: int, log: Path) -> dict[str, Any]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    rows = asyncio.run(_lean(host, int(port), n, tokens))
    server = read_server(log)
    gap, pre, post = [], [], []
    for r in rows:
        s = server.get(str(r["rid"]))
        if s is None:
            continue
        gap.append(float(r["client_ms"]) - s["server_ms"])
        pre.append((s["first_wall_s"] - s["server_ms"] / 1000 - float(r["start_wall_s"])) * 1000)
        post.append((float(r["first_wall_s"]) - s["first_wall_s"]) * 1000)
    out: dict[str, Any] = {"requests": n, "matched": len(gap)}
    for name, xs in (("gap", gap), ("pre", pre), ("post", post)):
        for q in QUANTILES:
            out[f"{name}_p{q}_ms"] = _pct(xs, q)
    return out


# --- output -------------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def render(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [
        f"TTFT: AIPerf {meta.get('aiperf_version')} vs firsttoken's own "
        f"(synthetic TTFT {meta['sizes']['ttft_ms']:g} ms, ITL {meta['sizes']['itl_ms']:g} ms, "
        f"{meta['sizes']['tokens']} tokens; load {meta.get('loadavg_start')})",
        "",
        f"{'conc':>4} {'n':>5} {'':>4} {'client':>8} {'server':>8} {'hist':>8}  "
        f"{'diff ms':>8} {'diff %':>7} {'tol ms':>7}  verdict",
    ]
    for r in res["levels"]:
        if r.get("server", SUBJECT) != SUBJECT or r.get("round"):
            lines.append(f"{r['server']}, round {r['round']}:")
        for q in QUANTILES:
            head = f"{r['concurrency']:>4} {r['matched']:>5}" if q == 50 else " " * 10
            d = None
            if r[f"client_p{q}_ms"] is not None and r[f"server_p{q}_ms"] is not None:
                d = r[f"client_p{q}_ms"] - r[f"server_p{q}_ms"]
            pct = None if d is None else 100 * d / r[f"client_p{q}_ms"]
            tail = ""
            if q == 50:
                verdict = "PASS" if r.get("ok") else "FAIL"
                tail = f"{_f(r.get('tol_ms')):>7}  {verdict}"
            lines.append(
                f"{head} {'p' + str(q):>4} {_f(r[f'client_p{q}_ms']):>8} "
                f"{_f(r[f'server_p{q}_ms']):>8} {_f(r[f'hist_p{q}_ms']):>8}  "
                f"{_f(d, 3):>8} {_f(pct):>7} {tail:>13}".rstrip()
            )
    lines += [
        "",
        "client: AIPerf's export; server: exact percentiles of the logged ttft_ms for the same "
        "request ids; hist: firsttoken_ttft_seconds, interpolated in its bucket.",
        "Verdict: |client p50 - server p50| <= max(2% of client p50, 1 ms).",
        "",
        f"{'conc':>4}  per-request gap client-server p50/p90/p99 (ms)   pre p50   post p50   "
        "cold (n, gap p50, connect p50)   role chunk p50   server, round",
    ]
    for r in res["levels"]:
        lines.append(
            f"{r['concurrency']:>4}  {_f(r['gap_p50_ms'], 3):>8} / {_f(r['gap_p90_ms'], 3)} / "
            f"{_f(r['gap_p99_ms'], 3):<22} {_f(r['pre_p50_ms'], 3):>7}  "
            f"{_f(r['post_p50_ms'], 3):>8}   {r['cold']:>3}, {_f(r['cold_gap_p50_ms'], 3)}, "
            f"{_f(r['cold_connecting_p50_ms'], 3):<18} {_f(r['role_chunk_p50_ms'], 3):<16} "
            f"{r.get('server', SUBJECT)}, {r.get('round', 0)}"
        )
    lines += [
        "pre: AIPerf's start -> server's first byte; post: server's first token -> AIPerf parsed "
        "it (same host, wall clock); role chunk: AIPerf's time to the `delta: {role}` chunk, "
        "which neither side counts as the first token.",
    ]
    floor = res.get("over_floor")
    if floor is not None:
        lines += [
            "",
            f"Against the reference floor ({FLOOR}), the same AIPerf, rounds interleaved:",
        ]
        for f in floor:
            lines.append(
                f"{f['concurrency']:>4}  client - server p50: firsttoken "
                f"{_f(f['firsttoken_gap_ms'], 3)} ms, floor {_f(f['floor_gap_ms'], 3)} ms; "
                f"firsttoken's extra {_f(f['extra_ms'], 3)} ms (target <= {OVER_FLOOR_MS:g}) "
                f"{'PASS' if f['ok'] else 'FAIL'} (median of {f['rounds']} rounds)"
            )
    lean = res.get("lean")
    if lean:
        lines.append(
            f"lean raw-socket client, 1 stream x {lean['matched']} (clock starts at the write): "
            f"gap p50/p90/p99 {_f(lean['gap_p50_ms'], 3)} / {_f(lean['gap_p90_ms'], 3)} / "
            f"{_f(lean['gap_p99_ms'], 3)} ms, pre p50 {_f(lean['pre_p50_ms'], 3)}, "
            f"post p50 {_f(lean['post_p50_ms'], 3)}"
        )
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------


FLOOR = "uvicorn_floor"  # the reference floor: uvicorn, one shared ticker, its own TTFT log


def _pinning(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(AIPerf's cores, the servers' cores): each on a core of its own, when asked and there
    are two."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return None, None
    return {cores[0]}, set(cores[1:])


def bench(
    binary: Path,
    sizes: Sizes,
    out: Path,
    res: dict[str, Any],
    *,
    floor: bool = False,
    rounds: int = 1,
    pin: bool = False,
) -> None:
    tokenizer = ensure_tokenizer(binary)
    client_cpus, server_cpus = _pinning(pin)
    res["meta"]["pinned"] = {
        "aiperf": sorted(client_cpus) if client_cpus else None,
        "servers": sorted(server_cpus) if server_cpus else None,
    }
    # At debug: the `stream.first_token` lines give each token's wall time as the server saw
    # it; trusting trace headers makes AIPerf's X-Request-ID their trace id.
    specs = {SUBJECT: replace(SERVERS[SUBJECT], extra=(*SERVERS[SUBJECT].extra, *OWN_FLAGS))}
    if floor:
        specs[FLOOR] = replace(SERVERS[FLOOR], extra=("--log-ttft",))
    servers: dict[str, ServerProcess] = {}
    logs: dict[str, Path] = {}
    try:
        for name, spec in specs.items():
            logs[name] = out / "logs" / f"{name}.log"
            server = ServerProcess.launch(
                spec, logs[name], ttft_ms=sizes.ttft_ms, itl_ms=sizes.itl_ms, heartbeat_s=15.0
            )
            servers[name] = server
            server.wait_ready()
            if server_cpus is not None:
                os.sched_setaffinity(server.proc.pid, server_cpus)
            _log(f"{name} at {server.url}")
        names = list(servers)
        for level in sizes.levels:
            n = sizes.requests_at(level)
            for r in range(rounds):
                # The order turns each round: neither server always runs first.
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    server = servers[name]
                    art = out / f"aiperf-{name}-c{level}-r{r}"
                    metered = server.spec.has_metrics
                    before = histogram(server) if metered else {}
                    took = run_aiperf(
                        binary, tokenizer, server.url, level, n, sizes, art, client_cpus
                    )
                    after = histogram(server) if metered else {}
                    summary, client = read_client(art)
                    row = compare(level, summary, client, read_server(logs[name]), before, after)
                    row.update(server=name, round=r, aiperf_s=round(took, 1))
                    res["levels"].append(row)
                    _log(
                        f"{name} concurrency {level} round {r}: {row['matched']}/{n} matched, "
                        f"client p50 {_f(row['client_p50_ms'])} server p50 "
                        f"{_f(row['server_p50_ms'])} ms, {'PASS' if row.get('ok') else 'FAIL'} "
                        f"({took:.0f} s)"
                    )
        if floor:
            res["over_floor"] = over_floor(res["levels"])
        if sizes.lean:
            res["lean"] = lean_probe(servers[SUBJECT].url, sizes.lean, sizes.tokens, logs[SUBJECT])
    finally:
        for server in servers.values():
            server.stop()


def over_floor(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level: how much further above its own TTFT an outside client reads firsttoken than
    the reference floor (median over rounds of each p50 gap); the target is <= 2 ms."""
    out = []
    for level in sorted({r["concurrency"] for r in rows}):
        gaps: dict[str, list[float]] = {}
        for r in rows:
            if r["concurrency"] == level and r.get("diff_ms") is not None:
                gaps.setdefault(r["server"], []).append(r["diff_ms"])
        if SUBJECT not in gaps or FLOOR not in gaps:
            continue
        ours, theirs = float(np.median(gaps[SUBJECT])), float(np.median(gaps[FLOOR]))
        out.append(
            {
                "concurrency": level,
                "firsttoken_gap_ms": ours,
                "floor_gap_ms": theirs,
                "extra_ms": ours - theirs,
                "ok": ours - theirs <= OVER_FLOOR_MS,
                "rounds": min(len(gaps[SUBJECT]), len(gaps[FLOOR])),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ttft_agreement", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a minute)")
    parser.add_argument("--levels", help="comma list of AIPerf concurrencies (default 1,10)")
    parser.add_argument("--requests", type=int, help="requests per level (default 200 / 400)")
    parser.add_argument("--aiperf", help="path to the `aiperf` command")
    parser.add_argument("--setup", action="store_true", help=f"make .venv/aiperf: {SETUP}")
    parser.add_argument(
        "--floor",
        action="store_true",
        help=f"also run the reference floor ({FLOOR}, its own TTFT logged), rounds interleaved",
    )
    parser.add_argument("--rounds", type=int, default=1, help="AIPerf runs per server and level")
    parser.add_argument(
        "--pin", action="store_true", help="AIPerf on the first core, the servers on the others"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more, not {args.rounds}")
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.levels:
        sizes = replace(sizes, levels=tuple(int(x) for x in args.levels.split(",") if x.strip()))
    if args.requests:
        sizes = replace(sizes, requests=(), default_requests=args.requests)
    binary = find_aiperf(args.aiperf)
    if binary is None and args.setup:
        binary = make_venv()
    if binary is None:
        msg = f"AIPerf not found in .venv/aiperf: make it with `{SETUP}` (or --setup)"
        print(msg, file=sys.stderr)
        return 2
    out = args.out / "ttft_agreement"
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "meta": {
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mode": "quick" if args.quick else "full",
            "aiperf": str(binary),
            "aiperf_version": aiperf_version(binary),
            "loadavg_start": loadavg(),
            "sizes": {
                **asdict(sizes),
                "requests": {lv: sizes.requests_at(lv) for lv in sizes.levels},
            },
            "server": " ".join(
                [*SERVERS[SUBJECT].command(sizes.ttft_ms, sizes.itl_ms, 15.0)[1:], *OWN_FLAGS]
            ),
        },
        "levels": [],
    }
    try:
        bench(binary, sizes, out, res, floor=args.floor, rounds=args.rounds, pin=args.pin)
    finally:
        res["meta"]["loadavg_end"] = loadavg()
        (args.out / "ttft_agreement.json").write_text(json.dumps(res, indent=2, default=str))
    text = render(res)
    print(text, flush=True)
    (args.out / "ttft_agreement.txt").write_text(text + "\n")
    print(f"\nwrote {args.out / 'ttft_agreement.json'}", flush=True)
    if args.floor:
        return 0 if res.get("over_floor") and all(r["ok"] for r in res["over_floor"]) else 1
    return 0 if res["levels"] and all(r.get("ok") for r in res["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
