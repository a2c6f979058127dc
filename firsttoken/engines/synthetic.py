"""The synthetic engine: deterministic prose at a configurable pace, with fault injection.

Output is a pure function of (prompt, seed, max_tokens): the same request always yields the
same tokens, so tests and benchmarks can check delivered text token-exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Any

import orjson

from firsttoken.engines.base import (
    Delta,
    EngineError,
    Generation,
    GenerationRequest,
    Sink,
    ToolCallDelta,
)
from firsttoken.engines.steps import pull
from firsttoken.engines.styles import styled_answer
from firsttoken.engines.text import apply_stop, count_words

__all__ = ["SyntheticEngine", "SyntheticOptions", "answer_parts", "push_part", "synthetic_tokens"]

MODEL_ID = "synthetic"

_WORDS = (
    "the stream model token answer server client reader browser network latency buffer "
    "event gateway engine request response sentence paragraph question moment person screen "
    "text first second quickly slowly clearly honestly always never often every small large "
    "fast steady smooth visible waiting reading writing sending flowing arrives starts stops "
    "keeps shows measures carries delivers generates resumes cancels breaks returns holds "
    "connection interruption intermediary compression heartbeat backpressure throughput "
    "we you it they this that with without before after while because so and but or of to "
    "in on for from into over under through between across a an is are was were can will"
).split()
# Multi-byte text so UTF-8 handling is exercised on every answer: (tokens, sentence end).
_FOREIGN = (
    (["스트리밍", "은", " 빠르", "고", " 정직", "합니다"], "."),
    (["첫", " 토큰", "이", " 곧", " 도착", "합니다"], "."),
    (["流式", "传输", "让", "用户", "立刻", "看到", "文字"], "。"),
    (["模型", "正在", "生成", "回答"], "！"),
)
_EMOJI = (" 🚀", " ✨", " 👋")
_ENDS = (".", ".", ".", "!", "?")


@dataclass(frozen=True, slots=True)
class SyntheticOptions:
    """Per-request knobs (body field `synthetic`); None means the server default."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    fail_after: int | None = None
    error_code: str | None = None
    answer_tokens: int | None = None  # length of the natural answer (default ~300, by seed)
    reasoning_tokens: int | None = None  # tokens of reasoning before the answer
    tool_call: Mapping[str, Any] | None = None  # {"name", "arguments"}: the answer is a call
    style: str | None = None  # "prose" | "markdown" | "hostile" (None: the server's)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> SyntheticOptions:
        if not raw:
            return cls()
        return cls(
            ttft_ms=raw.get("ttft_ms"),
            itl_ms=raw.get("itl_ms"),
            fail_after=raw.get("fail_after"),
            error_code=raw.get("error_code"),
            answer_tokens=raw.get("answer_tokens"),
            reasoning_tokens=raw.get("reasoning_tokens"),
            tool_call=raw.get("tool_call"),
            style=raw.get("style"),
        )


def synthetic_tokens(
    prompt: str,
    seed: int | None = None,
    max_tokens: int | None = None,
    answer_tokens: int | None = None,
    style: str = "prose",
) -> tuple[list[str], str]:
    """The tokens the engine emits for this request, and the finish reason."""
    tokens, finish = _answer(prompt, seed, max_tokens, answer_tokens, style)
    return list(tokens), finish


@lru_cache(maxsize=1024)
def _answer(
    prompt: str,
    seed: int | None,
    max_tokens: int | None,
    answer_tokens: int | None,
    style: str = "prose",
) -> tuple[Sequence[str], str]:
    # Cached, cut or whole: a waiting stream holds no copy of its answer.
    natural = _natural_answer(prompt, seed or 0, answer_tokens, style)
    if max_tokens is not None and max_tokens < len(natural):
        return natural[:max_tokens], "length"
    return natural, "stop"


Part = str | Delta  # answer text, or a structured delta (reasoning, a tool-call fragment)


