"""The `anthropic` target kind: stream from a Messages API upstream (Anthropic, or any server
that speaks `POST /v1/messages`, firsttoken included), its events turned into deltas.

Three parts, the first two without I/O:
- `messages_body`: the request (a Chat Completions body, whatever API it came in by) as a
  Messages body, with a final assistant turn as Anthropic's prefill (how a cut answer is
  continued on this kind);
- `MessagesReader`: the upstream's events → deltas (thinking → reasoning, tool_use → tool-call
  fragments, usage with the cache's tokens), and the upstream's errors → `EngineError`;
- `AnthropicRelay`: the I/O, one POST per stream on the lean client (`engines.upstream`).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from firsttoken.engines.remote import RemoteEngine
from firsttoken.engines.upstream import (
    UpstreamResponse,
    drain,
    plain_text,
    retry_after,
)
from firsttoken.engines.upstream_errors import generic, shaped_message
from firsttoken.formats.sse import EventDecoder
from firsttoken.generation import (
    TARGET_FAULTS,
    Delta,
    EngineError,
    GenerationRequest,
    ToolCallDelta,
)

__all__ = [
    "ANTHROPIC_VERSION",
    "DEFAULT_MAX_TOKENS",
    "AnthropicRelay",
    "MessagesCall",
    "MessagesReader",
    "http_error",
    "messages_body",
    "read_stream",
    "retry_after",
    "stream_error",
]

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096  # Anthropic requires max_tokens; Chat Completions does not
# reasoning_effort → a thinking budget (Anthropic's smallest budget is 1024).
_THINKING_BUDGET = {"minimal": 1024, "low": 1024, "medium": 4096, "high": 16384}
_MIN_THINKING_BUDGET = 1024
# Messages' stop_reason → Chat Completions' finish_reason.
_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
# In-stream error types another target (or a later try) may do better on.
_RETRYABLE_TYPES = frozenset({"overloaded_error", "api_error", "rate_limit_error", "timeout_error"})
_MAX_EVENT_BYTES = 4 * 1024 * 1024
_DATA_URL = re.compile(r"^data:([^;,]+);base64,(.*)$", re.DOTALL)
_CODE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


# -- the request ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MessagesCall:
    """The upstream's request body, and the whitespace cut from the end of its prefill:
    Anthropic refuses a final assistant turn that ends in whitespace, so the prefill goes
    without it, and the continuation's text loses as much of it as it repeats."""

    body: dict[str, Any]
    trimmed: str = ""


def messages_body(request: GenerationRequest, model: str | None = None) -> MessagesCall:
    """The request as a Messages body, for the target's `model` (else the request's)."""
    chat: Mapping[str, Any] = request.body if request.body is not None else _plain_chat(request)
    messages = chat.get("messages")
    if messages is None and isinstance(chat.get("prompt"), str):
        # A Completions body; a continued one's prompt ends with the answer so far.
        prompt, continued = chat["prompt"], chat.get("continue_final_text")
        if isinstance(continued, str) and prompt.endswith(continued):
            prompt = prompt[: len(prompt) - len(continued)]
        else:
            continued = None
        messages = _prompt_turns(prompt, continued)
    system, turns = _turns(messages or ())
    trimmed = ""
    if turns and turns[-1]["role"] == "assistant":
        trimmed = _trim_prefill(turns)
    body: dict[str, Any] = {"model": model or request.model, "messages": turns}
    if system:
        one = len(system) == 1 and "cache_control" not in system[0]
        body["system"] = system[0]["text"] if one else system
    # What admission allowed (the smaller of the body's two limits, or its budget's cap),
    # never the body's own: a larger one there would go past what the key was charged.
    max_tokens = _first(
        request.max_tokens, chat.get("max_completion_tokens"), chat.get("max_tokens")
    )
    body["max_tokens"] = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    body["stream"] = True
    stop = chat.get("stop")
    if isinstance(stop, str):
        body["stop_sequences"] = [stop]
    elif stop:
        body["stop_sequences"] = list(stop)
    temperature = chat.get("temperature")
    if isinstance(temperature, int | float):
        # Chat Completions allows up to 2, Messages up to 1: the nearest it takes, not a 400.
        body["temperature"] = min(float(temperature), 1.0)
    if chat.get("top_p") is not None:
        body["top_p"] = chat["top_p"]
    tools = chat.get("tools")
    if tools:
        body["tools"] = [_tool(t) for t in tools]
        choice = _tool_choice(chat.get("tool_choice"), chat.get("parallel_tool_calls"))
        if choice is not None:
            body["tool_choice"] = choice
    for name in ("top_k", "thinking", "synthetic"):  # a firsttoken upstream reads `synthetic`
        if chat.get(name) is not None:
            body[name] = chat[name]
    user = _metadata_user(chat)
    if user is not None:
        body["metadata"] = {"user_id": user}
    if "thinking" not in body:
        _thinking_from_effort(body, chat.get("reasoning_effort"))
    return MessagesCall(body, trimmed)


