"""The Python client: text deltas, invisible resume, and nothing lost when a stream breaks.

    from firsttoken.client import Client
    with Client("http://127.0.0.1:8000") as client:
        answer = client.chat([{"role": "user", "content": "hi"}], max_tokens=100)
        for delta in answer:
            print(delta, end="")

A dropped connection is resumed from the last event id with backoff; a stream that ends
without `[DONE]` and cannot be resumed raises `StreamInterrupted`; an `event: error` raises
`StreamError`. Both carry the text received so far. A create refused with 503 before its
first byte (`server_draining`, `overloaded`: nothing was started) is sent again after the
server's `Retry-After`, at most `create_retries` times; nothing is sent again after a 200.

`AsyncClient` has the shape of the openai SDK's async client: every call is awaited, and what
it returns is iterated with `async for`:

    async with AsyncClient("http://127.0.0.1:8000") as client:
        answer = await client.chat([{"role": "user", "content": "hi"}])  # or .stream, .resume
        async for delta in answer:
            print(delta, end="")

It depends only on the wire format.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Generator, Iterator, Mapping, Sequence
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import anyio
import httpx

from firsttoken.formats.sse import EventDecoder, ServerSentEvent

__all__ = ["AsyncClient", "Client", "StreamError", "StreamInterrupted", "TextStream"]

_DROPS = (httpx.TransportError,)  # connect, read and protocol errors alike


class StreamError(Exception):
    """The server ended the stream with `event: error`, or refused it before its first byte
    (`status` is then the HTTP status, and `retry_after_s` its `Retry-After`, if any)."""

    def __init__(
        self,
        code: str,
        message: str,
        text: str,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.text = text
        self.status = status
        self.retry_after_s = retry_after_s


# Refusals of a resume that pass: the stream's instance was replaced meanwhile (a deploy, a
# crash: another instance takes it over), the instance reached is on its way out and sends
# its readers elsewhere, or a proxy in front found none of them for a moment.
_PASSING = frozenset(
    (
        "stream_not_found",
        "store_unavailable",
        "server_draining",
        "http_502",
        "http_503",
        "http_504",
    )
)


class StreamInterrupted(Exception):
    """The stream ended without `[DONE]` and could not be resumed."""

    def __init__(self, reason: str, text: str, last_event_id: str) -> None:
        super().__init__(f"response interrupted: {reason}")
        self.reason = reason
        self.text = text
        self.last_event_id = last_event_id


class TextStream:
    """The state of one answer: what arrived, where to resume, how it ended.

    Sans-IO: `Client` and `AsyncClient` feed it bytes and iterate the deltas it returns.
    """

    def __init__(self) -> None:
        self.stream_id: str | None = None
        self.resume_token: str | None = None
        self.last_event_id = ""
        self.parts: list[str] = []
        self.reasoning_parts: list[str] = []
        # Tool calls as they assemble: {"id", "name", "arguments"} by index.
        self._calls: dict[int, dict[str, str]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None
        self.done = False
        self.interrupted = False
        self.reconnects = 0
        self._decoder = EventDecoder()

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    @property
    def tool_calls(self) -> list[dict[str, str]]:
        """The answer's tool calls so far, `arguments` as the JSON text received."""
        return [dict(self._calls[i]) for i in sorted(self._calls)]

    def _tool_call(self, index: int, call_id: str | None, name: str | None, args: str) -> None:
        call = self._calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
        call["id"] = call_id or call["id"]
        call["name"] = name or call["name"]
        call["arguments"] += args

    def _connected(self, response: httpx.Response) -> None:
        self.stream_id = response.headers.get("x-stream-id", self.stream_id)
        self.resume_token = response.headers.get("x-resume-token", self.resume_token)
        self._decoder = EventDecoder()  # a new connection starts a new event stream

    def _feed(self, chunk: bytes) -> list[str]:
        deltas: list[str] = []
        for event in self._decoder.feed(chunk):
            delta = self._event(event)
            if delta:
                deltas.append(delta)
        return deltas

    def _event(self, event: ServerSentEvent) -> str | None:
        if event.id:
            self.last_event_id = event.id
        if event.event == "error":
            err = json.loads(event.data or "{}").get("error", {})
            raise StreamError(err.get("code", "error"), err.get("message", ""), self.text)
        if event.data == "[DONE]":
            self.done = True
            return None
        if event.event is not None or not event.data:
            if event.event == "meta":
                meta = json.loads(event.data or "{}")
                self.finish_reason = meta.get("finish_reason", self.finish_reason)
                self.usage = meta.get("usage", self.usage)
            return None
        payload = json.loads(event.data)
        if "token" in payload:
            text = payload["token"]
        elif "reasoning" in payload:  # native structured deltas: kept, not yielded
            self.reasoning_parts.append(payload["reasoning"])
            return None
        elif "tool_call" in payload:
            call = payload["tool_call"]
            self._tool_call(call["index"], call.get("id"), call.get("name"), call["arguments"])
            return None
        else:
            if payload.get("usage"):
                self.usage = payload["usage"]
            choices = payload.get("choices") or []
            if not choices:
                return None
            choice = choices[0]
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if thought:
                self.reasoning_parts.append(thought)
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                self._tool_call(
                    call.get("index", 0),
                    call.get("id"),
                    function.get("name"),
                    function.get("arguments") or "",
                )
            text = delta.get("content") or choice.get("text") or ""
        if text:
            self.parts.append(text)
        return text or None


