"""The synthetic engine: deterministic prose at a configurable pace, with fault injection.

Output is a pure function of (prompt, seed, max_tokens): the same request always yields the
same tokens, so tests and benchmarks can check delivered text token-exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys
from collections import OrderedDict
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from itertools import chain, islice
from typing import Any

import orjson

from firsttoken.engines.embeddings import synthetic_answer
from firsttoken.engines.steps import pull
from firsttoken.engines.styles import styled_pieces
from firsttoken.engines.text import StopCut, count_words
from firsttoken.generation import (
    BaseEngine,
    Delta,
    EmbeddingRequest,
    Embeddings,
    EngineError,
    Generation,
    GenerationRequest,
    Sink,
    StepEngine,
    ToolCallDelta,
)

__all__ = [
    "CACHE_BYTES",
    "MAX_KNOB_TOKENS",
    "Script",
    "SyntheticEngine",
    "SyntheticOptions",
    "answer_parts",
    "push_part",
    "synthetic_tokens",
]

MODEL_ID = "synthetic"
# `answer_tokens` and `reasoning_tokens` above this are refused (400): no test needs more,
# and an answer that long is ~7 MB of tokens once built.
MAX_KNOB_TOKENS = 100_000
CACHE_BYTES = 32 * 1024 * 1024  # the natural answers kept for reuse, all together

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
    # A continuation of a text that is not its answer's start: the rest of its answer after
    # as many tokens as the text holds (counted as prompts are), instead of a 400. Lets a
    # synthetic center take over from another model.
    continue_any: bool | None = None
    # A prefix cache: a request for a conversation whose prefill (any request with its
    # prompt) began here in the last PREFIX_CACHE_S waits for that prefill to be done, then
    # one ITL, instead of the whole TTFT (the TTFT standing for the prompt's prefill).
    prefix_cache: bool | None = None

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
            continue_any=raw.get("continue_any"),
            prefix_cache=raw.get("prefix_cache"),
        )


def synthetic_tokens(
    prompt: str,
    seed: int | None = None,
    max_tokens: int | None = None,
    answer_tokens: int | None = None,
    style: str = "prose",
) -> tuple[list[str], str]:
    """The tokens the engine emits for this request, and the finish reason."""
    request = GenerationRequest(
        request_id="", prompt=prompt, model=MODEL_ID, max_tokens=max_tokens, seed=seed
    )
    parts, finish = answer_parts(request, SyntheticOptions(answer_tokens=answer_tokens), style)
    return parts, finish  # type: ignore[return-value]  # text only: no reasoning, no tool


Part = str | Delta  # answer text, or a structured delta (reasoning, a tool-call fragment)


def answer_parts(
    request: GenerationRequest, opts: SyntheticOptions, style: str = "prose"
) -> tuple[list[Part], str]:
    """What the engine emits for this request, one part per step, and the finish reason
    (`Script`, read whole)."""
    plan = Script.of(request, opts, style)
    parts = plan.take(sys.maxsize)
    assert plan.finish is not None
    return parts, plan.finish


def push_part(
    sink: Sink, part: Part, finish: str | None = None, usage: Mapping[str, Any] | None = None
) -> bool:
    if usage is not None and finish is not None:
        # The engine's own count rides on a bare finish (a token's push drops it).
        push_part(sink, part)
        return sink.push_delta(Delta("", finish, usage=usage))
    if part.__class__ is str:
        return sink.push(part, finish)
    assert isinstance(part, Delta)
    if finish is not None:
        part = Delta(part.text, finish, part.reasoning, part.tool_calls, part.refusal)
    return sink.push_delta(part)


def finish_empty(sink: Sink, finish: str, usage: Mapping[str, Any] | None) -> None:
    """End an answer that has no parts at all."""
    if usage is None:
        sink.finish(finish)
    else:
        sink.push_delta(Delta("", finish, usage=usage))


# ---- the script: what one request gets ----------------------------------------------------------

_END: Any = object()


class Script:
    """The parts one request gets, made as they are read, and its finish reason.

    First reasoning (`reasoning_tokens`), then the answer: its text or one tool call
    (`tool_call`); `max_tokens` counts every part, and stop strings cut the text within that
    limit, as an engine checks them on what it generated. Nothing is made before it is read
    (bar one part of lookahead, to know whether the answer goes on), so `max_tokens: 1` of a
    100,000-token answer builds one sentence.

    A continuation (`options["continuation"]`: the text of the final assistant message, as
    vLLM's `continue_final_message` or an Anthropic prefill gives it) is the rest of the
    answer this request would get without that message: the text must be the answer text's
    first k tokens exactly, `max_tokens` counts what remains (the whole answer's limit is the
    reasoning, the k tokens and that), and reasoning is not repeated. Its usage is vLLM's:
    the prompt counts the k tokens, the completion only what is generated now.
    """

    __slots__ = ("_ahead", "_finish", "_parts", "_stop", "cut", "finish", "prompt_tokens", "taken")

    def __init__(self) -> None:
        self._parts: Iterator[Part] = iter(())
        self._ahead: Any = _END
        self._finish = "stop"  # the finish of an answer not cut short
        self._stop: StopCut | None = None
        self.cut = False  # `max_tokens` left parts out
        self.finish: str | None = None  # known once the last part is taken
        self.prompt_tokens: int | None = None  # a continuation's, for its usage
        self.taken = 0

    @classmethod
    def of(cls, request: GenerationRequest, opts: SyntheticOptions, style: str) -> Script:
        """The plan for `request`; EngineError (the client's fault) for a continuation that
        is not a prefix of the answer, or tool-call arguments that do not serialise."""
        plan = cls()
        seed = request.seed or 0
        limit = request.max_tokens
        prefix = request.options.get("continuation")
        thinking = opts.reasoning_tokens or 0
        answer: _Answer | None = None
        call = opts.tool_call
        if call and _answered(request.body, str(call.get("name") or "tool")):
            call = None  # it has the result it asked for: it answers in text now
        if call:
            body: Iterator[Part] = iter(_tool_call_parts(request.prompt, seed, call))
            plan._finish = "tool_calls"
        else:
            answer = _ANSWERS.get(request.prompt, seed, opts.answer_tokens, opts.style or style)
        lead: Iterator[Part] = iter(())
        if prefix is None:
            shown = thinking if limit is None else min(thinking, limit)
            plan.cut = shown < thinking
            if shown:
                thoughts = _ANSWERS.get("reasoning\x00" + request.prompt, seed, thinking, "prose")
                lead = (Delta(reasoning=t) for t in _text(thoughts, shown))
            body_limit = None if limit is None else limit - shown
        else:
            if not isinstance(prefix, str):
                raise _bad_continuation("the final assistant message must be text")
            try:
                k = _prefix_tokens(answer, prefix)
            except EngineError:
                if not opts.continue_any or answer is None:
                    raise
                # Another model's text: the rest of this answer after as many tokens.
                own = list(_text(answer, count_words(prefix)))
                prefix, k = "".join(own), len(own)  # what this answer holds there: skipped
            body_limit = None if limit is None else k + limit
            plan.prompt_tokens = count_words(request.prompt) + k
        if answer is not None:
            body = _text(answer, body_limit, plan)
        elif body_limit is not None:
            body = _upto(body, body_limit, plan)
        if request.stop and answer is not None:
            body = plan._stop = StopCut(body, request.stop)  # type: ignore[arg-type]
        if prefix is not None and prefix:
            # The prefix as this request's answer has it: a stop string inside it, or a
            # limit, would make the answer shorter than the text given.
            if "".join(islice(body, k)) != prefix:  # type: ignore[arg-type]
                raise _bad_continuation("the answer ends inside that text")
        plan._parts = chain(lead, body) if thinking and prefix is None else body
        plan._ahead = next(plan._parts, _END)
        if plan._ahead is _END:
            plan._end()
        return plan

    def take(self, n: int) -> list[Part]:
        """The next (at most) `n` parts; after the last one, `finish` is set."""
        ahead = self._ahead
        if ahead is _END:
            return []
        out = [ahead]
        out += islice(self._parts, n - 1)
        self.taken += len(out)
        self._ahead = next(self._parts, _END)
        if self._ahead is _END:
            self._end()
        return out

    def usage(self) -> dict[str, int] | None:
        """A continuation's usage (the engine's own count); None for the stream to count."""
        if self.prompt_tokens is None:
            return None
        total = self.prompt_tokens + self.taken
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.taken,
            "total_tokens": total,
        }

    def _end(self) -> None:
        if self._stop is not None and self._stop.stopped:
            self.finish = "stop"
        else:
            self.finish = "length" if self.cut else self._finish


def _upto(parts: Iterator[Part], limit: int, plan: Script) -> Iterator[Part]:
    """The first `limit` parts; marks the plan cut when there were more."""
    yield from islice(parts, limit)
    if next(parts, _END) is not _END:
        plan.cut = True


def _answered(body: Mapping[str, Any] | None, name: str) -> bool:
    """Whether the conversation ends with the result of a call to `name`: its last messages
    are tool results, and one of them answers the assistant's call of that name. An agent
    framework sends the same `tool_call` knob on every turn; a model answers once it has the
    result, and so does this engine (else the agent would loop until its turn limit)."""
    messages = body.get("messages") if body is not None else None
    if not isinstance(messages, list):
        return False
    results = set()
    i = len(messages) - 1
    while i >= 0 and isinstance(messages[i], Mapping) and messages[i].get("role") == "tool":
        results.add(messages[i].get("tool_call_id"))
        i -= 1
    if not results or i < 0 or not isinstance(messages[i], Mapping):
        return False
    calls = messages[i].get("tool_calls") if messages[i].get("role") == "assistant" else None
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and function.get("name") == name:
            if call.get("id") in results:
                return True
    return False


def _bad_continuation(why: str) -> EngineError:
    return EngineError(
        "invalid_continuation",
        f"cannot continue: the text to continue (the final assistant message, or "
        f"continue_final_text) is not the start of this request's answer at a token "
        f"boundary ({why})",
        type_="invalid_request_error",
        status=400,
        client_fault=True,
    )


def _prefix_tokens(answer: _Answer | None, prefix: str) -> int:
    """How many of the answer's first tokens make up `prefix` exactly."""
    if answer is None:  # a tool call: only an empty text comes before it
        if prefix:
            raise _bad_continuation("this answer is a tool call")
        return 0
    pos = k = 0
    while pos < len(prefix):
        token = _ANSWERS.token(answer, k)
        if token is None:
            raise _bad_continuation("the text is longer than the answer")
        if not prefix.startswith(token, pos):
            raise _bad_continuation(f"it differs from the answer within its token {k}")
        pos += len(token)
        k += 1
    return k


def _tool_call_parts(prompt: str, seed: int, call: Mapping[str, Any]) -> list[Delta]:
    """One tool call: its id and name, then its arguments' JSON in fragments of 3-8
    characters (split inside strings and keys, as real engines stream them)."""
    name = str(call.get("name") or "tool")
    try:
        arguments = orjson.dumps(call.get("arguments") or {}).decode()
    except (TypeError, orjson.JSONEncodeError) as exc:  # nested too deep, for one
        raise EngineError(
            "invalid_value",
            f"synthetic.tool_call.arguments cannot be serialised: {exc}",
            type_="invalid_request_error",
            status=400,
            client_fault=True,
        ) from None
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


# ---- natural answers: built lazily, shared, bounded in bytes ----------------------------------


class _Answer:
    """One natural answer (a prompt, a seed, a length, a style), built only as far as requests
    have read it, a piece (a sentence, a Markdown block) at a time. `tokens` only grows, so a
    plan reads it by index while another request's plan grows it."""

    __slots__ = ("_pieces", "cached", "size", "tokens")

    def __init__(self, pieces: Iterator[list[str]], size: int) -> None:
        self.tokens: list[str] = []
        self.size = size  # bytes held, about: the tokens, the key, the generator's state
        self.cached = True
        self._pieces: Iterator[list[str]] | None = pieces  # None: the answer is whole

    def build(self, n: int) -> int:
        """Build until there are `n` tokens or the answer is whole; the bytes it added."""
        tokens = self.tokens
        added = 0
        while len(tokens) < n and self._pieces is not None:
            piece = next(self._pieces, None)
            if piece is None:
                self._pieces = None  # its generator (and ~2.5 KiB of rng state) go
                added -= _GENERATOR_BYTES
                break
            tokens += piece
            added += _POINTER_BYTES * len(piece) + sum(map(sys.getsizeof, piece))
        self.size += added
        return added


_POINTER_BYTES = 8
_GENERATOR_BYTES = 3 * 1024  # a Random's state and a suspended generator frame


class _Answers:
    """The natural answers requests read, shared: least recently used out first, bounded by
    the bytes they hold (not by their count: one answer may be 100,000 tokens)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self._entries: OrderedDict[tuple[str, int, int | None, str], _Answer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prompt: str, seed: int, length: int | None, style: str) -> _Answer:
        key = (prompt, seed, length, style)
        answer = self._entries.get(key)
        if answer is not None:
            self._entries.move_to_end(key)
            return answer
        digest = hashlib.sha256(f"{seed}\x00{prompt}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        target = rng.randint(270, 330)
        if length is not None:  # drawn anyway, so a longer answer starts with the default one
            target = length
        if style == "prose":
            pieces = _prose_pieces(rng, target)
        else:
            pieces = styled_pieces(style, rng, target)
        if length is not None:
            # Asked for: a length, not a minimum (prose ends on a whole sentence otherwise).
            pieces = _cut(pieces, length)
        answer = _Answer(pieces, _GENERATOR_BYTES + 200 + sys.getsizeof(prompt))  # the key too
        self._entries[key] = answer
        self._grew(answer.size)
        return answer

    def token(self, answer: _Answer, i: int) -> str | None:
        """The answer's token `i`, built if need be; None past its end."""
        tokens = answer.tokens
        if i >= len(tokens):
            added = answer.build(i + 1)
            if answer.cached:
                self._grew(added)
            if i >= len(tokens):
                return None
        return tokens[i]

    def _grew(self, added: int) -> None:
        self.held += added
        while self.held > self.max_bytes and self._entries:
            _, oldest = self._entries.popitem(last=False)
            oldest.cached = False  # plans reading it keep it; nobody new finds it
            self.held -= oldest.size


_ANSWERS = _Answers(CACHE_BYTES)


def _text(answer: _Answer, limit: int | None = None, plan: Script | None = None) -> Iterator[str]:
    """The answer's tokens, built as they are read: the first `limit`, and `plan` is marked
    cut when there were more."""
    tokens = answer.tokens
    i = 0
    while limit is None or i < limit:
        if i >= len(tokens) and _ANSWERS.token(answer, i) is None:
            return
        yield tokens[i]
        i += 1
    if plan is not None and _ANSWERS.token(answer, i) is not None:
        plan.cut = True


def _cut(pieces: Iterator[list[str]], n: int) -> Iterator[list[str]]:
    """The pieces' first `n` tokens."""
    for piece in pieces:
        if n <= 0:
            return
        yield piece[:n]
        n -= len(piece)


def _prose_pieces(rng: random.Random, target: int) -> Iterator[list[str]]:
    """Prose of about `target` tokens (whole sentences: at least `target`), a sentence at a
    time: paragraphs of 3-5 sentences, some of them Korean or Chinese."""
    built = 0
    sentences_in_paragraph = 0
    paragraph_len = rng.randint(3, 5)
    while built < target:
        piece: list[str] = []
        if built and sentences_in_paragraph == paragraph_len:
            piece.append("\n\n")
            sentences_in_paragraph = 0
            paragraph_len = rng.randint(3, 5)
        if rng.random() < 0.12:
            words, end = rng.choice(_FOREIGN)
            piece.append(" " + words[0])
            piece.extend(words[1:])
            piece.append(end)
        else:
            piece.extend(_sentence(rng))
        sentences_in_paragraph += 1
        built += len(piece)
        yield piece


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


# ---- failures ---------------------------------------------------------------------------------

_NEVER = sys.maxsize
_CHUNK = 64  # parts a run takes from its plan at a time (a waiting run holds none)


@dataclass(frozen=True, slots=True)
class Failure:
    """Where and how one stream fails: the request's own `fail_after` (the client's doing:
    the breaker ignores it), or the engine's `--synthetic-fail-rate` (an engine fault, which
    fails the stream at its last part at the latest)."""

    at: int  # parts sent before it fails
    code: str
    client_fault: bool

    def error(self, sent: int) -> EngineError:
        what = "requested failure" if self.client_fault else "failure (--synthetic-fail-rate)"
        return EngineError(
            self.code,
            f"synthetic engine {what} after {sent} tokens",
            client_fault=self.client_fault,
        )


class Faults:
    """The engine's own failures: a share `rate` of the streams it opens fail, after 0-19
    parts. Drawn from a generator seeded with 0, in the order streams open: a server fed the
    same requests in the same order fails the same ones."""

    def __init__(self, rate: float = 0.0) -> None:
        self.rate = rate
        self._rng = random.Random(0)

    def draw(self, opts: SyntheticOptions) -> Failure | None:
        own = opts.fail_after
        if self.rate > 0 and self._rng.random() < self.rate:
            at = self._rng.randrange(20)
            if own is None or at < own:
                return Failure(at, "engine_error", client_fault=False)
        if own is None:
            return None
        return Failure(own, opts.error_code or "engine_error", client_fault=True)


PREFIX_CACHE_S = 60.0  # how long a prefilled conversation stays cached (prefix_cache)
PREFIX_CACHE_ENTRIES = 10_000
_FAR_S = 0.1  # deadlines further than this wait in a bucket of their _FAR_S slot


class SyntheticEngine(BaseEngine):
    """Paces the synthetic answer: TTFT, then one token every ITL, for every request on one
    shared clock.

    Like a decode step, one loop timer per millisecond tick serves every request due then, and
    writes each one's token into its sink: no task and no wakeup per request per token. A
    request that waits long (a slow TTFT) waits in a bucket of its _FAR_S slot, one loop timer
    per slot: a waiting request costs a list entry, not a callback and a timer of its own.
    """

    models: tuple[str, ...] = (MODEL_ID,)

    def __init__(
        self,
        *,
        ttft_ms: float = 200.0,
        itl_ms: float = 20.0,
        style: str = "prose",
        fail_rate: float = 0.0,
    ) -> None:
        self.ttft_ms = ttft_ms
        self.itl_ms = itl_ms
        self.style = style
        self.faults = Faults(fail_rate)
        self.tokens_generated = 0
        self.steps = 0  # ticks run (for the per-token cost table)
        self._ticks: dict[int, list[_Run]] = {}
        self._far: dict[int, list[_Run]] = {}  # long waits, by _FAR_S slot
        self._running: dict[str, _Run] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the last open()
        # prefix_cache: (prompt, seed) -> when its prefill is (or was) done, oldest first
        self._prefixes: dict[tuple[str, int], float] = {}

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

    def check(self, request: GenerationRequest) -> None:
        """Raise the EngineError `open` would fail this request with, before anything is
        sent (a continuation that is not the answer's prefix): the API answers it as a 4xx."""
        opts = options(request)
        if opts.tool_call or request.options.get("continuation") is not None:
            Script.of(request, opts, self.style)  # nothing else can fail (and this costs µs)

    def open(self, request: GenerationRequest, sink: Sink) -> Generation:
        opts = options(request)
        ttft = (self.ttft_ms if opts.ttft_ms is None else opts.ttft_ms) / 1000
        itl = (self.itl_ms if opts.itl_ms is None else opts.itl_ms) / 1000
        plan = Script.of(request, opts, self.style)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        loop = self._loop
        if opts.prefix_cache:
            ttft = self._prefill(request, ttft, itl, loop.time())
        failure = self.faults.draw(opts)
        run = _Run(self, request.request_id, plan, itl, failure, sink, loop.time() + ttft)
        self._running[run.request_id] = run
        self._at(run)
        return run

    def as_step_engine(self) -> StepEngine:
        return self

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        return pull(self, request)

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        return synthetic_answer(request, count_words)

    def _prefill(self, request: GenerationRequest, ttft: float, itl: float, now: float) -> float:
        """The time to a first token with the prefix cache (`prefix_cache`): the TTFT stands
        for the prompt's prefill, so a request for a conversation whose prefill began in the
        last PREFIX_CACHE_S (a continuation of it, or the same prompt again) waits for that
        prefill to be done, then one ITL (its few new tokens); any other request is a
        prefill, whose end the cache notes."""
        key = (request.prompt, request.seed or 0)
        cache = self._prefixes
        ready = cache.get(key)
        if ready is not None and now - ready > PREFIX_CACHE_S:
            del cache[key]
            ready = None
        if ready is not None:
            return max(0.0, ready - now) + itl
        if ready is None or now + ttft < ready:
            cache.pop(key, None)
            cache[key] = now + ttft
            if len(cache) > PREFIX_CACHE_ENTRIES:
                del cache[next(iter(cache))]  # the oldest
        return ttft

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


def options(request: GenerationRequest) -> SyntheticOptions:
    opts = request.options.get("synthetic")
    if isinstance(opts, SyntheticOptions):
        return opts
    return SyntheticOptions.from_mapping(opts)


class _State(Enum):
    RUNNING = "running"
    PAUSED = "paused"  # the sink asked for a pause (its readers are a window behind)
    ENDED = "ended"


_RUNNING = _State.RUNNING


class _Run:
    """One request on the engine's clock. It reads its plan a chunk at a time: `tokens` is
    the chunk, `pos` the place in it, `base` the parts sent before it."""

    __slots__ = (
        "base",
        "due",
        "engine",
        "fail_at",
        "failure",
        "itl",
        "plan",
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
        plan: Script,
        itl: float,
        failure: Failure | None,
        sink: Sink,
        due: float,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.plan = plan
        self.itl = itl
        self.failure = failure
        self.sink = sink
        self.due = due
        self.tokens: list[Part] = []  # taken at the first step: a waiting run holds none
        self.base = 0
        self.pos = 0
        self.state = _State.RUNNING
        self.fail_at = _NEVER if failure is None else failure.at
        self.stop_at = 0  # steps before this are plain

    def step(self, now: float) -> None:
        pos, tokens = self.pos, self.tokens
        if pos >= self.stop_at:
            self._last_step(pos, now)
            return
        self.pos = pos + 1
        engine = self.engine
        engine.tokens_generated += 1
        token = tokens[pos]
        # `__class__ is str`: the per-token path's cheapest test, one mypy does not narrow by.
        room = self.sink.push(token) if token.__class__ is str else self.sink.push_delta(token)  # type: ignore[arg-type]
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

    def _last_step(self, pos: int, now: float) -> None:
        """A step off the plain path: an injected fault, the next chunk, the last part."""
        tokens, plan = self.tokens, self.plan
        sent = self.base + pos
        last = plan.finish is not None and pos >= len(tokens) - 1
        failure = self.failure
        if sent >= self.fail_at or (last and failure is not None and not failure.client_fault):
            self._end()
            self.sink.fail(failure.error(sent))  # type: ignore[union-attr]
            return
        if not last:  # this chunk is read: the next one
            self.base += len(tokens)
            self.tokens = tokens = plan.take(_CHUNK)
            self.pos = 0
            end = len(tokens) - 1 if plan.finish is not None else len(tokens)
            self.stop_at = min(self.fail_at - self.base, end)
            self.step(now)
            return
        self._end()
        if pos < len(tokens):
            self.engine.tokens_generated += 1
            push_part(self.sink, tokens[pos], plan.finish, plan.usage())
        else:  # an empty answer
            finish_empty(self.sink, plan.finish, plan.usage())  # type: ignore[arg-type]

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
