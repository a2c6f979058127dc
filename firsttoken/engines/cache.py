"""A hot-prompt cache and canned greetings in front of any engine.

Cache: a request is *deterministic* when its temperature is 0 or it gives a seed. The complete
answer of a deterministic request is kept for `cache_ttl_s` seconds after it finished; an
identical request in that time (same model, normalised prompt or chat messages, max_tokens,
seed, temperature, stop, engine options) is served from the cache. Entries belong to the API
key that made them (`cache_scope` "key", the default): a hit of one key's entry by another
would tell it, by the answer's speed and the public hit counter, what the first one asked.
`cache_scope` "shared" shares them (an edge serving public hot prompts). Answers that
errored, were aborted or were cut off by the reader are never stored. Hits are streamed
*instantly* (one delta per original token, with a loop checkpoint between them so they stay
cancellable): the point of a hit is the TTFT it saves, and pacing it would only hold a slot
for show.

Canned answers: a TOML file (`canned_answers`) maps greetings to answers. A request whose
prompt (or, for chat, its single user message) matches after normalising (lowercase, spaces
collapsed, trailing `!.?` dropped) gets that answer streamed word by word, whatever its
sampling parameters.

Neither counts toward `tokens_generated` ("tokens the engine produced"); `cache_hits`,
`canned_hits` and `tokens_served` count them instead.
"""

from __future__ import annotations

import time
import tomllib
import unicodedata
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import orjson

from firsttoken.config import Settings
from firsttoken.engines.text import apply_stop, split_words
from firsttoken.generation import (
    BaseEngine,
    Delta,
    EmbeddingRequest,
    Embeddings,
    Engine,
    GenerationRequest,
)

__all__ = ["CachedEngine", "load_canned"]

MAX_ENTRIES = 1024  # least recently used entries go first
MAX_ANSWER_TOKENS = 8192  # longer answers are not kept (bounds the cache's memory)

_Key = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _Entry:
    expires: float
    tokens: tuple[str, ...]
    finish: str


def _text(value: str) -> str:
    return unicodedata.normalize("NFC", value).strip()


def _greeting(value: str) -> str:
    return " ".join(_text(value).lower().split()).rstrip("!.?。！？ ")


