"""The synthetic engine behind a simulated continuous-batching scheduler (as vLLM/TGI run).

One scheduler task runs decode *steps*. A step emits one token for every sequence in the
batch and takes `batch_step_base_ms + batch_step_per_seq_ms × batch size` (a GPU decode step:
a fixed cost plus a little per sequence). At most `batch_max` sequences run; the rest wait and
join at a step boundary. When nothing runs, the scheduler first waits up to `batch_timeout_ms`
for a batch to fill (or until `batch_max` requests are waiting).

A joining sequence's first step is its prefill: its first token comes out of that step, so
TTFT = time queued (+ the idle batch wait) + one step. Per-request `ttft_ms`/`itl_ms` knobs
are ignored here (the scheduler sets the pace); `answer_tokens`, `fail_after`, `error_code`,
continuations and `--synthetic-fail-rate` are honoured, and the text is token-exact with the
plain synthetic engine.

A sequence whose consumer goes away (generator closed or cancelled, or `abort(id)`) leaves
the batch before the next step and frees its slot. That is the fix for the seeds' "concurrency
mysteriously drops" incident: abandoned streams used to hold their slots until they finished.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from firsttoken.config import Settings
from firsttoken.engines.embeddings import synthetic_answer
from firsttoken.engines.steps import pull
from firsttoken.engines.synthetic import (
    MODEL_ID,
    Failure,
    Faults,
    Part,
    Script,
    SyntheticEngine,
    finish_empty,
    options,
    push_part,
)
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
)

__all__ = ["BatchingEngine"]

_CHUNK = 64  # parts a sequence takes from its plan at a time


@dataclass(eq=False, slots=True)
class _Seq:
    engine: BatchingEngine
    request_id: str
    plan: Script
    failure: Failure | None
    sink: Sink
    chunk: list[Part] = field(default_factory=list)
    pos: int = 0  # in the chunk
    sent: int = 0

    def resume(self) -> None:
        # A batched sequence never pauses for a slow reader (a GPU batch doesn't either);
        # what piles up in its stream's log is bounded by the answer's length.
        return None

    def cancel(self) -> None:
        self.engine._leave(self)


class BatchingEngine(BaseEngine):
    """Synthetic text, paced by a step scheduler with a bounded batch."""

    models: tuple[str, ...] = (MODEL_ID,)

    def __init__(self, settings: Settings) -> None:
        self.batch_max = max(1, settings.batch_max)
        self.batch_timeout_s = settings.batch_timeout_ms / 1000
        self.step_base_s = settings.batch_step_base_ms / 1000
        self.step_per_seq_s = settings.batch_step_per_seq_ms / 1000
        self.tokens_generated = 0
        self.steps = 0  # decode steps run (for tests and benches)
        # Both keyed by request id, in arrival order; a request is in at most one of them.
        self._waiting: dict[str, _Seq] = {}
        self._running: dict[str, _Seq] = {}
        self._wake = anyio.Event()
        self._exit: AsyncExitStack | None = None
        self._words = SyntheticEngine(style=settings.synthetic_style)  # words and style
        self.faults = Faults(settings.synthetic_fail_rate)

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        return synthetic_answer(request, self._words.prompt_tokens)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        # The task group lives from start() to close() (both run in the app's lifespan task).
        stack = AsyncExitStack()
        tg: TaskGroup = await stack.enter_async_context(anyio.create_task_group())
        tg.start_soon(self._schedule)
        stack.callback(tg.cancel_scope.cancel)  # runs first on exit: stop the scheduler
        self._exit = stack

    async def close(self) -> None:
        self._waiting.clear()
        self._running.clear()
        if self._exit is not None:
            exit_stack, self._exit = self._exit, None
            await exit_stack.aclose()

    # -- the Engine interface --------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return {}

    def prompt_tokens(self, prompt: str) -> int:
        return self._words.prompt_tokens(prompt)

    def step_s(self, batch_size: int) -> float:
        """How long one decode step over `batch_size` sequences takes."""
        return self.step_base_s + self.step_per_seq_s * batch_size

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def abort(self, request_id: str) -> None:
        seq = self._waiting.get(request_id) or self._running.get(request_id)
        if seq is not None:
            self._leave(seq)

    def check(self, request: GenerationRequest) -> None:
        self._words.check(request)

    def open(self, request: GenerationRequest, sink: Sink) -> Generation:
        opts = options(request)
        plan = Script.of(request, opts, self._words.style)
        seq = _Seq(self, request.request_id, plan, self.faults.draw(opts), sink)
        if plan.finish is not None and (seq.failure is None or seq.failure.client_fault):
            finish_empty(sink, plan.finish, plan.usage())  # an empty answer
            return seq
        if self._exit is None:
            sink.fail(EngineError("engine_unavailable", "the batching engine is not running"))
            return seq
        self._waiting[seq.request_id] = seq
        self._notify()
        return seq

    def as_step_engine(self) -> StepEngine:
        return self

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        return pull(self, request)

    # -- the scheduler ---------------------------------------------------------------------

    def _notify(self) -> None:
        self._wake.set()

    async def _wait_for_news(self) -> None:
        event = self._wake
        await event.wait()
        if self._wake is event:
            self._wake = anyio.Event()

    def _leave(self, seq: _Seq) -> None:
        self._waiting.pop(seq.request_id, None)
        self._running.pop(seq.request_id, None)

    async def _schedule(self) -> None:
        clock = anyio.current_time
        while True:
            if not self._running:
                while not self._waiting:
                    await self._wait_for_news()
                # Idle: give a batch up to the timeout to fill before the first step.
                deadline = clock() + self.batch_timeout_s
                while len(self._waiting) < self.batch_max and clock() < deadline:
                    with anyio.move_on_after(deadline - clock()):
                        await self._wait_for_news()
            # Step boundary: waiting requests take the free slots, oldest first.
            while self._waiting and len(self._running) < self.batch_max:
                rid = next(iter(self._waiting))
                self._running[rid] = self._waiting.pop(rid)
            if not self._running:
                continue  # everyone who waited has left
            started = clock()
            await anyio.sleep_until(started + self.step_s(len(self._running)))
            self._step()

    def _step(self) -> None:
        """Emit one token for every sequence still in the batch (no awaits: atomic)."""
        self.steps += 1
        for seq in list(self._running.values()):
            if seq.request_id not in self._running:
                continue  # left during this step (its stream was cut by a write)
            plan, failure = seq.plan, seq.failure
            if seq.pos >= len(seq.chunk) and plan.finish is None:
                seq.chunk, seq.pos = plan.take(_CHUNK), 0
            last = plan.finish is not None and seq.pos >= len(seq.chunk) - 1
            if failure is not None and (
                seq.sent >= failure.at or (last and not failure.client_fault)
            ):
                self._leave(seq)
                seq.sink.fail(failure.error(seq.sent))
                continue
            part = seq.chunk[seq.pos]
            seq.pos += 1
            seq.sent += 1
            self.tokens_generated += 1
            if last:
                self._leave(seq)
                push_part(seq.sink, part, plan.finish, plan.usage())
            else:
                push_part(seq.sink, part)
