"""OpenAI's Chat Completions and (legacy) Completions, as the pipeline's adapters.

The two differ in their body (messages or a prompt), their renderer (`ChatRenderer`,
`CompletionRenderer`) and their whole answer's choice (`message` or `text`); the rest is one
adapter.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from firsttoken.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from firsttoken.api.pipeline import Ending, Format, Inputs, Plan
from firsttoken.config import Settings
from firsttoken.formats.assemble import ChatAnswer
from firsttoken.formats.render import ChatRenderer, CompletionRenderer

__all__ = ["CHAT", "COMPLETIONS", "ChatFormat", "CompletionFormat"]

R = TypeVar("R", ChatCompletionRequest, CompletionRequest)


class _OpenAIFormat(Format[R], Generic[R]):
    name = "openai"
    prefix: str  # of the answer's id, before the stream's
    answer_object: str  # a whole answer's `object`
    renderer: type[ChatRenderer] | type[CompletionRenderer]

    def grace_s(self, settings: Settings) -> float:
        return settings.openai_grace_s

    def inputs(self, body: R, raw: dict[str, Any] | None, model: str) -> Inputs:
        # `raw`: a relay forwards the body as the client sent it.
        synthetic = body.synthetic.model_dump() if body.synthetic else None
        return Inputs(
            self.prompt(body),
            body.token_limit(),
            body.seed,
            body.temperature,
            body.stop_strings(),
            self.messages(body),
            raw,
            {"synthetic": synthetic},
        )

    def prompt(self, body: R) -> str:
        raise NotImplementedError

    def messages(self, body: R) -> tuple[dict[str, str], ...] | None:
        return None  # the prompt is all there is

    def plan(self, body: R, model: str, stream_id: str, prompt_tokens: int) -> Plan:
        answer_id = self.prefix + stream_id
        created = int(time.time())
        options = body.stream_options if body.stream else None
        # Usage always, for the non-streaming answer to carry it.
        include_usage = not body.stream or bool(options and options.include_usage)
        plan = Plan(
            self.renderer(answer_id, model, created, include_usage),
            Ending.STREAM if body.stream else Ending.WHOLE,
        )
        if options is not None:
            plan.coalesce = options.coalesce
            plan.meta = options.meta
            plan.timestamps = options.timestamps
        if not body.stream:
            plan.fold = lambda answer: self.fold(answer, answer_id, model, created)
        return plan

    def fold(self, answer: ChatAnswer, answer_id: str, model: str, created: int) -> dict[str, Any]:
        choice: dict[str, object] = {"index": 0}
        choice.update(self.choice(answer))
        choice.update(logprobs=answer.logprobs, finish_reason=answer.finish_reason)
        return {
            "id": answer_id,
            "object": self.answer_object,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": answer.usage,
        }

    def choice(self, answer: ChatAnswer) -> Mapping[str, object]:
        raise NotImplementedError


class ChatFormat(_OpenAIFormat[ChatCompletionRequest]):
    """`POST /v1/chat/completions`."""

    body = ChatCompletionRequest
    prefix = "chatcmpl-"
    answer_object = "chat.completion"
    renderer = ChatRenderer

    def inputs(self, body: ChatCompletionRequest, raw: dict[str, Any] | None, model: str) -> Inputs:
        inputs = super().inputs(body, raw, model)
        if not body.continue_final_message:
            return inputs
        # Engines that continue natively read the text to continue here.
        return inputs._replace(options={**inputs.options, "continuation": body.continuation()})

    def prompt(self, body: ChatCompletionRequest) -> str:
        return body.prompt()

    def messages(self, body: ChatCompletionRequest) -> tuple[dict[str, str], ...]:
        return tuple({"role": m.role, "content": m.text()} for m in body.messages)

    def choice(self, answer: ChatAnswer) -> Mapping[str, object]:
        return {"message": answer.message()}


class CompletionFormat(_OpenAIFormat[CompletionRequest]):
    """`POST /v1/completions`."""

    body = CompletionRequest
    prefix = "cmpl-"
    answer_object = "text_completion"
    renderer = CompletionRenderer

    def inputs(self, body: CompletionRequest, raw: dict[str, Any] | None, model: str) -> Inputs:
        inputs = super().inputs(body, raw, model)
        if body.continue_final_text is None:
            return inputs
        # As a chat's continue_final_message: the engine continues from this text.
        return inputs._replace(options={**inputs.options, "continuation": body.continue_final_text})

    def prompt(self, body: CompletionRequest) -> str:
        return body.continued()

    def choice(self, answer: ChatAnswer) -> Mapping[str, object]:
        return {"text": answer.content}


CHAT = ChatFormat()
COMPLETIONS = CompletionFormat()