def _plain_chat(request: GenerationRequest) -> dict[str, Any]:
    """A request without a body (a native stream): its messages, or its prompt as one user
    turn, and its limits."""
    messages = [dict(m) for m in request.messages or ()] or _prompt_turns(
        request.prompt, request.options.get("continuation")
    )
    chat: dict[str, Any] = {"messages": messages, "max_tokens": request.max_tokens}
    if request.temperature is not None:
        chat["temperature"] = request.temperature
    if request.stop:
        chat["stop"] = list(request.stop)
    synthetic = request.options.get("synthetic")
    if isinstance(synthetic, Mapping):
        knobs = {k: v for k, v in synthetic.items() if v is not None}
        if knobs:
            chat["synthetic"] = knobs
    return chat


def _prompt_turns(prompt: str, continued: object) -> list[dict[str, Any]]:
    """A prompt alone as one user turn, and the start of its answer being continued (a
    splice's) as an assistant prefill: the model writes on from it, where the grown prompt
    alone would be answered anew."""
    turns: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    if isinstance(continued, str) and continued:
        turns.append({"role": "assistant", "content": continued})
    return turns


def _turns(messages: Sequence[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system blocks, turns). Messages alternate roles: consecutive turns of one role (a
    run of tool results, a tool result then the user's text) become one."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise _unsupported("a message that is not an object")
        role = message.get("role")
        if role in ("system", "developer"):
            system.extend(_blocks(message.get("content"), images=False))
            continue
        if role == "user":
            blocks = _blocks(message.get("content"), images=True)
        elif role == "assistant":
            blocks = _assistant_blocks(message)
        elif role in ("tool", "function"):
            role, blocks = "user", [_tool_result(message)]
        else:
            raise _unsupported(f"a message of role {role!r}")
        if not blocks:
            continue  # Anthropic refuses an empty turn
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns


def _blocks(content: Any, *, images: bool) -> list[dict[str, Any]]:
    """Message content (a string or parts) as content blocks; empty text is left out, as
    Anthropic refuses it."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("text", "refusal"):
            text = part.get(kind)
            if isinstance(text, str) and text:
                block: dict[str, Any] = {"type": "text", "text": text}
                if isinstance(part.get("cache_control"), Mapping):
                    block["cache_control"] = part["cache_control"]
                out.append(block)
        elif kind == "image_url" and images:
            out.append(_image(part.get("image_url")))
        elif kind == "document" and images and isinstance(part.get("document"), Mapping):
            out.append(dict(part["document"]))  # a Messages client's block, as it came
        else:
            raise _unsupported(f"a content part of type {kind!r}")
    return out


def _image(image: Any) -> dict[str, Any]:
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str):
        raise _unsupported("an image_url without a url")
    if url.startswith("data:"):
        match = _DATA_URL.match(url)
        if match is None:
            raise _unsupported("an image data URL that is not base64")
        source = {"type": "base64", "media_type": match[1], "data": match[2]}
    else:
        source = {"type": "url", "url": url}
    return {"type": "image", "source": source}


def _assistant_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    blocks = _blocks(message.get("content"), images=False)
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": function.get("name") or "",
                "input": _input(function.get("arguments")),
            }
        )
    return blocks


def _input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments JSON as `input`: what is not a JSON object is kept under
    `"arguments"` rather than lost (as `formats.anthropic` does)."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _tool_result(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    result: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": message.get("tool_call_id") or message.get("name") or "",
    }
    if isinstance(content, str):
        result["content"] = content
    elif content:
        result["content"] = _blocks(content, images=True)
    return result


def _trim_prefill(turns: list[dict[str, Any]]) -> str:
    """Cut the trailing whitespace off the final assistant turn's text (dropping a block or
    the turn that was only whitespace); returns what was cut."""
    blocks = turns[-1]["content"]
    last = blocks[-1]
    if last["type"] != "text":
        return ""
    text: str = last["text"]
    kept = text.rstrip()
    if kept:
        blocks[-1] = {**last, "text": kept}
    else:
        blocks.pop()
        if not blocks:
            turns.pop()
    return text[len(kept) :]


def _tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
        raise _unsupported(f"a tool of type {kind!r} (only function tools)")
    function = tool.get("function") or {}
    spec: dict[str, Any] = {
        "name": function.get("name") or "",
        "input_schema": function.get("parameters") or {"type": "object", "properties": {}},
    }
    if function.get("description"):
        spec["description"] = function["description"]
    return spec


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    out: dict[str, Any] | None
    if choice is None:
        out = None
    elif choice in ("auto", "none"):
        out = {"type": choice}
    elif choice == "required":
        out = {"type": "any"}
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        out = {"type": "tool", "name": choice["function"].get("name") or ""}
    else:
        raise _unsupported(f"a tool_choice of {choice!r}")
    if parallel is False and (out is None or out["type"] != "none"):
        out = {**(out or {"type": "auto"}), "disable_parallel_tool_use": True}
    return out


def _metadata_user(chat: Mapping[str, Any]) -> str | None:
    """The end user's id: Messages' `metadata` takes only `user_id` (it refuses the other keys
    of Chat Completions' `metadata`, which is about stored completions)."""
    metadata = chat.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    if isinstance(user_id, str):
        return user_id
    user = chat.get("user")
    return user if isinstance(user, str) else None


def _thinking_from_effort(body: dict[str, Any], effort: Any) -> None:
    budget = _THINKING_BUDGET.get(effort) if isinstance(effort, str) else None
    if budget is None:
        return
    # Anthropic wants max_tokens above the budget, and a budget of at least 1024.
    max_tokens = body["max_tokens"]
    if isinstance(max_tokens, int):
        budget = min(budget, max_tokens - 1)
    if budget < _MIN_THINKING_BUDGET:
        return
    body["thinking"] = {"type": "enabled", "budget_tokens": budget}
    # With thinking on, Anthropic takes no temperature but 1 and no top_p under 0.95.
    if body.get("temperature") not in (None, 1.0):
        del body["temperature"]
    if isinstance(body.get("top_p"), int | float) and body["top_p"] < 0.95:
        del body["top_p"]


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _unsupported(what: str) -> EngineError:
    return EngineError(
        "unsupported_for_target",
        f"an Anthropic-format target cannot take {what}",
        type_="invalid_request_error",
        status=400,
        client_fault=True,
    )


# -- the events -----------------------------------------------------------------------------


class MessagesReader:
    """One stream's upstream events → deltas. `feed()` turns one event into at most one delta;
    `message_stop` makes the last one (finish reason and usage) and sets `done`.

    Tool calls are numbered by their tool_use blocks from 0, whatever their block index. Text
    after a trimmed prefill first loses the whitespace it repeats of `trimmed`.
    """

    __slots__ = ("_blocks", "_calls", "_finish", "_trim", "_usage", "done")

    def __init__(self, trimmed: str = "") -> None:
        self.done = False
        self._trim = trimmed
        self._blocks: dict[int, int] = {}  # a tool_use block's index → its tool-call index
        self._calls: dict[int, bool] = {}  # tool-call index → arguments seen
        self._finish = "stop"
        self._usage = dict.fromkeys(_USAGE_KEYS, 0)

    def feed(self, event: str | None, data: str | None) -> Delta | None:
        try:
            obj = orjson.loads(data or "")
        except orjson.JSONDecodeError:
            raise _bad_response(f"non-JSON data: {(data or '')[:200]!r}") from None
        if not isinstance(obj, dict):
            raise _bad_response(f"a JSON {type(obj).__name__} where an event belongs")
        kind = obj.get("type") or event
        if event == "error" or kind == "error":
            raise stream_error(obj)
        try:
            return self._event(kind, obj)
        except (AttributeError, KeyError, TypeError):
            raise _bad_response(f"an event of the wrong shape: {(data or '')[:200]!r}") from None

    def _event(self, kind: Any, obj: dict[str, Any]) -> Delta | None:
        if kind == "content_block_delta":
            return self._delta(obj["index"], obj["delta"])
        if kind == "content_block_start":
            return self._start(obj["index"], obj["content_block"])
        if kind == "content_block_stop":
            call = self._blocks.get(obj["index"])
            if call is not None and not self._calls[call]:
                # A call without arguments: "{}", which OpenAI clients parse, not "".
                return Delta(tool_calls=(ToolCallDelta(call, arguments="{}"),))
            return None
        if kind == "message_start":
            self._count(obj["message"].get("usage"))
        elif kind == "message_delta":
            reason = obj["delta"].get("stop_reason")
            if reason:
                self._finish = _FINISH.get(reason, "stop")
            self._count(obj.get("usage"))  # cumulative counts
        elif kind == "message_stop":
            self.done = True
            return Delta("", self._finish, usage=self.usage())
        return None  # ping, and event types newer than this reader

    def _start(self, index: int, block: Mapping[str, Any]) -> Delta | None:
        kind = block["type"]
        if kind == "tool_use":
            call = len(self._calls)
            self._blocks[index] = call
            self._calls[call] = False
            self._trim = ""
            return Delta(tool_calls=(ToolCallDelta(call, block.get("id"), block.get("name")),))
        if kind == "text" and block.get("text"):
            return self._text(block["text"])
        if kind == "thinking" and block.get("thinking"):
            return Delta(reasoning=block["thinking"])
        return None  # redacted_thinking, server tools' blocks: nothing a client reads

    def _delta(self, index: int, delta: Mapping[str, Any]) -> Delta | None:
        kind = delta["type"]
        if kind == "text_delta":
            return self._text(delta["text"])
        if kind == "thinking_delta":
            return Delta(reasoning=delta["thinking"]) if delta["thinking"] else None
        if kind == "input_json_delta":
            call = self._blocks[index]
            piece = delta["partial_json"]
            if not piece:
                return None
            self._calls[call] = True
            return Delta(tool_calls=(ToolCallDelta(call, arguments=piece),))
        return None  # signature_delta, citations_delta

    def _text(self, text: str) -> Delta | None:
        if self._trim:
            n = 0
            limit = min(len(text), len(self._trim))
            while n < limit and text[n] == self._trim[n]:
                n += 1
            if n == len(text):
                self._trim = self._trim[n:]  # all of it repeated: the next may repeat more
                return None
            text, self._trim = text[n:], ""
        return Delta(text) if text else None

    def _count(self, usage: Any) -> None:
        if isinstance(usage, Mapping):
            for key in _USAGE_KEYS:
                value = usage.get(key)
                if isinstance(value, int):
                    self._usage[key] = value

    def usage(self) -> dict[str, Any]:
        """Usage in Chat Completions' terms: the prompt counts the cache's tokens too."""
        u = self._usage
        cached = u["cache_read_input_tokens"]
        prompt = u["input_tokens"] + u["cache_creation_input_tokens"] + cached
        out = u["output_tokens"]
        return {
            "prompt_tokens": prompt,
            "completion_tokens": out,
            "total_tokens": prompt + out,
            # cache_write_tokens: the Responses API's name; priced apart (cache_write).
            "prompt_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": u["cache_creation_input_tokens"],
            },
        }


_USAGE_KEYS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
)