def answer_parts(
    request: GenerationRequest, opts: SyntheticOptions, style: str = "prose"
) -> tuple[Sequence[Part], str]:
    """What the engine emits for this request, one part per step, and the finish reason:
    reasoning first (`reasoning_tokens`), then the answer text or one tool call
    (`tool_call`), cut by stop strings (in the text) and `max_tokens` (over all of it)."""
    style = opts.style or style
    if not opts.reasoning_tokens and not opts.tool_call:
        tokens, finish = _answer(
            request.prompt, request.seed, request.max_tokens, opts.answer_tokens, style
        )
        tokens, stopped = apply_stop(tokens, request.stop)
        return tokens, "stop" if stopped else finish
    seed = request.seed or 0
    parts: list[Part] = []
    if opts.reasoning_tokens:
        n = opts.reasoning_tokens
        thoughts = _natural_answer("reasoning\x00" + request.prompt, seed, n)[:n]
        parts.extend(Delta(reasoning=t) for t in thoughts)
    finish = "stop"
    if opts.tool_call:
        parts.extend(_tool_call_parts(request.prompt, seed, opts.tool_call))
        finish = "tool_calls"
    else:
        tokens = _natural_answer(request.prompt, seed, opts.answer_tokens, style)
        tokens, _ = apply_stop(tokens, request.stop)
        parts.extend(tokens)
    if request.max_tokens is not None and request.max_tokens < len(parts):
        return parts[: request.max_tokens], "length"
    return parts, finish


