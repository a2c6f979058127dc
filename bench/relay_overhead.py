"""What the relay engine costs: TTFT and inter-chunk gaps through `--engine openai` vs direct
to the same upstream, measured in the same run, rounds interleaved, printed as ratios.

    .venv/bin/python -m bench.relay_overhead [--streams 20] [--rounds 3] [--tokens 100]

The upstream is `firsttoken serve` (synthetic engine, fixed TTFT/ITL); the relay is a second
`firsttoken serve --engine openai --upstream <it>`. Each round opens N concurrent chat streams
at one target, then the other, with an httpx client that timestamps every content event.
TODO(litellm): the LiteLLM proxy comparison is a separate task; it would be a third target
here (same upstream, same client) once LiteLLM can be installed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import pairwise

import anyio
import httpx
import orjson

from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.servers import run_server

OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0", "--ttft-slo-ms", "0")


async def one_stream(
    client: httpx.AsyncClient, url: str, seed: int, tokens: int
) -> tuple[float, list[float], str]:
    """(TTFT s, gaps between content events s, text) for one chat stream."""
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "bench"}],
        "stream": True,
        "max_tokens": tokens,
        "seed": seed,
    }
    decoder = EventDecoder()
    stamps: list[float] = []
    parts: list[str] = []
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        async for chunk in resp.aiter_raw():
            now = time.perf_counter()
            for event in decoder.feed(chunk):
                if not event.data or event.data == "[DONE]" or event.event:
                    continue
                choices = orjson.loads(event.data)["choices"]
                text = choices[0]["delta"].get("content") if choices else None
                if text:
                    stamps.append(now)
                    parts.append(text)
    gaps = [b - a for a, b in pairwise(stamps)]
    return stamps[0] - start, gaps, "".join(parts)


async def round_at(url: str, streams: int, tokens: int) -> tuple[list[float], list[float]]:
    ttfts: list[float] = []
    gaps: list[float] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def run(i: int) -> None:
            ttft, g, text = await one_stream(client, url, i, tokens)
            expected = "".join(synthetic_tokens("user: bench", i, tokens)[0])
            assert text == expected, f"stream {i}: text differs"
            ttfts.append(ttft)
            gaps.extend(g)

        async with anyio.create_task_group() as tg:
            for i in range(streams):
                tg.start_soon(run, i)
    return ttfts, gaps


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_overhead")
    parser.add_argument("--streams", type=int, default=20, help="concurrent streams per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per target, interleaved")
    parser.add_argument("--tokens", type=int, default=100, help="max_tokens per stream")
    parser.add_argument("--ttft-ms", type=float, default=50.0, help="upstream TTFT")
    parser.add_argument("--itl-ms", type=float, default=20.0, help="upstream time per token")
    args = parser.parse_args(argv)
    timing = ("--synthetic-ttft-ms", str(args.ttft_ms), "--synthetic-itl-ms", str(args.itl_ms))
    results: dict[str, tuple[list[float], list[float]]] = {"direct": ([], []), "relay": ([], [])}
    with (
        run_server(*timing, *OPEN) as upstream,
        run_server("--engine", "openai", "--upstream", upstream.url, *OPEN) as relay,
    ):
        targets = {"direct": upstream.url, "relay": relay.url}
        anyio.run(round_at, upstream.url, 2, 5)  # warm both paths
        anyio.run(round_at, relay.url, 2, 5)
        for _ in range(args.rounds):
            for name, url in targets.items():
                ttfts, gaps = anyio.run(round_at, url, args.streams, args.tokens)
                results[name][0].extend(ttfts)
                results[name][1].extend(gaps)
    print(
        f"{args.streams} streams x {args.rounds} rounds, {args.tokens} tokens, "
        f"upstream TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms"
    )
    print(f"{'':22}{'direct':>10}{'relay':>10}{'ratio':>8}{'delta ms':>10}")
    for label, idx, q in (
        ("TTFT p50", 0, 50),
        ("TTFT p99", 0, 99),
        ("inter-chunk p50", 1, 50),
        ("inter-chunk p99", 1, 99),
    ):
        d = pct(results["direct"][idx], q) * 1000
        r = pct(results["relay"][idx], q) * 1000
        ratio = r / d if d else float("nan")
        print(f"{label + ' (ms)':22}{d:10.2f}{r:10.2f}{ratio:8.2f}{r - d:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