# -- errors ---------------------------------------------------------------------------------


def stream_error(obj: Mapping[str, Any]) -> EngineError:
    """An `event: error` after the 200 (`{"type": "error", "error": {"type", "message"}}`)."""
    err = obj.get("error")
    kind = err.get("type") if isinstance(err, Mapping) else None
    # The type becomes the error's code: one of a known form only (it reaches metrics' peers).
    kind = kind if isinstance(kind, str) and _CODE.match(kind) else "api_error"
    message = shaped_message(obj) or f"the upstream failed ({kind})"
    if kind in _RETRYABLE_TYPES:
        error = EngineError(kind, message, retryable=True)
    else:
        error = EngineError(kind, message, type_="invalid_request_error", client_fault=True)
    error.upstream_said = str(err)[:2000] if err is not None else None
    return error


def http_error(raw: bytes, status: int, headers: Mapping[str, str], now: float) -> EngineError:
    """An error answer before the stream: 429, 529 and 5xx are the target's (retryable, with
    its Retry-After); 401, 403 and 404 the target's set-up; any other 4xx the request's own
    (`upstream_rejected`, with the upstream's status and message)."""
    # The upstream's message from an error body shaped for clients (Anthropic's, OpenAI's),
    # cleaned; any other body only as its status (`upstream_errors`).
    message = shaped_message(raw) or generic(status)
    wait = retry_after(headers.get("retry-after"), now)
    if status == 429 or status >= 500:
        error = EngineError(
            f"upstream_{status}", message, retryable=True, status=status, retry_after_s=wait
        )
    else:
        target = status in TARGET_FAULTS
        error = EngineError(
            "upstream_rejected",
            # The client may read it as a 502 (routes): the upstream's own status goes along.
            f"the upstream answered {status}: {message}" if target else message,
            retryable=target,
            type_="server_error" if target else "invalid_request_error",
            status=status,
            client_fault=not target,
            retry_after_s=wait,
        )
    error.upstream_said = plain_text(raw, 2000)
    return error


