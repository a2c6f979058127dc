"""What firsttoken adds to a real model: TTFT and tokens/s, through the server vs direct.

    .venv/bin/python -m bench.llamacpp_overhead [--runs 5] [--max-tokens 128] [--model F.gguf]

Direct: llama-cpp-python in this process, `create_chat_completion(stream=True)` (the usual
way to call it). Through firsttoken: `serve --engine llamacpp`, the same chat request
streamed over HTTP with httpx. Same prompts, greedy (temperature 0), one request at a time,
the two phases one after the other (never both on the CPU at once), each with its own
model instance, so neither starts with a warmer KV cache.
Prints medians and the ratios firsttoken / direct (TTFT: > 1 is added latency;
tokens/s: < 1 is lost throughput).
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


def direct(model: Path, runs: int, max_tokens: int) -> dict[str, float]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), n_ctx=2048, verbose=False)
    # The same warm-up the engine does in start().
    for i, _ in enumerate(llm.generate(llm.tokenize(b"Hello"), temp=0.0)):
        if i >= 3:
            break
    ttfts, rates, counts = [], [], []
    for i in range(runs):
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        t0 = time.perf_counter()
        first = last = 0.0
        n = 0
        for chunk in llm.create_chat_completion(
            messages=messages,  # type: ignore[arg-type]
            stream=True,
            temperature=0,
            max_tokens=max_tokens,
            seed=1,
        ):
            if chunk["choices"][0]["delta"].get("content"):  # type: ignore[index]
                last = time.perf_counter()
                n += 1
                if n == 1:
                    first = last
        ttfts.append(first - t0)
        rates.append((n - 1) / (last - first) if n > 1 and last > first else 0.0)
        counts.append(n)
    del llm
    return _summary(ttfts, rates, counts)


def through_firsttoken(model: Path | None, runs: int, max_tokens: int) -> dict[str, float]:
    log = tempfile.NamedTemporaryFile(prefix="ft-llama-", suffix=".log")
    args = ["--engine", "llamacpp", "--rate-limit-per-s", "0", "--ttft-slo-ms", "0"]
    if model is not None:
        args += ["--model", str(model)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "firsttoken", "serve", "--port", "0", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=log,
        stderr=log,
    )
    try:
        url = _listening(proc, Path(log.name))
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        ttfts, rates, counts = [], [], []
        with httpx.Client(timeout=120) as http:
            for i in range(runs):
                body = {
                    "model": models[0]["id"],
                    "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
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
                ttfts.append(first - t0)
                rates.append((n - 1) / (last - first) if n > 1 and last > first else 0.0)
                counts.append(n)
        return _summary(ttfts, rates, counts)
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
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2-135M)")
    args = ap.parse_args(argv)
    from firsttoken.engines.llamacpp import default_model_path

    model = args.model or default_model_path()
    print(f"model {model.name}; {args.runs} runs, max_tokens {args.max_tokens}, greedy")
    d = direct(model, args.runs, args.max_tokens)
    f = through_firsttoken(args.model, args.runs, args.max_tokens)
    print(f"{'':>22} {'TTFT ms':>9} {'tokens/s':>9} {'tokens':>7}")
    for name, s in (("llama-cpp-python", d), ("through firsttoken", f)):
        print(f"{name:>22} {s['ttft_ms']:>9.1f} {s['tokens_per_s']:>9.1f} {s['tokens']:>7.0f}")
    print(
        f"{'firsttoken / direct':>22} {f['ttft_ms'] / d['ttft_ms']:>9.2f} "
        f"{f['tokens_per_s'] / d['tokens_per_s']:>9.2f}"
    )


if __name__ == "__main__":
    main()
