"""The tutorial stack: FastAPI + sse-starlette, the way most projects stream LLM output.

A pydantic request model, an async generator that sleeps on the synthetic engine's schedule,
`json.dumps` of an OpenAI chunk per token, and `EventSourceResponse` (with its ping) to send
it. Served by uvicorn with uvloop and httptools; the access log is off, as firsttoken's is.

    python -m bench.servers.tutorial serve --port 0 --synthetic-ttft-ms 200 --synthetic-itl-ms 20
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from bench.servers.baseline_cli import listening_socket, parse_serve_args
from firsttoken.engines.synthetic import synthetic_tokens

__all__ = ["build_app", "main"]


class Message(BaseModel):
    role: str
    content: str


class SyntheticKnobs(BaseModel):
    ttft_ms: float | None = None
    itl_ms: float | None = None


class ChatRequest(BaseModel):
    model: str
    messages: list[Message]
    stream: bool = True
    max_tokens: int | None = None
    seed: int | None = None
    synthetic: SyntheticKnobs | None = None


def build_app(ttft_ms: float, itl_ms: float, heartbeat_s: float, url: list[str]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        print(json.dumps({"msg": "listening", "url": url[0]}), flush=True)
        yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> EventSourceResponse:
        knobs = req.synthetic or SyntheticKnobs()
        ttft = (ttft_ms if knobs.ttft_ms is None else knobs.ttft_ms) / 1000
        itl = (itl_ms if knobs.itl_ms is None else knobs.itl_ms) / 1000
        prompt = "\n".join(f"{m.role}: {m.content}" for m in req.messages)
        tokens, finish = synthetic_tokens(prompt, req.seed, req.max_tokens)
        return EventSourceResponse(_chunks(tokens, finish, req.model, ttft, itl), ping=heartbeat_s)

    return app


async def _chunks(
    tokens: list[str], finish: str, model: str, ttft: float, itl: float
) -> AsyncIterator[dict[str, str]]:
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunk(delta: dict[str, str], finish_reason: str | None) -> str:
        return json.dumps(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            }
        )

    loop = asyncio.get_running_loop()
    yield {"id": "0", "data": chunk({"role": "assistant", "content": ""}, None)}
    due = loop.time() + ttft
    for i, token in enumerate(tokens):
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -itl:
            due = loop.time()
        yield {"id": str(i + 1), "data": chunk({"content": token}, None)}
        due += itl
    yield {"id": str(len(tokens) + 1), "data": chunk({}, finish)}
    yield {"data": "[DONE]"}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_serve_args("python -m bench.servers.tutorial", argv)
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    app = build_app(
        args.synthetic_ttft_ms, args.synthetic_itl_ms, args.heartbeat_s, [f"http://{host}:{port}"]
    )
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        backlog=4096,
        timeout_graceful_shutdown=1,
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
