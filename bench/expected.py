"""The workload's requests and the exact text each must produce (the synthetic engine's).

Every server under test builds its answer with `synthetic_tokens` from the same prompt, so the
client can check each stream token-exact against the same function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson

from firsttoken.engines.synthetic import synthetic_tokens

__all__ = [
    "PROMPT_VARIANTS",
    "RequestSpec",
    "chat_prompt",
    "expected_tokens",
    "http_request",
]

# A handful of distinct prompts: enough variety that every server really looks the text up,
# few enough that every engine's cache of answers stays warm (the engine is not under test).
PROMPT_VARIANTS = 8


@dataclass(frozen=True, slots=True)
class RequestSpec:
    variant: int
    max_tokens: int
    ttft_ms: float
    itl_ms: float

    @property
    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": "You are a benchmark."},
            {"role": "user", "content": f"Stream variant {self.variant}, please."},
        ]

    @property
    def seed(self) -> int:
        return 1000 + self.variant

    def body(self) -> dict[str, Any]:
        return {
            "model": "synthetic",
            "messages": self.messages,
            "stream": True,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "synthetic": {"ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms},
        }

    def tokens(self) -> tuple[str, ...]:
        return expected_tokens(chat_prompt(self.messages), self.seed, self.max_tokens)


def chat_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The engine prompt for a chat request, exactly as firsttoken builds it."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


@lru_cache(maxsize=256)
def expected_tokens(prompt: str, seed: int | None, max_tokens: int | None) -> tuple[str, ...]:
    return tuple(synthetic_tokens(prompt, seed, max_tokens)[0])


def http_request(spec: RequestSpec, host: str, port: int) -> bytes:
    """The whole HTTP/1.1 request, pre-encoded; `Connection: close` so the server closes first."""
    body = orjson.dumps(spec.body())
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: {host}:{port}\r\n"
        f"Content-Type: application/json\r\n"
        f"Accept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n"
    )
    return head.encode() + body
