"""The relay engine: stream from one OpenAI-compatible upstream (vLLM, SGLang, TGI, Ollama,
llama.cpp server, OpenAI), one delta per upstream chunk, with errors normalised to
`EngineError`.

Choosing among upstreams, failing over and splicing a cut answer onto another are the routes'
(`firsttoken/routing/`): this engine is one target.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import orjson

from firsttoken.engines.remote import RemoteEngine
from firsttoken.engines.upstream import (
    UpstreamError,
    UpstreamResponse,
    drain,
    plain_text,
    retry_after,
)
from firsttoken.engines.upstream_errors import generic, shaped_message
from firsttoken.formats.chunks import BadChunk, chunk_delta
from firsttoken.formats.sse import EventDecoder, ServerSentEvent
from firsttoken.generation import (
    ENDPOINTS,
    TARGET_FAULTS,
    Delta,
    EmbeddingRequest,
    Embeddings,
    EngineError,
    GenerationRequest,
    not_embedding,
)

__all__ = ["GATEWAY_FIELDS", "RelayEngine", "normalise_error"]

# An embeddings answer is read whole, up to this: 2,048 inputs of 1,536 floats as JSON text,
# or of 3,072 as base64.
MAX_EMBEDDINGS_BYTES = 64 << 20
# Older TGI finish reasons, mapped to OpenAI's.
_FINISH = {"eos_token": "stop", "stop_sequence": "stop"}
_CODE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_MAX_EVENT_BYTES = 4 * 1024 * 1024
_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")
# Body fields a client may not pass to an upstream: they reach past the request itself, into
# other keys' share of the engine (vLLM's and SGLang's scheduling `priority`: a key's place
# comes from the keys file, in the gateway's own queue), its cost beyond max_tokens
# (`best_of`, beam search), or the engine's bookkeeping (request ids, KV transfer between
# instances, plugin arguments).
GATEWAY_FIELDS = frozenset(
    (
        "priority",
        "best_of",
        "use_beam_search",
        "request_id",
        "rid",
        "kv_transfer_params",
        "vllm_xargs",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
    )
)


class RelayEngine(RemoteEngine):
    """kind = "openai": one OpenAI-compatible upstream.

    `model`, when given, is the name the upstream knows (sent instead of the client's).
    `completions_template`, when given, continues a cut chat answer through `/completions`
    with the conversation rendered here (for servers without `continue_final_message`).
    """

    log_name = "relay"

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        completions_template: str | None = None,
        errors: str = "pass",
        serves: tuple[str, ...] = ("embeddings",),
    ) -> None:
        super().__init__(
            url,
            headers={"authorization": f"Bearer {api_key}"} if api_key else {},
            model=model,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            errors=errors,
        )
        self._template = completions_template
        self.serves = serves  # OpenAI's other endpoints the upstream answers (`ENDPOINTS`)

    # -- the Engine protocol ---------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        return self._stream(request)

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        """`POST /embeddings` (or the request's other endpoint, where the target `serves`
        it) with the client's body under the name the upstream knows: its answer as it
        came, counted by its own `usage`."""
        endpoint = request.endpoint
        if endpoint not in self.serves:
            raise not_embedding(request.model, endpoint)
        model = self.model or request.model
        call = GenerationRequest(
            request_id=request.request_id,
            prompt="",
            model=model,
            tenant=request.tenant,
            trace_id=request.trace_id,
        )
        resp: UpstreamResponse | None = None
        try:
            body = orjson.dumps({**request.body, "model": model})
            resp = await self.send(call, ENDPOINTS[endpoint], body, _refused)
            raw = await resp.read_bounded(MAX_EMBEDDINGS_BYTES)
        except (EngineError, UpstreamError) as exc:
            self.settle(exc, call)
            raise EngineError("upstream_error", f"the {endpoint} request was cut") from exc
        finally:
            self.done(call.request_id, resp)
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise _bad_response(f"{endpoint} that are not JSON (or over 64 MiB)") from None
        listed = "results" if endpoint == "moderations" else "data"  # embeddings', images'
        if not isinstance(answer, dict) or not isinstance(answer.get(listed), list):
            raise _bad_response(f"{endpoint} without a `{listed}` list")
        usage = answer.get("usage")
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return Embeddings(answer, tokens if isinstance(tokens, int) and tokens >= 0 else 0)

    # -- internals -------------------------------------------------------------------------

    def _body(self, request: GenerationRequest) -> tuple[str, bytes]:
        """The upstream request: the client's body as it came (every field: tools, content
        parts, response_format...), changed only where the gateway must: the model it
        routes to, streaming on, usage on, firsttoken's own stream options off, the
        `max_tokens` admission allowed, and no `GATEWAY_FIELDS`."""
        model = self.model or request.model
        continuing = "continuation" in request.options
        if continuing and self._template is not None and request.messages is not None:
            return self._completions_body(request, model)
        if request.body is not None:
            body = {k: v for k, v in request.body.items() if k not in GATEWAY_FIELDS}
            chat = "messages" in body or "prompt" not in body
            options = body.get("stream_options")
            options = dict(options) if isinstance(options, Mapping) else {}
            for own in _OWN_STREAM_OPTIONS:
                options.pop(own, None)
            options["include_usage"] = True
            body.update(model=model, stream=True, stream_options=options)
            if request.options.get("documents") and isinstance(body.get("messages"), list):
                body["messages"] = [_with_files(m) for m in body["messages"]]
            limit = request.max_tokens
            if limit is not None:
                # What admission held, in every field the client named: servers differ on
                # which wins when both come (vLLM: max_completion_tokens), so neither may
                # say more than the other.
                named = [f for f in _LIMIT_FIELDS if body.get(f) is not None]
                for name in named or (("max_completion_tokens",) if chat else ("max_tokens",)):
                    body[name] = limit
            return ("/chat/completions" if chat else "/completions"), orjson.dumps(body)
        body = {"model": model, "stream": True}
        if request.messages is not None:
            path = "/chat/completions"
            body["messages"] = [dict(m) for m in request.messages]
            if continuing:  # vLLM's and SGLang's way to continue the last message
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
        else:
            path = "/completions"
            # A completion continues by itself: the prompt grows by what was sent. Where the
            # seam is goes too: a firsttoken upstream's synthetic engine answers a grown
            # prompt as a new one without it (vLLM and SGLang ignore the field).
            body["prompt"] = request.prompt
            if continuing:
                text = request.options["continuation"]
                body["prompt"] += text
                body["continue_final_text"] = text
        self._sampling(request, body)
        return path, orjson.dumps(body)

    def _completions_body(self, request: GenerationRequest, model: str) -> tuple[str, bytes]:
        """A cut chat answer continued through /completions: the conversation rendered with
        the target's chat template, the assistant's text left open at its end."""
        assert request.messages is not None and self._template is not None
        body: dict[str, Any] = {
            "model": model,
            "stream": True,
            "prompt": render_open_chat(request.messages, self._template),
            "stream_options": {"include_usage": True},
        }
        self._sampling(request, body)
        return "/completions", orjson.dumps(body)

    @staticmethod
    def _sampling(request: GenerationRequest, body: dict[str, Any]) -> None:
        if request.max_tokens is not None:
            body["max_tokens"] = request.max_tokens
        if request.seed is not None:
            body["seed"] = request.seed
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.stop:
            body["stop"] = list(request.stop)
        # A firsttoken upstream's per-request knobs, sent only when the client gave them.
        synthetic = request.options.get("synthetic")
        if isinstance(synthetic, Mapping):
            knobs = {k: v for k, v in synthetic.items() if v is not None}
            if knobs:
                body["synthetic"] = knobs

    async def _stream(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        """One request's deltas, in one loop: the POST, the body's bytes as they come
        (`UpstreamResponse.take`), SSE decoded and each chunk parsed (`_ChunkReader`), each
        delta yielded. No generator of the upstream client's or the remote engine's in
        between: per upstream read, one wake of this generator and plain calls."""
        path, body = self._body(request)
        rid = request.request_id
        resp: UpstreamResponse | None = None
        try:
            resp = await self.send(request, path, body, _refused)
            ctype = resp.headers.get("content-type", "")
            if "json" in ctype and "event-stream" not in ctype:
                # A server that answers an error (or ignores `stream`) with one JSON body.
                raise normalise_error(await resp.read_bounded(), resp.status_code)
            reader = _ChunkReader(path == "/chat/completions")
            # Raw bytes unless the upstream compressed anyway (we ask for identity).
            decoded = None
            if resp.headers.get("content-encoding", "identity") != "identity":
                decoded = resp.aiter_bytes()
            while True:
                if decoded is None:
                    data = resp.take()
                    if not data:
                        if resp.ended:
                            break
                        await resp.wait()
                        continue
                else:
                    data = await anext(decoded, b"")
                    if not data:
                        break
                for delta in reader.feed_deltas(data):
                    if rid in self._aborted:
                        return  # not even what had already arrived
                    self.tokens_generated += 1
                    yield delta
                if reader.failure is not None:
                    raise reader.failure
                if reader.ended:
                    if decoded is not None:
                        await drain(decoded)
                    elif not resp.ended:  # the body's end usually came with [DONE]
                        await drain(resp.aiter_raw())
                    break
            last = reader.last(ctype)
            if rid not in self._aborted:
                yield last
        except (EngineError, UpstreamError) as exc:
            self.settle(exc, request)
        finally:
            self.done(rid, resp)


def _with_files(message: Any) -> Any:
    """A message whose Messages `document` parts are said as Chat Completions says them: a
    base64 one as a `file` part (its data URL), a text one as text. One by URL has no such
    shape: refused before anything is sent."""
    content = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(content, list):
        return message
    parts = []
    for part in content:
        document = part.get("document") if isinstance(part, Mapping) else None
        if not isinstance(document, Mapping) or part.get("type") != "document":
            parts.append(part)
            continue
        source = document.get("source") or {}
        if source.get("type") == "text":
            parts.append({"type": "text", "text": source.get("data", "")})
        elif source.get("type") == "base64":
            data = f"data:{source.get('media_type')};base64,{source.get('data')}"
            name = document.get("title") or "document"
            parts.append({"type": "file", "file": {"file_data": data, "filename": name}})
        else:
            raise EngineError(
                "unsupported_content",
                "a document by URL cannot go to an OpenAI-compatible target: send its "
                "content as base64 or text",
                type_="invalid_request_error",
                status=400,
                client_fault=True,
            )
    return {**message, "content": parts}


def _refused(resp: UpstreamResponse, raw: bytes) -> EngineError:
    return normalise_error(raw, resp.status_code, resp.headers.get("retry-after"))


def _bad_response(what: str) -> EngineError:
    # Retryable: before the first token another upstream may answer properly; after it the
    # relay never retries anyway (no text twice).
    return EngineError("upstream_bad_response", f"the upstream sent {what}", retryable=True)


_OWN_STREAM_OPTIONS = ("coalesce", "meta", "timestamps")
_BOM = "\ufeff".encode()


class _ChunkReader(EventDecoder):
    """An OpenAI-style event stream's bytes → deltas: SSE (plus llama.cpp server's
    `error: {json}` line, not an SSE field: it would be lost), each event's JSON parsed once
    and made a delta. `feed_deltas` is a plain call per upstream read; then `failure`, what
    the upstream broke off with after those deltas, or `ended`, once `[DONE]` came."""

    saw_event = False

    def __init__(self, chat: bool) -> None:
        super().__init__()
        self.chat = chat
        self.ended = False
        self.failure: EngineError | None = None
        self.received = 0
        self.finish: str | None = None  # held until the usage chunk or [DONE]: it has usage
        self.usage: dict[str, Any] | None = None

    def feed_deltas(self, chunk: bytes) -> list[Delta]:
        """The deltas of what arrived, up to the upstream's error (`failure`: its own, or
        `upstream_bad_response` for what is not a chunk) or `[DONE]`."""
        out: list[Delta] = []
        try:
            self._deltas(chunk, out)
        except EngineError as exc:
            self.failure = exc
        return out

    def _deltas(self, chunk: bytes, out: list[Delta]) -> None:
        self.received += len(chunk)
        plain = self._plain(chunk)
        if plain is not None:
            for data in plain:
                if self._one(data, out):
                    return
            return
        for event in EventDecoder.feed(self, chunk):
            text = event.data or ""
            if event.event == "error":
                raise normalise_error(text.encode(), bare=True)
            if self._one(text, out):
                return
        self.comments.clear()  # heartbeats: nothing to keep for a whole answer
        if self.pending_bytes() > _MAX_EVENT_BYTES:
            raise _bad_response(f"an event over {_MAX_EVENT_BYTES} bytes (malformed SSE)")

    def _plain(self, chunk: bytes) -> list[bytes] | None:
        """Each event's data, when `chunk` is whole events of one `data:` line each with LF
        line ends and nothing is held from before: what an upstream read almost always is,
        split without decoding it to text first. None: the full decoder reads it."""
        if (
            not chunk.endswith(b"\n\n")
            or chunk.find(b"\r") >= 0  # not `in`: see `formats.sse.encode_event`
            or self._buffer
            or self._has_fields
            or self._event
            or self._decoder_tail
            or self._pending_cr
            or (not self._started and chunk.startswith(_BOM))
        ):
            return None
        out = []
        for block in chunk[:-2].split(b"\n\n"):
            if not block.startswith(b"data:") or block.find(b"\n") >= 0:
                return None
            out.append(block[6:] if block[5:6] == b" " else block[5:])
        self._started = self.saw_event = True
        return out

    def _one(self, data: str | bytes, out: list[Delta]) -> bool:
        """One event's data: its delta into `out`; True at `[DONE]`."""
        if data == "[DONE]" or data == b"[DONE]":
            self.ended = True
            return True
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            text = data if isinstance(data, str) else data.decode("utf-8", "replace")
            try:
                obj = orjson.loads(text)  # the full decoder's text: bad UTF-8 replaced
            except orjson.JSONDecodeError:
                raise _bad_response(f"non-JSON data: {text[:200]!r}") from None
        if not isinstance(obj, dict):
            raise _bad_response(f"a JSON {type(obj).__name__} where a chunk belongs")
        if "error" in obj or obj.get("object") == "error":
            raise normalise_error(data if isinstance(data, bytes) else data.encode())
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        try:
            delta, finished = chunk_delta(obj, self.chat)
        except BadChunk as exc:
            raise _bad_response(str(exc)) from None
        if delta is not None:
            out.append(delta)
        if finished:
            self.finish = _FINISH.get(finished, finished)
        return False

    def last(self, ctype: str = "") -> Delta:
        """The delta that ends the answer, with its usage: at `[DONE]`, or at the body's
        end without one (raises what is wrong then)."""
        if self.ended:
            return Delta("", self.finish or "stop", usage=self.usage)
        if self.finish is not None:
            # Older TGI ends after the finish chunk without [DONE]: that is complete.
            return Delta("", self.finish, usage=self.usage)
        if self.received and not self.saw_event:
            # 200 and a body, but not a single event: a proxy's page, not an event stream.
            raise _bad_response(f"no events in a {ctype or 'untyped'!r} body")
        raise EngineError(
            "upstream_truncated",
            "the upstream ended the stream before it finished",
            retryable=True,
        )

    def _line(self, line: str) -> ServerSentEvent | None:
        if line.startswith("error:"):
            return ServerSentEvent(data=line[6:].strip(), event="error")
        event = super()._line(line)
        if event is not None:
            self.saw_event = True
        return event


