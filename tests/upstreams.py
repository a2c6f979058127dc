"""A scripted OpenAI-compatible upstream for relay tests: the error shapes real servers send.

One asyncio HTTP/1.1 server on 127.0.0.1:0 in a background thread. `GET /v1/models` lists a
model per scenario; a streaming POST for model `X` plays scenario `X` (or `scenarios[X]`),
written as chunked transfer encoding, one chunk per SSE event, like uvicorn and TGI do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

TOKENS = ("Hello", ",", " wor", "ld")
BEFORE = "".join(TOKENS[:2])  # the text every error scenario sends before failing

# Error bodies as the servers put them on the wire.
VLLM_STREAM_ERROR = {
    "error": {
        "object": "error",
        "message": "vLLM: CUDA error: an illegal memory access was encountered",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}
VLLM_FLAT_ERROR = {
    "object": "error",
    "message": "This model's maximum context length is 2048 tokens.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
TGI_ERROR = {
    "error": "Request failed during generation: Server error: CUDA out of memory",
    "error_type": "generation",
}
TGI_VALIDATION = {
    "error": "Input validation error: `inputs` must be non-empty",
    "error_type": "validation",
}
LLAMACPP_ERROR = {
    "code": 500,
    "message": "llama.cpp: failed to decode the batch",
    "type": "server_error",
}
OPENAI_ERROR = {
    "error": {
        "message": "The server had an error while processing your request.",
        "type": "server_error",
        "param": None,
        "code": "server_error",
    }
}
OPENAI_429 = {
    "error": {
        "message": "Rate limit reached for requests",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}

# What a hostile probe had upstreams answer (issue 37.7): the client read it verbatim.
TRACEBACK = (
    b'Traceback (most recent call last):\r\n  File "/srv/app.py", line 3\r\n'
    b"\x1b[31mAuthError\x1b[0m: token sk-UPSTREAM-SECRET-123456 refused by "
    b"auth.internal.corp:8443\r\n"
)
SECRET = "db.internal.corp:5432 password=hunter2\r\n\x1b[2J"

HANG = object()  # stop sending, keep the connection open
CUT = object()  # drop the connection without ending the chunked body


def _data(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(chat: bool, text: str | None, finish: str | None = None) -> bytes:
    if chat:
        delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return _data({"object": "chat.completion.chunk", "choices": [choice]})
    choice = {"index": 0, "text": text or "", "finish_reason": finish}
    return _data({"object": "text_completion", "choices": [choice]})


def script(name: str, chat: bool) -> tuple[int, str, list[object]]:
    """(status, content type, steps): bytes are one chunk each, HANG and CUT end abnormally."""
    sse = "text/event-stream"
    before = [_chunk(chat, None)] + [_chunk(chat, t) for t in TOKENS[:2]]
    done = [_chunk(chat, None, "stop"), b"data: [DONE]\n\n"]
    if name == "ok":
        return 200, sse, [*before, *(_chunk(chat, t) for t in TOKENS[2:]), *done]
    if name in ("vllm-tools", "vllm-reasoning", "vllm-cached"):
        return 200, sse, [_data(c) for c in VLLM_CHUNKS[name]] + [b"data: [DONE]\n\n"]
    if name == "ok-no-done":  # older TGI: finish_reason, then the body ends
        return 200, sse, [*before, *(_chunk(chat, t) for t in TOKENS[2:]), done[0]]
    if name == "vllm-error":  # vLLM sends [DONE] after its error
        return 200, sse, [*before, _data(VLLM_STREAM_ERROR), b"data: [DONE]\n\n"]
    if name == "vllm-flat-error":
        return 200, sse, [*before, _data(VLLM_FLAT_ERROR)]
    if name == "tgi-error":
        return 200, sse, [*before, _data(TGI_ERROR)]
    if name == "llamacpp-error":  # llama.cpp server: a bare `error:` line, not SSE data
        return 200, sse, [*before, b"error: " + json.dumps(LLAMACPP_ERROR).encode() + b"\n\n"]
    if name == "llamacpp-data-error":
        return 200, sse, [*before, _data({"error": LLAMACPP_ERROR})]
    if name == "openai-event-error":
        return 200, sse, [*before, b"event: error\n" + _data(OPENAI_ERROR)]
    if name == "early-error":  # an error event before any content
        return 200, sse, [_chunk(chat, None), _data(VLLM_STREAM_ERROR)]
    if name == "cut":  # the body ends cleanly, but without finish_reason or [DONE]
        return 200, sse, before
    if name == "cut-chunked":  # the connection drops mid-body
        return 200, sse, [*before, CUT]
    if name == "hang":
        return 200, sse, [*before, HANG]
    if name == "hang-before":  # never answers at all
        return 0, sse, [HANG]
    if name == "http-500":
        return 500, "application/json", [json.dumps({"error": LLAMACPP_ERROR}).encode()]
    if name == "http-503":
        return 503, "text/html", [b"<html><body>503 Service Unavailable</body></html>"]
    if name == "http-400-traceback":  # a framework's debug page, secrets and escapes in it
        return 400, "text/plain", [TRACEBACK]
    if name == "http-500-secret":
        return 500, "application/json", [json.dumps({"error": {"message": SECRET}}).encode()]
    if name == "http-400":
        return 400, "application/json", [json.dumps(VLLM_FLAT_ERROR).encode()]
    if name == "http-422":
        return 422, "application/json", [json.dumps(TGI_VALIDATION).encode()]
    if name in ("http-429", "http-429-retry"):
        return 429, "application/json", [json.dumps(OPENAI_429).encode()]
    if name == "rejects-prefill":  # answers whole; refuses a continuation (above)
        return script("ok", chat)
    if name == "cut-in-tool":  # the connection drops inside a tool call's arguments
        return 200, sse, [_data(c) for c in VLLM_CHUNKS["vllm-tools"][:6]] + [CUT]
    if name == "cut-in-reasoning":
        return 200, sse, [_data(c) for c in VLLM_CHUNKS["vllm-tools"][:3]] + [CUT]
    # Faults: what a broken upstream, or a proxy in front of one, puts on the wire.
    if name == "html-502":  # nginx in front of a dead upstream
        return 502, "text/html", [NGINX_502]
    if name == "html-200":  # a captive portal or misrouted proxy: a page, not a stream
        return 200, "text/html", [b"<html><body><h1>Welcome</h1><p>Sign in</p></body></html>"]
    if name == "bad-json":
        return 200, sse, [*before, b'data: {"choices": [{"delta": {"content": "x"\n\n']
    if name == "bad-shape":  # valid JSON, not a chunk
        return 200, sse, [*before, _data({"choices": "not a list"}), *done]
    if name == "bad-type":  # content that is not a string
        return 200, sse, [*before, _data({"choices": [{"delta": {"content": 5}}]}), *done]
    if name == "json-array":
        return 200, sse, [*before, b"data: [1, 2, 3]\n\n", *done]
    if name == "no-newline":  # an event that never ends: megabytes without a line break
        return 200, sse, [*before, *([b"x" * 65536] * 80)]
    if name == "malformed-sse":  # fields without colons or blank lines, then the body ends
        return 200, sse, [*before, b'dta {"choices": []}\nnonsense\n\x00\xff\xfe\n']
    if name == "binary":  # bytes that are neither UTF-8 nor SSE, then the end
        return 200, sse, [bytes(range(256)) * 4]
    raise KeyError(name)


def limit_script(request: Mapping[str, object], chat: bool) -> tuple[int, str, list[object]]:
    """vLLM's reading of a request's limits: `max_completion_tokens` wins over `max_tokens`
    (16 without either). The answer runs to it, one word per token, all in one write, and
    its usage says so, as a vLLM upstream bills it."""
    limit = request.get("max_completion_tokens") or request.get("max_tokens") or 16
    assert isinstance(limit, int)
    usage = {"prompt_tokens": 5, "completion_tokens": limit, "total_tokens": 5 + limit}
    events = [_chunk(chat, " w") for _ in range(limit)]
    events += [_chunk(chat, None, "length"), _data({"choices": [], "usage": usage})]
    return 200, "text/event-stream", [b"".join(events), b"data: [DONE]\n\n"]


def continuation_prefix(request: Mapping[str, object]) -> str | None:
    """The assistant text a vLLM-style continuation asks to go on from, if it is one; for a
    completion, the prompt's end when it is a start of the scripted answer (a base model
    simply continues its prompt)."""
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        starts = ("".join(TOKENS[:k]) for k in range(len(TOKENS), 0, -1))
        return next((p for p in starts if prompt.endswith(p)), None)
    messages = request.get("messages")
    if not request.get("continue_final_message") or not isinstance(messages, list):
        return None
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None
    return str(last.get("content") or "")


def continue_script(name: str, prefix: str, chat: bool) -> tuple[int, str, list[object]]:
    """How a scripted upstream continues `prefix` (vLLM's continue_final_message): the rest
    of TOKENS when the prefix ends at a token boundary; a 400 otherwise, or always for
    `rejects-prefill` (a server that does not take an assistant prefix)."""
    sse = "text/event-stream"
    cuts = {"".join(TOKENS[:k]): k for k in range(len(TOKENS) + 1)}
    if name == "rejects-prefill" or prefix not in cuts:
        return 400, "application/json", [json.dumps(PREFILL_400).encode()]
    if name in ("hang-before", "http-503", "http-429-retry"):
        return script(name, chat)
    rest = [_chunk(chat, t) for t in TOKENS[cuts[prefix] :]]
    return 200, sse, [_chunk(chat, None), *rest, _chunk(chat, None, "stop"), b"data: [DONE]\n\n"]


PREFILL_400 = {
    "error": {
        "message": "continue_final_message is not supported",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


def _vllm(delta: dict, finish: str | None = None, **choice: object) -> dict:
    return {
        "id": "chatcmpl-vllm",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "vllm-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **choice}],
    }


# What vLLM streams with a reasoning parser and a tool parser on: reasoning_content first,
# then a tool call whose arguments arrive in fragments, the finish, and a usage chunk.
VLLM_USAGE = {"prompt_tokens": 31, "completion_tokens": 17, "total_tokens": 48}
# vLLM with prefix caching on (`--enable-prompt-tokens-details`): the prompt's cached part.
VLLM_CACHED_USAGE = {
    "prompt_tokens": 31,
    "completion_tokens": 17,
    "total_tokens": 48,
    "prompt_tokens_details": {"cached_tokens": 24},
    "completion_tokens_details": {"reasoning_tokens": 1},
}
VLLM_ARGUMENTS = ['{"city": ', '"Par', 'is", "u', 'nit": "c"', "}"]
VLLM_CHUNKS = {
    "vllm-tools": [
        _vllm({"role": "assistant", "content": ""}),
        _vllm({"reasoning_content": "The user wants"}),
        _vllm({"reasoning_content": " the weather."}),
        _vllm(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "chatcmpl-tool-1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ]
            }
        ),
        *(
            _vllm({"tool_calls": [{"index": 0, "function": {"arguments": a}}]})
            for a in VLLM_ARGUMENTS
        ),
        _vllm({}, "tool_calls"),
        {
            "id": "chatcmpl-vllm",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "vllm-model",
            "choices": [],
            "usage": VLLM_USAGE,
        },
    ],
    "vllm-reasoning": [
        _vllm({"role": "assistant", "content": ""}),
        _vllm({"reasoning_content": "Think"}, logprobs=None),
        _vllm({"content": "Hello"}, logprobs={"content": [{"token": "Hello", "logprob": -0.1}]}),
        _vllm({"content": " world", "annotations": []}),
        _vllm({}, "stop"),
        {
            "id": "chatcmpl-vllm",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "vllm-model",
            "choices": [],
            "usage": VLLM_USAGE,
        },
    ],
}


VLLM_CHUNKS["vllm-cached"] = [
    *VLLM_CHUNKS["vllm-reasoning"][:-1],
    {**VLLM_CHUNKS["vllm-reasoning"][-1], "usage": VLLM_CACHED_USAGE},
]


NGINX_502 = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx/1.22.1</center>\r\n"
    b"</body>\r\n</html>\r\n"
)


SCENARIOS = (
    "ok ok-no-done vllm-error vllm-flat-error tgi-error llamacpp-error llamacpp-data-error "
    "openai-event-error early-error cut cut-chunked hang hang-before "
    "http-500 http-503 http-400 http-422 http-429 "
    "html-502 html-200 bad-json bad-shape bad-type json-array no-newline malformed-sse binary "
    "vllm-tools vllm-reasoning vllm-cached http-429-retry rejects-prefill cut-in-tool "
    "cut-in-reasoning vllm-limit http-400-traceback http-500-secret fails-on-extra"
).split()


@dataclass
class ScriptedUpstream:
    """`scenarios` maps extra model names to a scenario (e.g. {"synthetic": "http-503"})."""

    scenarios: Mapping[str, str] = field(default_factory=dict)
    url: str = ""
    posts: list[dict] = field(default_factory=list)  # request bodies, in order
    closed_early: int = 0  # connections the client closed before the script ended
    _loop: asyncio.AbstractEventLoop | None = None

    def models(self) -> list[str]:
        return [*SCENARIOS, *self.scenarios]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client left, or the server is shutting down
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *lines = head.decode().split("\r\n")
        method, path, _ = request_line.split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
        body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
        if method == "GET" and path.endswith("/models"):
            data = {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models()]}
            payload = json.dumps(data).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            await writer.drain()
            return True
        request = json.loads(body)
        self.posts.append(request)
        model = request.get("model", "")
        name = self.scenarios.get(model, model)
        chat = "messages" in request
        continued = continuation_prefix(request)
        if name == "vllm-limit":
            status, ctype, steps = limit_script(request, chat)
        elif name == "fails-on-extra":  # a 500 for one field only (vLLM's 500s on extras)
            status, ctype, steps = script("http-500" if "guided_grammar" in request else "ok", chat)
        elif continued is not None:
            status, ctype, steps = continue_script(name, continued, chat)
        else:
            status, ctype, steps = script(name, chat)
        extra = b"retry-after: 2\r\n" if name == "http-429-retry" else b""
        if status:
            writer.write(
                b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n%s\r\n"
                % (status, ctype.encode(), extra)
            )
        for step in steps:
            if step is HANG:
                if await reader.read(1) == b"":  # returns when the client gives up
                    self.closed_early += 1
                return False
            if step is CUT:
                writer.transport.abort()
                return False
            assert isinstance(step, bytes)
            writer.write(b"%x\r\n%s\r\n" % (len(step), step))
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


@contextmanager
def scripted_upstream(scenarios: Mapping[str, str] | None = None) -> Iterator[ScriptedUpstream]:
    """Run a ScriptedUpstream in a daemon thread for the block; `url` is its base URL."""
    up = ScriptedUpstream(dict(scenarios or {}))
    started = threading.Event()
    stop: list[asyncio.Event] = []

    async def main() -> None:
        server = await asyncio.start_server(up._handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        up.url = f"http://127.0.0.1:{port}"
        done = asyncio.Event()
        stop.append(done)
        up._loop = asyncio.get_running_loop()
        started.set()
        async with server:
            await done.wait()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("scripted upstream did not start")
    try:
        yield up
    finally:
        assert up._loop is not None
        with contextlib.suppress(RuntimeError):
            up._loop.call_soon_threadsafe(stop[0].set)
        thread.join(timeout=5)


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
