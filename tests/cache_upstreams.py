"""Upstreams that report prompt-cache tokens, as the real providers do: an OpenAI-compatible
one (`prompt_tokens_details.cached_tokens`, as vLLM with prefix caching or OpenAI itself) and
an Anthropic Messages one (`cache_read_input_tokens`, `cache_creation_input_tokens`). Each
answers `max_tokens` tokens (at most `ANSWER`), streamed or whole, and records the bodies it
was sent (to see a client's `cache_control` markers arrive)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

ANSWER = 12  # tokens at most
PROMPT = 100  # the prompt's tokens, as the upstream counts them
CACHED = 64  # of which read from the cache
WRITTEN = 16  # of which written to it (Anthropic only)


def _tokens(body: dict[str, Any]) -> int:
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or ANSWER
    return max(1, min(int(limit), ANSWER))


def _sse(obj: object, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


class CacheUpstreams:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.url = ""

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.bodies.append(body)
        n = _tokens(body)
        usage = {
            "prompt_tokens": PROMPT,
            "completion_tokens": n,
            "total_tokens": PROMPT + n,
            "prompt_tokens_details": {"cached_tokens": CACHED},
        }
        base = {"id": "c1", "created": 1, "model": body.get("model", "m")}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "tok " * n}
            return JSONResponse(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
                    "usage": usage,
                }
            )

        async def events() -> AsyncIterator[bytes]:
            chunk = {**base, "object": "chat.completion.chunk"}
            for i in range(n):
                delta = {"content": "tok "} if i else {"role": "assistant", "content": "tok "}
                choice = {"index": 0, "delta": delta, "finish_reason": None}
                yield _sse({**chunk, "choices": [choice]})
            end = {"index": 0, "delta": {}, "finish_reason": "length"}
            yield _sse({**chunk, "choices": [end]})
            yield _sse({**chunk, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def messages(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.bodies.append(body)
        n = _tokens(body)
        start_usage = {
            "input_tokens": PROMPT - CACHED - WRITTEN,
            "cache_read_input_tokens": CACHED,
            "cache_creation_input_tokens": WRITTEN,
            "output_tokens": 1,
        }

        async def events() -> AsyncIterator[bytes]:
            message = {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": body.get("model", "m"),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": start_usage,
            }
            yield _sse({"type": "message_start", "message": message}, "message_start")
            block = {"type": "text", "text": ""}
            start = {"type": "content_block_start", "index": 0, "content_block": block}
            yield _sse(start, "content_block_start")
            for _ in range(n):
                delta = {"type": "text_delta", "text": "tok "}
                piece = {"type": "content_block_delta", "index": 0, "delta": delta}
                yield _sse(piece, "content_block_delta")
            yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            end = {"stop_reason": "max_tokens", "stop_sequence": None}
            usage = {"output_tokens": n}
            yield _sse({"type": "message_delta", "delta": end, "usage": usage}, "message_delta")
            yield _sse({"type": "message_stop"}, "message_stop")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        listed = [{"id": name, "object": "model"} for name in ("cached", "claude-x")]
        return JSONResponse({"object": "list", "data": listed})


@contextmanager
def cache_upstreams() -> Iterator[CacheUpstreams]:
    """Both upstreams on one loopback port: `url` + `/v1/chat/completions` or `/v1/messages`."""
    up = CacheUpstreams()
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", up.chat, methods=["POST"]),
            Route("/v1/messages", up.messages, methods=["POST"]),
            Route("/v1/models", up.models, methods=["GET"]),
        ]
    )
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("cache upstreams did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    up.url = f"http://127.0.0.1:{port}"
    try:
        yield up
    finally:
        server.should_exit = True
        thread.join(timeout=5)
