"""Scripted engines for the router's unit tests: each request plays a list of steps on the
loop's clock (run them on `tests/unit/virtual_loop.py`, where a sleep costs no real time).

A step is a `Delta` (sent), a number (seconds of silence) or a `Fail` (raised). `answer()` is
a script that, like our own engines, continues `ANSWER` from a given prefix and refuses a
prefix that is not the answer's start (400, the request's fault), so a spliced stream can be
compared with the uninterrupted answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from firsttoken.generation import BaseEngine, Delta, EngineError, GenerationRequest

__all__ = ["ANSWER", "PROMPT_TOKENS", "Fail", "Scripted", "answer", "cut", "tokens"]

ANSWER = ("Once", " upon", " a", " time", ",", " a", " gate", " kept", " going", ".")
PROMPT_TOKENS = 7  # the engines' count of any prompt here


@dataclass(frozen=True)
class Fail:
    """Raise a fresh EngineError (a fresh one each time: the router writes on errors)."""

    code: str = "upstream_truncated"
    retryable: bool = True
    status: int | None = None
    client_fault: bool = False
    retry_after_s: float | None = None

    def error(self) -> EngineError:
        return EngineError(
            self.code,
            f"scripted {self.code}",
            retryable=self.retryable,
            status=self.status,
            client_fault=self.client_fault,
            retry_after_s=self.retry_after_s,
        )


Step = Delta | float | Fail
Script = Sequence[Step] | Callable[[GenerationRequest], Sequence[Step]]


def cut(**kw: Any) -> Fail:
    return Fail(**kw)


def tokens(n: int, start: int = 0, *, every_s: float = 0.0) -> list[Step]:
    """ANSWER's tokens start..start+n, `every_s` of silence before each."""
    steps: list[Step] = []
    for text in ANSWER[start : start + n]:
        if every_s:
            steps.append(every_s)
        steps.append(Delta(text))
    return steps


def answer(request: GenerationRequest) -> list[Step]:
    """The rest of ANSWER after `options["continuation"]` (all of it without one), finished
    with usage as vLLM counts a continuation: the prefix is part of the prompt."""
    prefix = request.options.get("continuation", "")
    starts = ["".join(ANSWER[:k]) for k in range(len(ANSWER) + 1)]
    if prefix not in starts:
        return [Fail("invalid_continuation", retryable=False, status=400, client_fault=True)]
    k = starts.index(prefix)
    rest = list(ANSWER[k:])
    if request.max_tokens is not None:
        rest = rest[: request.max_tokens]
    steps: list[Step] = [Delta(t) for t in rest]
    usage = {
        "prompt_tokens": PROMPT_TOKENS + k,
        "completion_tokens": len(rest),
        "total_tokens": PROMPT_TOKENS + k + len(rest),
    }
    finish = "stop" if k + len(rest) == len(ANSWER) else "length"
    steps.append(Delta("", finish_reason=finish, usage=usage))
    return steps


class Scripted(BaseEngine):
    """An engine whose n-th request plays the n-th script (the last one repeats)."""

    def __init__(self, *scripts: Script, models: tuple[str, ...] = ("m",)) -> None:
        self.scripts = scripts or (answer,)
        self.models = models
        self.tokens_generated = 0
        self.requests: list[GenerationRequest] = []
        self.ended_early: list[str] = []  # GeneratorExit / CancelledError, one per stop
        self.aborted: list[str] = []
        self.counted: list[int] = []  # the length of each prompt it was asked to count
        self.started = self.closed = False

    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        self.requests.append(request)
        script = self.scripts[min(len(self.requests), len(self.scripts)) - 1]
        return self._play(script(request) if callable(script) else script)

    async def _play(self, steps: Sequence[Step]) -> AsyncIterator[Delta]:
        try:
            for step in steps:
                if isinstance(step, Delta):
                    self.tokens_generated += 1
                    yield replace(step)  # a copy: the router may set its usage
                elif isinstance(step, Fail):
                    raise step.error()
                else:
                    await asyncio.sleep(step)
        except (GeneratorExit, asyncio.CancelledError) as exc:
            self.ended_early.append(type(exc).__name__)
            raise

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def prompt_tokens(self, prompt: str) -> int:
        self.counted.append(len(prompt))
        return PROMPT_TOKENS

    def counters(self) -> dict[str, int]:
        return {"scripted": len(self.requests)}

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True
