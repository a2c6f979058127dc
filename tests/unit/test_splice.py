"""The splice's state machine without sockets: what the client was sent (Transcript), whether
another target may continue it, the continuation request, and usage over both legs."""

from __future__ import annotations

from typing import Any

from firsttoken.generation import Delta, GenerationRequest, ToolCallDelta
from firsttoken.routing.splice import Transcript, continuation, spliced_usage

USER = {"role": "user", "content": "Say hello."}


def sent(*deltas: Delta) -> Transcript:
    transcript = Transcript()
    for delta in deltas:
        transcript.add(delta)
    return transcript


def chat(max_tokens: int | None = 10, **body: Any) -> GenerationRequest:
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return GenerationRequest(
        request_id="s1",
        prompt="user: Say hello.",
        model="chat",
        max_tokens=max_tokens,
        messages=(USER,),
        body={"model": "chat", "messages": [USER], "stream": True, **body},
        options={"synthetic": None},
    )


TOOL = Delta(tool_calls=(ToolCallDelta(0, id="call_1", name="get", arguments='{"ci'),))


# -- Transcript ------------------------------------------------------------------------------


def test_text_is_what_was_sent_in_order() -> None:
    transcript = sent(Delta("Hel"), Delta("lo"), Delta(","), Delta(" you"))
    assert transcript.text == "Hello, you"
    transcript.add(Delta("!"))
    assert transcript.text == "Hello, you!"
    assert (transcript.tokens, transcript.text_tokens) == (5, 5)
    assert transcript.why_not() is None


def test_finishes_meta_and_empty_deltas_are_not_tokens() -> None:
    transcript = sent(
        Delta("a"), Delta(""), Delta(meta={"failover": {}}), Delta("", finish_reason="stop")
    )
    assert (transcript.tokens, transcript.text_tokens, transcript.text) == (1, 1, "a")


def test_nothing_sent_cannot_be_continued() -> None:
    assert sent().why_not() == "nothing of the answer's text was sent"


def test_never_inside_an_open_reasoning_block() -> None:
    transcript = sent(Delta(reasoning="Let"), Delta(reasoning=" me think"))
    assert transcript.tokens == 2 and transcript.text_tokens == 0
    assert transcript.why_not() == "the answer was cut inside its reasoning"


def test_after_reasoning_then_text_it_can() -> None:
    transcript = sent(Delta(reasoning="Let me think."), Delta("Hello"), Delta(" there"))
    assert transcript.why_not() is None
    assert transcript.text == "Hello there"  # the reasoning is not the continuation's text
    assert (transcript.tokens, transcript.text_tokens) == (3, 2)


def test_never_once_a_tool_call_began() -> None:
    transcript = sent(Delta("Let me look."), TOOL)
    assert transcript.why_not() == "the answer holds a tool call"
    transcript.add(Delta(" Done."))  # text after it does not make the call whole
    assert transcript.why_not() == "the answer holds a tool call"


def test_never_a_refusal() -> None:
    transcript = sent(Delta(refusal="I can't"))
    assert transcript.why_not() == "the answer is a refusal"


# -- the continuation request ------------------------------------------------------------------


def test_a_chat_continues_with_exactly_the_text_sent() -> None:
    request = chat(max_tokens=10, max_completion_tokens=12)
    transcript = sent(Delta("Hello"), Delta(" there"), Delta(","))
    follow = continuation(request, transcript)
    assert follow is not None
    assistant = {"role": "assistant", "content": "Hello there,"}
    assert follow.messages == (USER, assistant)
    assert follow.body is not None
    assert follow.body["messages"] == [USER, assistant]
    assert follow.body["continue_final_message"] is True
    assert follow.body["add_generation_prompt"] is False
    assert follow.options["continuation"] == "Hello there,"
    assert follow.options["synthetic"] is None  # the request's own options are kept
    assert follow.max_tokens == 7
    assert follow.body["max_tokens"] == 7 and follow.body["max_completion_tokens"] == 9
    assert follow.prompt == request.prompt  # the prompt is the conversation without it
    assert (follow.request_id, follow.model) == ("s1", "chat")
    # The client's request is left as it came.
    assert request.body is not None and request.body["messages"] == [USER]
    assert "continue_final_message" not in request.body
    assert "continuation" not in request.options


def test_max_tokens_counts_every_token_sent_reasoning_included() -> None:
    transcript = sent(Delta(reasoning="Hmm"), Delta(reasoning="."), Delta("Hi"))
    follow = continuation(chat(max_tokens=10), transcript)
    assert follow is not None
    assert follow.max_tokens == 7
    assert follow.body is not None and follow.body["max_tokens"] == 7
    assert follow.options["continuation"] == "Hi"


def test_a_spent_limit_means_the_answer_is_complete() -> None:
    transcript = sent(Delta("a"), Delta("b"), Delta("c"))
    assert continuation(chat(max_tokens=3), transcript) is None
    assert continuation(chat(max_tokens=2), transcript) is None
    follow = continuation(chat(max_tokens=4), transcript)
    assert follow is not None and follow.max_tokens == 1


def test_without_a_limit_none_is_set() -> None:
    follow = continuation(chat(max_tokens=None), sent(Delta("a")))
    assert follow is not None
    assert follow.max_tokens is None
    assert follow.body is not None and "max_tokens" not in follow.body