def _tool_call_parts(prompt: str, seed: int, call: Mapping[str, Any]) -> list[Delta]:
    """One tool call: its id and name, then its arguments' JSON in fragments of 3-8
    characters (split inside strings and keys, as real engines stream them)."""
    name = str(call.get("name") or "tool")
    arguments = orjson.dumps(call.get("arguments") or {}).decode()
    digest = hashlib.sha256(f"{seed}\x00{prompt}\x00{name}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    parts = [Delta(tool_calls=(ToolCallDelta(0, "call_" + digest[8:20].hex(), name, ""),))]
    pos = 0
    while pos < len(arguments):
        size = rng.randint(3, 8)
        piece = arguments[pos : pos + size]
        parts.append(Delta(tool_calls=(ToolCallDelta(0, arguments=piece),)))
        pos += size
    return parts


def push_part(sink: Sink, part: Part, finish: str | None = None) -> bool:
    if part.__class__ is str:
        return sink.push(part, finish)  # type: ignore[arg-type]
    assert isinstance(part, Delta)
    if finish is not None:
        part = Delta(part.text, finish, part.reasoning, part.tool_calls, part.refusal)
    return sink.push_delta(part)


@lru_cache(maxsize=1024)
def _natural_answer(
    prompt: str, seed: int, length: int | None, style: str = "prose"
) -> tuple[str, ...]:
    digest = hashlib.sha256(f"{seed}\x00{prompt}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    target = rng.randint(270, 330)
    if length is not None:  # drawn anyway, so a longer answer starts with the default one
        target = length
    if style != "prose":
        return styled_answer(style, rng, target)
    tokens: list[str] = []
    sentences_in_paragraph = 0
    paragraph_len = rng.randint(3, 5)
    while len(tokens) < target:
        if tokens and sentences_in_paragraph == paragraph_len:
            tokens.append("\n\n")
            sentences_in_paragraph = 0
            paragraph_len = rng.randint(3, 5)
        if rng.random() < 0.12:
            words, end = rng.choice(_FOREIGN)
            tokens.append(" " + words[0])
            tokens.extend(words[1:])
            tokens.append(end)
        else:
            tokens.extend(_sentence(rng))
        sentences_in_paragraph += 1
    return tuple(tokens)


def _sentence(rng: random.Random) -> list[str]:
    tokens: list[str] = []
    n = rng.randint(6, 16)
    for i in range(n):
        word = rng.choice(_WORDS)
        if i == 0:
            word = word.capitalize()
        if len(word) > 7:
            # Long words become two tokens, as a BPE vocabulary would split them.
            tokens.extend((" " + word[:5], word[5:]))
        else:
            tokens.append(" " + word)
        if 0 < i < n - 2 and rng.random() < 0.08:
            tokens.append(",")
    if rng.random() < 0.1:
        tokens.append(rng.choice(_EMOJI))
    tokens.append(rng.choice(_ENDS))
    return tokens


_FAR_S = 0.1  # deadlines further than this wait in a bucket of their _FAR_S slot


class SyntheticEngine:
    """Paces the synthetic answer: TTFT, then one token every ITL, for every request on one
    shared clock.

    Like a decode step, one loop timer per millisecond tick serves every request due then, and
    writes each one's token into its sink: no task and no wakeup per request per token. A
    request that waits long (a slow TTFT) waits in a bucket of its _FAR_S slot, one loop timer
    per slot: a waiting request costs a list entry, not a callback and a timer of its own.
    """

    models = (MODEL_ID,)

    def __init__(
        self, *, ttft_ms: float = 200.0, itl_ms: float = 20.0, style: str = "prose"
    ) -> None:
        self.ttft_ms = ttft_ms
        self.itl_ms = itl_ms
        self.style = style
        self.tokens_generated = 0
        self.steps = 0  # ticks run (for the per-token cost table)
        self._ticks: dict[int, list[_Run]] = {}
        self._far: dict[int, list[_Run]] = {}  # long waits, by _FAR_S slot
        self._running: dict[str, _Run] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the last open()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for run in list(self._running.values()):
            run.cancel()

    def counters(self) -> dict[str, int]:
        return {}

    def prompt_tokens(self, prompt: str) -> int:
        return count_words(prompt)

    async def abort(self, request_id: str) -> None:
        run = self._running.get(request_id)
        if run is not None:
            run.cancel()

    def open(self, request: GenerationRequest, sink: Sink) -> Generation:
        opts = request.options.get("synthetic")
        if not isinstance(opts, SyntheticOptions):
            opts = SyntheticOptions.from_mapping(opts)
        ttft = (self.ttft_ms if opts.ttft_ms is None else opts.ttft_ms) / 1000
        itl = (self.itl_ms if opts.itl_ms is None else opts.itl_ms) / 1000
        tokens, finish = answer_parts(request, opts, self.style)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        loop = self._loop
        run = _Run(self, request.request_id, tokens, finish, itl, opts, sink, loop.time() + ttft)
        self._running[run.request_id] = run
        self._at(run)
        return run

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        return pull(self, request)

    def _at(self, run: _Run) -> None:
        """Queue `run` for its next step, at `run.due`."""
        loop = self._loop
        assert loop is not None
        when = run.due
        if when - loop.time() > _FAR_S:
            # Handed to the ticks by its slot's timer, one to two slots before it is due.
            slot = int(when / _FAR_S) - 1
            bucket = self._far.get(slot)
            if bucket is None:
                self._far[slot] = [run]
                loop.call_at(slot * _FAR_S, self._wake_far, slot)
            else:
                bucket.append(run)
            return
        self._tick_at(when, run)

    def _wake_far(self, slot: int) -> None:
        for run in self._far.pop(slot, ()):
            if run.state is _State.RUNNING:  # a cancelled run just leaves here
                self._tick_at(run.due, run)

    def _tick_at(self, when: float, run: _Run) -> None:
        # Ticks on a 1 ms grid (uvloop's timer resolution): streams due in the same
        # millisecond share one timer and one step. Rounded down, as uvloop rounds a timer's
        # delay: a token leaves within the millisecond it is due, never a tick late.
        loop = self._loop
        assert loop is not None
        tick = int(when * 1000)
        bucket = self._ticks.get(tick)
        if bucket is None:
            self._ticks[tick] = [run]
            loop.call_at(tick / 1000, self._step, tick)
        else:
            bucket.append(run)

    def _step(self, tick: int) -> None:
        runs = self._ticks.pop(tick, ())
        self.steps += 1
        now = self._loop.time()  # type: ignore[union-attr]
        for run in runs:
            if run.state is _State.RUNNING:
                try:
                    run.step(now)
                except Exception as exc:  # a bug in one sink must not stall the others
                    run.cancel()
                    run.sink.fail(EngineError("internal_error", f"internal error: {exc!r}"))


class _State(Enum):
    RUNNING = "running"
    PAUSED = "paused"  # the sink asked for a pause (its readers are a window behind)
    ENDED = "ended"


_RUNNING = _State.RUNNING


class _Run:
    """One request on the engine's clock."""

    __slots__ = (
        "due",
        "engine",
        "error_code",
        "fail_at",
        "finish",
        "itl",
        "pos",
        "request_id",
        "sink",
        "state",
        "stop_at",
        "tokens",
    )

    def __init__(
        self,
        engine: SyntheticEngine,
        request_id: str,
        tokens: Sequence[Part],
        finish: str,
        itl: float,
        opts: SyntheticOptions,
        sink: Sink,
        due: float,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.tokens = tokens
        self.finish = finish
        self.itl = itl
        self.error_code = opts.error_code  # not the options: a waiting run holds no more
        self.sink = sink
        self.due = due
        self.pos = 0
        self.state = _State.RUNNING
        self.fail_at = len(tokens) + 1 if opts.fail_after is None else opts.fail_after
        self.stop_at = min(self.fail_at, len(tokens) - 1)  # steps before this are plain

    def step(self, now: float) -> None:
        pos, tokens = self.pos, self.tokens
        if pos >= self.stop_at:
            self._last_step(pos)
            return
        self.pos = pos + 1
        engine = self.engine
        engine.tokens_generated += 1
        token = tokens[pos]
        room = self.sink.push(token) if token.__class__ is str else self.sink.push_delta(token)
        if self.state is not _RUNNING:
            return  # the push ended the stream (e.g. its last reader was cut)
        itl = self.itl
        due = self.due + itl
        if due < now - itl:
            due = now  # fell behind (paused reader, busy loop): don't burst to catch up
        self.due = due
        if not room:
            self.state = _State.PAUSED
            return
        # engine._tick_at, inlined: this runs once per token per stream.
        tick = int(due * 1000)
        bucket = engine._ticks.get(tick)
        if bucket is None:
            engine._ticks[tick] = [self]
            engine._loop.call_at(tick / 1000, engine._step, tick)  # type: ignore[union-attr]
        else:
            bucket.append(self)

    def _last_step(self, pos: int) -> None:
        """The step that ends the run: an injected fault, the last token, or no answer."""
        tokens = self.tokens
        if pos >= self.fail_at:
            self._end()
            self.sink.fail(
                EngineError(
                    self.error_code or "engine_error",
                    f"synthetic engine failure after {pos} tokens",
                )
            )
            return
        last = len(tokens) - 1
        if pos >= last:
            self._end()
            if pos == last:
                self.engine.tokens_generated += 1
                push_part(self.sink, tokens[pos], self.finish)
            else:  # an empty answer
                self.sink.finish(self.finish)

    def resume(self) -> None:
        if self.state is _State.PAUSED:
            self.state = _State.RUNNING
            # A paused request goes on from now, paced: it does not burst to catch up.
            self.due = max(self.due, self.engine._loop.time())  # type: ignore[union-attr]
            self.engine._at(self)

    def cancel(self) -> None:
        self._end()

    def _end(self) -> None:
        # A cancelled run may still sit in a tick's bucket; the step skips it there.
        self.state = _State.ENDED
        self.engine._running.pop(self.request_id, None)
