"""What firsttoken adds to a real model: TTFT and tokens/s, through the server vs direct.

    .venv/bin/python -m bench.llamacpp_overhead [--runs 16] [--max-tokens 128] [--model F.gguf]

Direct: llama-cpp-python in this process, `create_chat_completion(stream=True)` (the usual
way to call it). Through firsttoken: `serve --engine llamacpp`, the same chat request
streamed over HTTP with httpx. Same prompts, greedy (temperature 0), one request at a time,
interleaved (direct request i, then the same request through the server), so the noise of a
shared machine hits both sides alike; each side has its own model instance and sees the same
prompt sequence, so neither has a warmer KV cache.
Prints medians (and the minimum TTFT) and the ratios firsttoken / direct (TTFT: > 1 is
added latency; tokens/s: < 1 is lost throughput), and the median of the paired TTFT
differences. Direct TTFT includes create_chat_completion's own hold-back of text while it
checks for stop strings (about one token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What are three uses of a paperclip?",
    "Describe a sunrise in the mountains.",
    "Give me tips for learning to cook.",
    "Why do cats purr?",
    "Tell me a story about a brave mouse.",
    "How does a bicycle stay upright?",
]


def _summary(ttfts: list[float], rates: list[float], tokens: list[int]) -> dict[str, float]:
    return {
        "ttft_ms": statistics.median(ttfts) * 1000,
        "tokens_per_s": statistics.median(rates),
        "tokens": statistics.median(tokens),
    }


class _Samples:
    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.rates: list[float] = []
        self.tokens: list[int] = []

    def add(self, t0: float, first: float, last: float, n: int) -> None:
        self.ttfts.append(first - t0)
        self.rates.append((n - 1) / (last - first) if n > 1 and last > first else 0.0)
        self.tokens.append(n)

    def summary(self) -> dict[str, float]:
        return _summary(self.ttfts, self.rates, self.tokens)


def _direct_once(llm: Any, prompt: str, max_tokens: int, out: _Samples) -> None:
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    for chunk in llm.create_chat_completion(
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        temperature=0,
        max_tokens=max_tokens,
        seed=1,
    ):
        if chunk["choices"][0]["delta"].get("content"):
            last = time.perf_counter()
            n += 1
            if n == 1:
                first = last
    out.add(t0, first, last, n)


def _served_once(
    http: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, out: _Samples
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "temperature": 0,
        "max_tokens": max_tokens,
        "seed": 1,
    }
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith('data: {"id"') and '"delta":{"content":' in line:
                last = time.perf_counter()
                n += 1
                if n == 1:
                    first = last
    out.add(t0, first, last, n)


def measure(
    model: Path, given: Path | None, runs: int, max_tokens: int
) -> tuple[_Samples, _Samples]:
    """Interleaved: direct request i, then the same request through the server."""
    from llama_cpp import Llama

    log = tempfile.NamedTemporaryFile(prefix="ft-llama-", suffix=".log")
    args = ["--engine", "llamacpp", "--rate-limit-per-s", "0", "--ttft-slo-ms", "0"]
    if given is not None:
        args += ["--model", str(given)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "firsttoken", "serve", "--port", "0", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=log,
        stderr=log,
    )
    try:
        url = _listening(proc, Path(log.name))
        served_model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        llm = Llama(model_path=str(model), n_ctx=2048, verbose=False)
        # The same warm-up the engine does in start().
        for i, _ in enumerate(llm.generate(llm.tokenize(b"Hello"), temp=0.0)):
            if i >= 3:
                break
        direct, served = _Samples(), _Samples()
        with httpx.Client(timeout=120) as http:
            for i in range(runs):
                prompt = PROMPTS[i % len(PROMPTS)]
                _direct_once(llm, prompt, max_tokens, direct)
                _served_once(http, url, served_model, prompt, max_tokens, served)
        return direct, served
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def _listening(proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if '"listening"' in line:
                return str(json.loads(line)["url"])
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError("server did not start:\n" + log.read_text(errors="replace"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2-135M)")
    args = ap.parse_args(argv)
    from firsttoken.engines.llamacpp import default_model_path

    model = args.model or default_model_path()
    print(f"model {model.name}; {args.runs} runs, max_tokens {args.max_tokens}, greedy")
    direct, served = measure(model, args.model, args.runs, args.max_tokens)
    d, f = direct.summary(), served.summary()
    print(f"{'':>22} {'TTFT ms':>9} {'min':>7} {'tokens/s':>9} {'tokens':>7}")
    for name, s, samples in (("llama-cpp-python", d, direct), ("through firsttoken", f, served)):
        print(
            f"{name:>22} {s['ttft_ms']:>9.1f} {min(samples.ttfts) * 1000:>7.1f} "
            f"{s['tokens_per_s']:>9.1f} {s['tokens']:>7.0f}"
        )
    print(
        f"{'firsttoken / direct':>22} {f['ttft_ms'] / d['ttft_ms']:>9.2f} "
        f"{min(served.ttfts) / min(direct.ttfts):>7.2f} "
        f"{f['tokens_per_s'] / d['tokens_per_s']:>9.2f}"
    )
    # Request i ran through both back to back: the paired difference shrugs off slow periods.
    added = statistics.median(b - a for a, b in zip(direct.ttfts, served.ttfts, strict=True))
    print(f"TTFT added by firsttoken, median of paired differences: {added * 1000:+.1f} ms")


if __name__ == "__main__":
    main()