def test_a_second_splice_continues_the_whole_text_once() -> None:
    request = chat(max_tokens=None)
    transcript = sent(Delta("Hello"))
    first = continuation(request, transcript)
    transcript.add(Delta(" there"))
    second = continuation(request, transcript)
    assert first is not None and second is not None
    assert second.messages == (USER, {"role": "assistant", "content": "Hello there"})
    assert second.body is not None and len(second.body["messages"]) == 2


def test_a_client_prefill_is_continued_not_followed_by_a_second_assistant_turn() -> None:
    # The client itself asked to continue "The answer" (vLLM continue_final_message or an
    # Anthropic prefill): the cut answer's continuation is that text plus what was sent.
    prefill = {"role": "assistant", "content": "The answer"}
    request = GenerationRequest(
        request_id="s1",
        prompt="user: Say hello.",
        model="chat",
        messages=(USER, prefill),
        body={
            "messages": [USER, prefill],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        options={"continuation": "The answer"},
    )
    follow = continuation(request, sent(Delta(" is"), Delta(" 42")))
    assert follow is not None
    whole = {"role": "assistant", "content": "The answer is 42"}
    assert follow.messages == (USER, whole)
    assert follow.body is not None and follow.body["messages"] == [USER, whole]
    assert follow.options["continuation"] == "The answer is 42"


def test_a_plain_prompt_grows_by_the_text_sent() -> None:
    request = GenerationRequest(
        request_id="c1",
        prompt="Once upon",
        model="m",
        max_tokens=5,
        body={"model": "m", "prompt": "Once upon", "max_tokens": 5},
    )
    follow = continuation(request, sent(Delta(" a"), Delta(" time")))
    assert follow is not None
    # The relay sends the body's prompt, grown; our own engines keep the prompt and read
    # options["continuation"].
    assert follow.prompt == "Once upon"
    assert follow.body is not None
    assert follow.body["prompt"] == "Once upon a time"
    assert "messages" not in follow.body and "continue_final_message" not in follow.body
    assert follow.messages is None
    assert follow.max_tokens == 3 and follow.body["max_tokens"] == 3
    assert follow.options["continuation"] == " a time"


def test_a_grown_prompt_says_where_its_answer_began() -> None:
    # A firsttoken upstream's synthetic engine answers a prompt as a function of it: the
    # grown prompt alone reads as a new one, and it would answer another text.
    request = GenerationRequest(
        request_id="c1", prompt="Once upon", model="m", body={"prompt": "Once upon"}
    )
    follow = continuation(request, sent(Delta(" a"), Delta(" time")))
    assert follow is not None and follow.body is not None
    assert follow.body["continue_final_text"] == " a time"
    assert follow.body["prompt"].endswith(follow.body["continue_final_text"])


def test_a_clients_own_continued_completion_is_continued_from_its_whole_text() -> None:
    # The client asked to continue " a" (continue_final_text): the prompt the engine reads
    # lacks it, the body's holds it; what continues is " a" plus what was sent.
    request = GenerationRequest(
        request_id="c1",
        prompt="Once upon",
        model="m",
        body={"prompt": "Once upon a", "continue_final_text": " a"},
        options={"continuation": " a"},
    )
    follow = continuation(request, sent(Delta(" time"), Delta(" there")))
    assert follow is not None and follow.body is not None
    assert follow.prompt == "Once upon"
    assert follow.body["prompt"] == "Once upon a time there"
    assert follow.body["continue_final_text"] == " a time there"
    assert follow.options["continuation"] == " a time there"


def test_a_prompt_without_a_body_continues_too() -> None:
    request = GenerationRequest(request_id="c1", prompt="Once", model="m")
    follow = continuation(request, sent(Delta(" upon")))
    assert follow is not None
    assert (follow.prompt, follow.body, follow.max_tokens) == ("Once", None, None)
    assert follow.options["continuation"] == " upon"  # the relay appends it to the prompt


# -- usage over both legs ----------------------------------------------------------------------


def test_usage_counts_the_prompt_once_and_every_token_sent() -> None:
    # Leg 2 was asked with prompt 10 + 4 tokens of prefix, and made 6 more; leg 1 sent 5
    # (one of them reasoning): the whole answer is 10 prompt and 11 completion tokens.
    usage = {"prompt_tokens": 14, "completion_tokens": 6, "total_tokens": 20}
    whole = spliced_usage(usage, before_tokens=5, before_text_tokens=4)
    assert whole == {"prompt_tokens": 10, "completion_tokens": 11, "total_tokens": 21}
    assert usage["prompt_tokens"] == 14  # the leg's own dict is not changed


def test_usage_keeps_the_legs_other_fields() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"x": 1}}
    whole = spliced_usage(usage, 2, 2)
    assert whole is not None and whole["prompt_tokens_details"] == {"x": 1}
    assert whole["prompt_tokens"] == 1 and whole["completion_tokens"] == 3


def test_usage_never_goes_negative_and_none_stays_none() -> None:
    whole = spliced_usage({"prompt_tokens": 1, "completion_tokens": 0}, 4, 4)
    assert whole is not None and whole["prompt_tokens"] == 0
    assert spliced_usage(None, 3, 3) is None
    assert spliced_usage({}, 3, 3) is None
    assert spliced_usage({"prompt_tokens": "9", "completion_tokens": 1}, 3, 3) is None