def load_canned(path: str | Path) -> dict[str, str]:
    """Read `[answers]` ("prompt" = "answer") from a TOML file; keys come back normalised."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    unknown = sorted(set(data) - {"answers"})
    if unknown:  # `[answer]` for `[answers]` would start and answer nothing
        raise ValueError(f"{path}: unknown table or field {unknown[0]!r} (known: [answers])")
    answers = data.get("answers", {})
    if not isinstance(answers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in answers.items()
    ):
        raise ValueError(f"{path}: [answers] must map prompt strings to answer strings")
    if not answers:
        raise ValueError(f'{path}: no [answers] entries ("prompt" = "answer")')
    return {_greeting(k): v for k, v in answers.items()}


# Body fields the key holds already (normalised), or that don't change the answer.
_KEYED = frozenset(
    "messages prompt model max_tokens max_completion_tokens seed temperature stop stream "
    "stream_options synthetic user metadata".split()
)


class CachedEngine(BaseEngine):
    """Wraps an engine: cache hits and canned answers never reach it."""

    def __init__(self, inner: Engine, settings: Settings) -> None:
        self.inner = inner
        self.ttl_s = settings.cache_ttl_s
        self.per_key = settings.cache_scope == "key"
        self.canned = load_canned(settings.canned_answers) if settings.canned_answers else {}
        self.cache_hits = 0
        self.canned_hits = 0
        self.tokens_served = 0  # tokens streamed from the cache or canned answers
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self._replaying: dict[str, bool] = {}  # request id → aborted

    # -- delegated -------------------------------------------------------------------------

    @property
    def models(self) -> tuple[str, ...]:
        return self.inner.models

    @property
    def tokens_generated(self) -> int:
        return self.inner.tokens_generated

    def counters(self) -> dict[str, int]:
        return {
            **self.inner.counters(),
            "cache_hits": self.cache_hits,
            "canned_hits": self.canned_hits,
        }

    def prompt_tokens(self, prompt: str) -> int:
        return self.inner.prompt_tokens(prompt)

    def check(self, request: GenerationRequest) -> None:
        self.inner.check(request)  # what the engine refuses up front

    async def fetch_models(self) -> tuple[str, ...] | None:
        return await self.inner.fetch_models()

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        return await self.inner.embed(request)  # not cached: an answer is one call anyway

    def has_prompt(self, request_id: str) -> bool:
        # A replay from the cache reads no prompt: nothing the client leaving would cost.
        return request_id not in self._replaying and self.inner.has_prompt(request_id)

    # Not `as_step_engine`: every request comes through `generate`, where the cache answers.

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def abort(self, request_id: str) -> None:
        if request_id in self._replaying:
            self._replaying[request_id] = True
        else:
            await self.inner.abort(request_id)

    # -- serving ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        answer = self._canned_answer(request)
        if answer is not None:
            self.canned_hits += 1
            async for delta in self._replay(request, *answer):
                yield delta
            return
        key = self.key(request) if self.ttl_s > 0 else None
        entry = self._lookup(key) if key is not None else None
        if entry is not None:
            self.cache_hits += 1
            async for delta in self._replay(request, list(entry.tokens), entry.finish):
                yield delta
            return
        tokens: list[str] = []
        finish: str | None = None
        plain = True  # text only: reasoning and tool calls are not kept
        # aclosing: if our reader leaves, the inner generator is closed now (its slot freed).
        async with aclosing(self.inner.generate(request)) as inner:
            async for delta in inner:
                if delta.structured:
                    plain = False
                elif delta.text:
                    tokens.append(delta.text)
                finish = delta.finish_reason or finish
                yield delta
        # Only a complete answer gets here: errors raise, and an abort ends without a finish.
        if key is not None and plain and finish is not None and len(tokens) <= MAX_ANSWER_TOKENS:
            self._store(key, _Entry(time.monotonic() + self.ttl_s, tuple(tokens), finish))

    def key(self, request: GenerationRequest) -> _Key | None:
        """The cache key, or None when the request is not deterministic."""
        if request.temperature != 0 and request.seed is None:
            return None
        messages = (
            None
            if request.messages is None
            else tuple((m.get("role"), _text(m.get("content") or "")) for m in request.messages)
        )
        # Everything else the client sent (tools, response format...) is part of the key.
        rest = {k: v for k, v in (request.body or {}).items() if k not in _KEYED}
        options = orjson.dumps([request.options, rest], option=orjson.OPT_SORT_KEYS, default=repr)
        return (
            request.tenant if self.per_key else None,
            request.model,
            _text(request.prompt) if messages is None else None,
            messages,
            request.max_tokens,
            request.seed,
            request.temperature,
            request.stop,
            options,
        )

    def _lookup(self, key: _Key) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= time.monotonic():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry

    def _store(self, key: _Key, entry: _Entry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        now = time.monotonic()
        while self._entries:
            oldest_key, oldest = next(iter(self._entries.items()))
            if len(self._entries) <= MAX_ENTRIES and oldest.expires > now:
                break
            del self._entries[oldest_key]

    def _canned_answer(self, request: GenerationRequest) -> tuple[list[str], str] | None:
        if not self.canned:
            return None
        prompt = _single_user_message(request.messages)
        if prompt is None:
            prompt = request.prompt if request.messages is None else ""
        answer = self.canned.get(_greeting(prompt))
        if answer is None:
            return None
        tokens, finish = split_words(answer), "stop"
        if request.max_tokens is not None and request.max_tokens < len(tokens):
            tokens, finish = tokens[: request.max_tokens], "length"
        cut, stopped = apply_stop(tokens, request.stop)
        return list(cut), "stop" if stopped else finish

    async def _replay(
        self, request: GenerationRequest, tokens: list[str], finish: str
    ) -> AsyncIterator[Delta]:
        rid = request.request_id
        self._replaying[rid] = False
        try:
            last = len(tokens) - 1
            for i, text in enumerate(tokens):
                # A checkpoint per token: cancellable, and fair to the other streams.
                await anyio.lowlevel.checkpoint()
                if self._replaying.get(rid):
                    return
                self.tokens_served += 1
                yield Delta(text, finish if i == last else None)
            if not tokens:
                yield Delta("", finish)
        finally:
            self._replaying.pop(rid, None)


def _single_user_message(messages: Sequence[Mapping[str, str]] | None) -> str | None:
    """The user's text when a chat is (system/developer messages +) one user message."""
    if not messages:
        return None
    rest = [m for m in messages if m.get("role") not in ("system", "developer")]
    if len(rest) == 1 and rest[0].get("role") == "user":
        return rest[0].get("content") or ""
    return None