def _bad_response(what: str) -> EngineError:
    return EngineError("upstream_bad_response", f"the upstream sent {what}", retryable=True)


# -- the engine -----------------------------------------------------------------------------


class AnthropicRelay(RemoteEngine):
    """kind = "anthropic": one Messages API upstream."""

    log_name = "anthropic"
    models_params: ClassVar[Mapping[str, str | int]] = {"limit": 1000}  # pages of 20 else

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        errors: str = "pass",
    ) -> None:
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        super().__init__(
            url,
            headers=headers,
            model=model,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            errors=errors,
        )

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        call = messages_body(request, self.model)
        return self.post(
            request,
            "/messages",
            orjson.dumps(call.body),
            lambda resp, raw: http_error(raw, resp.status_code, resp.headers, time.time()),
            lambda resp: self._deltas(resp, MessagesReader(call.trimmed)),
        )

    async def _deltas(
        self, resp: UpstreamResponse, reader: MessagesReader
    ) -> AsyncGenerator[Delta, None]:
        ctype = resp.headers.get("content-type", "")
        if "json" in ctype and "event-stream" not in ctype:
            # One JSON body where a stream belongs: an error, or a server that ignored `stream`.
            raw = await resp.read_bounded()
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and obj.get("type") == "error":
                raise stream_error(obj)
            raise _bad_response(f"a JSON body, not an event stream: {raw[:200]!r}")
        identity = resp.headers.get("content-encoding", "identity") == "identity"
        chunks = resp.aiter_raw() if identity else resp.aiter_bytes()
        async for delta in read_stream(chunks, reader):
            if delta.finish_reason is None:
                self.tokens_generated += 1
            yield delta


async def read_stream(chunks: AsyncIterator[bytes], reader: MessagesReader) -> AsyncIterator[Delta]:
    """An event stream's bytes → deltas, to `message_stop`; a body that ends before it is
    `upstream_truncated` (retryable: nothing says the answer was complete)."""
    decoder = EventDecoder()
    async for chunk in chunks:
        for event in decoder.feed(chunk):
            delta = reader.feed(event.event, event.data)
            if reader.done:
                await drain(chunks)  # the connection goes back to the pool
            if delta is not None:
                yield delta
            if reader.done:
                return
        decoder.comments.clear()  # heartbeats: nothing to keep
        if decoder.pending_bytes() > _MAX_EVENT_BYTES:
            raise _bad_response(f"an event over {_MAX_EVENT_BYTES} bytes (malformed SSE)")
    raise EngineError(
        "upstream_truncated", "the upstream ended the stream before message_stop", retryable=True
    )
