"""Renderers: engine output → the data payloads of each API's events.

The per-token payload is a precomputed prefix + the JSON-escaped token + a suffix: no dict is
built and no full document is serialised per token.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import orjson

from firsttoken.wire.errors import error_body

__all__ = ["ChatRenderer", "CompletionRenderer", "NativeRenderer"]

DONE = b"[DONE]"
_dumps = orjson.dumps


class _OpenAIRenderer:
    __slots__ = ("_prefix", "_suffix", "head", "include_usage")
    object: str
    token_event: str | None = None

    def __init__(self, chunk_id: str, model: str, created: int, include_usage: bool) -> None:
        self.head = {"id": chunk_id, "object": self.object, "created": created, "model": model}
        self.include_usage = include_usage
        head = _dumps(self.head)[:-1]  # the JSON object without its closing brace
        self._prefix, self._suffix = self._token_frame(head)

    def _token_frame(self, head: bytes) -> tuple[bytes, bytes]:
        raise NotImplementedError

    def token(self, text: str) -> bytes:
        return self._prefix + _dumps(text) + self._suffix

    def token_template(self) -> tuple[bytes, bytes]:
        """The bytes around a token's JSON string (the stream frames them once)."""
        return self._prefix, self._suffix

    def closing(
        self, finish_reason: str, usage: dict[str, int]
    ) -> Sequence[tuple[str | None, bytes]]:
        out: list[tuple[str | None, bytes]] = [
            (None, _dumps({**self.head, "choices": [self._final(finish_reason)]}))
        ]
        if self.include_usage:
            out.append((None, _dumps({**self.head, "choices": [], "usage": usage})))
        out.append((None, DONE))
        return out

    def _final(self, finish_reason: str) -> dict[str, object]:
        raise NotImplementedError

    def error(self, code: str, message: str, type_: str = "server_error") -> bytes:
        return error_body(code, message, type_)


class ChatRenderer(_OpenAIRenderer):
    __slots__ = ()
    object = "chat.completion.chunk"

    def _token_frame(self, head: bytes) -> tuple[bytes, bytes]:
        return (
            head + b',"choices":[{"index":0,"delta":{"content":',
            b'},"logprobs":null,"finish_reason":null}]}',
        )

    def opening(self) -> Sequence[tuple[str | None, bytes]]:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [(None, _dumps({**self.head, "choices": [choice]}))]

    def _final(self, finish_reason: str) -> dict[str, object]:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}


class CompletionRenderer(_OpenAIRenderer):
    __slots__ = ()
    object = "text_completion"

    def _token_frame(self, head: bytes) -> tuple[bytes, bytes]:
        return head + b',"choices":[{"index":0,"text":', b',"logprobs":null,"finish_reason":null}]}'

    def opening(self) -> Sequence[tuple[str | None, bytes]]:
        return ()

    def _final(self, finish_reason: str) -> dict[str, object]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}


class NativeRenderer:
    """`data: {"token": ...}` per token (or, binary, `event: token` with base64 UTF-8);
    a closing `event: meta` with finish and usage."""

    def __init__(self, binary: bool = False) -> None:
        self.binary = binary
        self.token_event = "token" if binary else None

    def opening(self) -> Sequence[tuple[str | None, bytes]]:
        return ()

    def token(self, text: str) -> bytes:
        if self.binary:
            return base64.b64encode(text.encode())
        return b'{"token":' + _dumps(text) + b"}"

    def token_template(self) -> tuple[bytes, bytes]:
        return b'{"token":', b"}"

    def closing(
        self, finish_reason: str, usage: dict[str, int]
    ) -> Sequence[tuple[str | None, bytes]]:
        meta = {
            "finish_reason": finish_reason,
            "tokens": usage["completion_tokens"],
            "remaining": 0,
            "usage": usage,
        }
        return [("meta", _dumps(meta)), (None, DONE)]

    def error(self, code: str, message: str, type_: str = "server_error") -> bytes:
        return error_body(code, message, type_)
