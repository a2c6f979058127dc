"""Many streams at once: every one completes with token-exact text."""

from __future__ import annotations

import asyncio
import json

import httpx

from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.servers import Server

N = 200


async def one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, list[str], bool]:
    body = {
        "messages": [{"role": "user", "content": f"question {i}"}],
        "stream": True,
        "max_tokens": 30 + i % 20,
        "seed": i,
    }
    tokens: list[str] = []
    done = False
    decoder = EventDecoder()
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for chunk in r.aiter_raw():
            for event in decoder.feed(chunk):
                if event.data == "[DONE]":
                    done = True
                    continue
                choices = json.loads(event.data)["choices"]
                if choices and choices[0]["delta"].get("content"):
                    tokens.append(choices[0]["delta"]["content"])
    return i, tokens, done


def test_200_concurrent_streams_token_exact(server: Server) -> None:
    before = server.metrics()

    async def run() -> list[tuple[int, list[str], bool]]:
        limits = httpx.Limits(max_connections=N + 10, max_keepalive_connections=N + 10)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            return await asyncio.gather(
                *(one(client, server.v1 + "/chat/completions", i) for i in range(N))
            )

    results = asyncio.run(run())
    assert len(results) == N
    for i, tokens, done in results:
        assert done, f"stream {i} ended without [DONE]"
        assert tokens == synthetic_tokens(f"user: question {i}", i, 30 + i % 20)[0]
    after = server.metrics()
    completed = 'firsttoken_streams_total{outcome="completed"}'
    assert after[completed] - before.get(completed, 0) == N
    sent = sum(len(t) for _, t, _ in results)
    assert after["firsttoken_tokens_sent_total"] - before["firsttoken_tokens_sent_total"] == sent