class _Base:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        max_retries: int = 5,
        backoff_s: float = 0.25,
        max_backoff_s: float = 4.0,
        timeout_s: float = 60.0,
        create_retries: int = 2,
        max_retry_after_s: float = 60.0,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.create_retries = create_retries
        self.max_retry_after_s = max_retry_after_s
        self.timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**attempt)

    def _create_again(self, refusal: StreamError, attempt: int) -> float | None:
        """The wait before sending a refused create again (`attempt` retries so far), or None
        to give up. Only a 503 answered before the first byte: the instance started nothing
        (draining, shedding, its breaker open), and another instance, or this one after its
        `Retry-After`, may take it. A 429 is the key's own limit, never retried here; a wait
        beyond `max_retry_after_s` is given up at once rather than slept."""
        if refusal.status != 503 or attempt >= self.create_retries:
            return None
        wait = refusal.retry_after_s
        if wait is None:
            return self._delay(attempt)
        return wait if wait <= self.max_retry_after_s else None

    def _resume_request(self, stream: TextStream) -> tuple[str, dict[str, str]]:
        url = f"{self.base_url}/v1/streams/{stream.stream_id}/events"
        headers = {"Authorization": f"Bearer {stream.resume_token}", "Accept": "text/event-stream"}
        if stream.last_event_id:
            headers["Last-Event-ID"] = stream.last_event_id
        return url, headers

    @staticmethod
    def _chat_body(messages: Sequence[Mapping[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": params.pop("model", None),
            "messages": list(messages),
            "stream": True,
            **params,
        }

    @staticmethod
    def _check(response: httpx.Response) -> None:
        if response.status_code >= 400:
            try:
                err = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                err = {"code": f"http_{response.status_code}", "message": response.text}
            raise StreamError(
                err.get("code") or "error",
                err.get("message", ""),
                "",
                status=response.status_code,
                retry_after_s=_retry_after(response.headers.get("retry-after")),
            )


class Client(_Base):
    """Synchronous client (httpx)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self._http = httpx.Client(timeout=self.timeout, headers=self._headers())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def chat(self, messages: Sequence[Mapping[str, Any]], **params: Any) -> Answer:
        """Stream `/v1/chat/completions`; params are the OpenAI body fields."""
        body = self._chat_body(messages, params)
        return Answer(self, ("POST", f"{self.base_url}/v1/chat/completions", body))

    def stream(self, prompt: str, **params: Any) -> Answer:
        """Create a native stream (`POST /v1/streams`) and read it."""
        attempt = 0
        while True:
            r = self._http.post(f"{self.base_url}/v1/streams", json={"prompt": prompt, **params})
            try:
                self._check(r)
                break
            except StreamError as refusal:
                wait = self._create_again(refusal, attempt)
                if wait is None:
                    raise
            attempt += 1
            time.sleep(wait)
        info = r.json()
        return self.resume(info["id"], info["resume_token"])

    def resume(self, stream_id: str, resume_token: str, last_event_id: str = "") -> Answer:
        return _resumed(Answer(self, None), stream_id, resume_token, last_event_id)


class _Answer:
    """What the sync and async answers share: state, the request to (re)open, and the
    decision after a break (resume after a delay, or give up with the partial text)."""

    def __init__(self, client: _Base, first: tuple[str, str, dict[str, Any]] | None) -> None:
        self.client = client
        self.state = TextStream()
        self._first = first
        self._attempt = 0
        self._refused = 0  # creates refused before their first byte, sent again
        self._opened_once = False  # a 200 came: the create is never sent again

    @property
    def text(self) -> str:
        return self.state.text

    def __getattr__(self, name: str) -> Any:
        return getattr(self.state, name)

    def _request(self) -> tuple[str, str, dict[str, Any]]:
        if self._first is not None:
            method, url, body = self._first
            return method, url, {"json": body}
        url, headers = self.client._resume_request(self.state)
        return "GET", url, {"headers": headers}

    def _opened(self, response: httpx.Response) -> bool:
        """False when there is nothing to read (204: everything was already delivered)."""
        if response.status_code == 204:
            self.state.done = True
            return False
        self.client._check(response)
        self.state._connected(response)
        self._opened_once = True
        self._attempt = 0
        return True

    def _broken(self, exc: Exception | None) -> float:
        """After a break: the delay before resuming, or raise with the text kept."""
        state, client = self.state, self.client
        if isinstance(exc, StreamError) and self._first is not None and not self._opened_once:
            wait = client._create_again(exc, self._refused)
            if wait is not None:  # refused before its first byte: nothing was started
                self._refused += 1
                return wait
        if isinstance(exc, StreamError):
            if not state.stream_id or exc.code not in _PASSING:
                raise StreamError(
                    exc.code, exc.message, state.text, exc.status, exc.retry_after_s
                ) from None
            reason = exc.message
        elif exc is not None:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = "the stream ended without [DONE]"
        if (
            state.stream_id is None
            or state.resume_token is None
            or (self._attempt >= client.max_retries)
        ):
            state.interrupted = True
            raise StreamInterrupted(reason, state.text, state.last_event_id)
        delay = client._delay(self._attempt)
        self._attempt += 1
        state.reconnects += 1
        self._first = None
        return delay


class Answer(_Answer):
    """Iterate for text deltas; `.text`, `.finish_reason`, `.usage` afterwards."""

    client: Client

    def __iter__(self) -> Iterator[str]:
        state = self.state
        while True:
            error: Exception | None = None
            try:
                method, url, kwargs = self._request()
                with self.client._http.stream(method, url, **kwargs) as response:
                    if response.status_code >= 400:
                        response.read()
                    if not self._opened(response):
                        return
                    for chunk in response.iter_raw():
                        yield from state._feed(chunk)
                        if state.done:
                            return
            except (*_DROPS, StreamError) as exc:
                error = exc
            time.sleep(self._broken(error))


class AsyncClient(_Base):
    """Asynchronous client (httpx.AsyncClient); same behaviour as `Client`."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self._http = httpx.AsyncClient(timeout=self.timeout, headers=self._headers())

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # Every call is awaited (`answer = await client.chat(...)`), as in the openai SDK. `chat`
    # and `resume` send nothing until the first `async for` step, so they return an answer
    # that awaits to itself: `async for delta in client.chat(...)`, the older form, works too.

    def chat(self, messages: Sequence[Mapping[str, Any]], **params: Any) -> AsyncAnswer:
        """Stream `/v1/chat/completions`; params are the OpenAI body fields."""
        body = self._chat_body(messages, params)
        return AsyncAnswer(self, ("POST", f"{self.base_url}/v1/chat/completions", body))

    async def stream(self, prompt: str, **params: Any) -> AsyncAnswer:
        """Create a native stream (`POST /v1/streams`: errors raise here) and read it."""
        attempt = 0
        while True:
            r = await self._http.post(
                f"{self.base_url}/v1/streams", json={"prompt": prompt, **params}
            )
            try:
                self._check(r)
                break
            except StreamError as refusal:
                wait = self._create_again(refusal, attempt)
                if wait is None:
                    raise
            attempt += 1
            await anyio.sleep(wait)
        info = r.json()
        return self.resume(info["id"], info["resume_token"])

    def resume(self, stream_id: str, resume_token: str, last_event_id: str = "") -> AsyncAnswer:
        return _resumed(AsyncAnswer(self, None), stream_id, resume_token, last_event_id)


class AsyncAnswer(_Answer):
    """`async for` text deltas; `.text`, `.finish_reason`, `.usage` afterwards. Awaiting it
    gives itself, so that every `AsyncClient` call has one shape: `await`, then `async for`."""

    client: AsyncClient

    def __await__(self) -> Generator[Any, None, AsyncAnswer]:
        async def itself() -> AsyncAnswer:
            return self

        return itself().__await__()

    async def __aiter__(self) -> AsyncIterator[str]:
        state = self.state
        while True:
            error: Exception | None = None
            try:
                method, url, kwargs = self._request()
                async with self.client._http.stream(method, url, **kwargs) as response:
                    if response.status_code >= 400:
                        await response.aread()
                    if not self._opened(response):
                        return
                    async for chunk in response.aiter_raw():
                        for delta in state._feed(chunk):
                            yield delta
                        if state.done:
                            return
            except (*_DROPS, StreamError) as exc:
                error = exc
            await anyio.sleep(self._broken(error))


A = TypeVar("A", bound=_Answer)


def _retry_after(value: str | None) -> float | None:
    """A `Retry-After` header's wait in seconds (delay-seconds or an HTTP date), or None."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _resumed(answer: A, stream_id: str, resume_token: str, last_event_id: str) -> A:
    state = answer.state
    state.stream_id, state.resume_token, state.last_event_id = (
        stream_id,
        resume_token,
        last_event_id,
    )
    return answer