def normalise_error(
    raw: bytes,
    status: int | None = None,
    retry_after_header: str | None = None,
    *,
    bare: bool = False,
) -> EngineError:
    """Any upstream error body (OpenAI, vLLM, TGI, llama.cpp, or not JSON) → EngineError.

    An HTTP 4xx other than 429 is `upstream_rejected`, carrying the upstream's status and
    message: the target's fault for 401, 403 and 404 (`TARGET_FAULTS`), else the request's
    own. Otherwise the code is the upstream's code string when it has one, else
    `upstream_<status>` (HTTP or the body's numeric code), else the error type. The message
    is the upstream's only from an error body in a shape written for clients
    (`upstream_errors.shaped_message`, cleaned); any other body's is `upstream_errors.generic`,
    and the raw text is kept as `upstream_said` for the log. `bare`: the body is the error
    object itself (an `event: error`, llama.cpp server's `error:` line).
    """
    try:
        obj: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    code_str: str | None = None
    code_num: int | None = None
    kind: str | None = None
    message: str | None = None
    if isinstance(obj, dict):
        message = shaped_message(obj)
        if message is None and bare and "error" not in obj:
            message = shaped_message({"error": obj})
        err = obj.get("error", obj)
        if isinstance(err, str):  # TGI: {"error": "...", "error_type": "..."}
            kind = obj.get("error_type")
        elif isinstance(err, dict):  # OpenAI, vLLM, llama.cpp; or vLLM's flat object
            kind = err.get("type") or err.get("error_type")
            code = err.get("code")
            if isinstance(code, str) and not code.isdigit():
                code_str = code
            elif isinstance(code, int | str) and str(code).isdigit():
                code_num = int(code)
    said = plain_text(raw, 2000)
    if status is not None and 400 <= status < 500 and status != 429:
        target = status in TARGET_FAULTS
        error = EngineError(
            "upstream_rejected",
            f"the upstream answered {status}: {message}" if message else generic(status),
            retryable=target,
            type_="server_error" if target else "invalid_request_error",
            status=status,
            client_fault=not target,
        )
        error.upstream_said = said
        return error
    if message is None:
        message = generic(status if status is not None else code_num)
    if code_str and _CODE.match(code_str):
        code = code_str
    elif status is not None or code_num is not None:
        code = f"upstream_{status if status is not None else code_num}"
    elif isinstance(kind, str) and _CODE.match(kind):
        code = kind
    else:
        code = "upstream_error"
    # Another upstream may do better after overload, a server error, or an in-stream error
    # (vLLM labels those 400 whatever broke).
    error = EngineError(
        code,
        message,
        retryable=True,
        status=status,
        retry_after_s=retry_after(retry_after_header),
    )
    error.upstream_said = said
    return error


def render_open_chat(messages: Any, template: str) -> str:
    """The conversation as a completion prompt whose last (assistant) message stays open, so
    the model writes on from its last character. Only ChatML is known (Qwen, SmolLM2, ...)."""
    if template != "chatml":
        raise ValueError(f"unknown chat template {template!r}")
    parts = [f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages]
    last = messages[-1]
    if last.get("role") == "assistant":
        parts[-1] = f"<|im_start|>assistant\n{last.get('content') or ''}"
    else:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
