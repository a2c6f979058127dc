"""OpenAI's adapters (`api/openai/adapter.py`): a body as the engine's request, the plan of its
answer, and a whole answer's fold."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from firsttoken.api.openai import CHAT, COMPLETIONS
from firsttoken.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from firsttoken.api.pipeline import Ending
from firsttoken.engines.synthetic import SyntheticOptions, answer_parts, synthetic_tokens
from firsttoken.formats.assemble import ChatAnswer
from firsttoken.formats.render import ChatRenderer, CompletionRenderer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_a_chat_body_becomes_the_engines_request_with_the_raw_body_for_a_relay() -> None:
    raw = {"messages": MESSAGES, "max_completion_tokens": 5, "tools": [{"x": 1}]}
    body = ChatCompletionRequest.model_validate(raw)
    request = CHAT.generation(body, "m", "id1", raw=raw)
    assert (request.request_id, request.model, request.max_tokens) == ("id1", "m", 5)
    assert request.prompt == "system: be brief\nuser: hi"
    assert request.messages == tuple(MESSAGES)
    assert request.body is raw  # forwarded as sent, tools and all
    assert request.options == {"synthetic": None}


def test_a_continued_chat_tells_native_engines_the_text_to_continue() -> None:
    body = chat(
        messages=[*MESSAGES, {"role": "assistant", "content": "Hel"}],
        continue_final_message=True,
        add_generation_prompt=False,
    )
    request = CHAT.generation(body, "m", "id1")
    assert request.options["continuation"] == "Hel"
    assert request.prompt == "system: be brief\nuser: hi"  # the continued message is not in it


def test_a_completion_body_has_a_prompt_and_no_messages() -> None:
    body = CompletionRequest.model_validate({"prompt": ["once"], "max_tokens": 2, "seed": 4})
    request = COMPLETIONS.generation(body, "m", "id1")
    assert (request.prompt, request.messages, request.seed) == ("once", None, 4)


def test_a_continued_completion_tells_the_engine_where_its_answer_began() -> None:
    # The prompt a relay's splice grew by the text sent, the seam named: the engine answers
    # the prompt before it and continues from that text, as for a chat.
    raw = {"prompt": "Tell me. The throu", "continue_final_text": " The throu"}
    body = CompletionRequest.model_validate(raw)
    request = COMPLETIONS.generation(body, "m", "id1", raw=raw)
    assert request.prompt == "Tell me."
    assert request.options["continuation"] == " The throu"
    assert request.body is raw  # a relay forwards the grown prompt and the seam


def test_a_grown_completion_prompt_continues_into_the_undisturbed_answer() -> None:
    # What the synthetic engine answered the grown prompt as a new one: a different text
    # from the seam on (issue 55). With the seam named, the rest of the same answer.
    full, finish = synthetic_tokens("Tell me.", None, 40)
    for k in (1, 7, 39):
        sent = "".join(full[:k])
        raw = {"prompt": "Tell me." + sent, "continue_final_text": sent, "max_tokens": 40 - k}
        request = COMPLETIONS.generation(CompletionRequest.model_validate(raw), "m", "id1")
        rest, rest_finish = answer_parts(request, SyntheticOptions())
        assert full[:k] + rest == full and rest_finish == finish, k


def test_a_continued_text_that_does_not_end_the_prompt_is_refused() -> None:
    with pytest.raises(ValidationError, match="continue_final_text") as info:
        CompletionRequest.model_validate({"prompt": "Tell me.", "continue_final_text": "The"})
    assert "must be the end of the prompt" in str(info.value)
    whole = CompletionRequest.model_validate({"prompt": "Tell", "continue_final_text": "Tell"})
    assert COMPLETIONS.generation(whole, "m", "id1").prompt == ""


def test_a_streamed_request_plans_its_stream_options() -> None:
    body = chat(
        stream=True,
        stream_options={"include_usage": True, "meta": True, "timestamps": True, "coalesce": "off"},
    )
    plan = CHAT.plan(body, "m", "abc", 7)
    assert plan.ending is Ending.STREAM and plan.fold is None
    assert (plan.coalesce, plan.meta, plan.timestamps) == ("off", True, True)
    assert isinstance(plan.renderer, ChatRenderer)


def test_a_whole_answer_is_folded_with_its_id_model_and_usage() -> None:
    plan = COMPLETIONS.plan(CompletionRequest(prompt="p"), "m", "abc", 7)
    assert plan.ending is Ending.WHOLE and isinstance(plan.renderer, CompletionRenderer)
    assert plan.fold is not None
    answer = ChatAnswer(content="done", finish_reason="stop", usage={"total_tokens": 3})
    body = plan.fold(answer)
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert body["model"] == "m" and body["usage"] == {"total_tokens": 3}
    choice = {"index": 0, "text": "done", "logprobs": None, "finish_reason": "stop"}
    assert body["choices"] == [choice]
    chat_body = CHAT.plan(chat(), "m", "abc", 7).fold(answer)  # type: ignore[misc]
    assert chat_body["id"] == "chatcmpl-abc" and chat_body["object"] == "chat.completion"
    assert chat_body["choices"][0]["message"]["content"] == "done"
