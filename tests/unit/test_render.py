"""Renderers (`firsttoken/wire/render.py`): what another instance needs to render the rest of
a stream (`spec`), and each token event read back as the delta it rendered (a takeover's
text to continue from)."""

from __future__ import annotations

import orjson
import pytest

from firsttoken.delta import Delta, ToolCallDelta
from firsttoken.wire.render import (
    ChatRenderer,
    CompletionRenderer,
    NativeRenderer,
    decode_delta,
    renderer_from_spec,
)

DELTAS = [
    Delta("Hel"),
    Delta("lo\n\"there\""),
    Delta(reasoning="hmm"),
    Delta(refusal="no"),
    Delta(tool_calls=(ToolCallDelta(0, "call_1", "f", '{"a"'),)),
]


@pytest.mark.parametrize(
    "renderer",
    [
        NativeRenderer(),
        NativeRenderer(binary=True),
        ChatRenderer("chatcmpl-x", "m", 123, True),
        CompletionRenderer("cmpl-x", "m", 123, False),
    ],
    ids=["native", "binary", "chat", "completion"],
)
def test_a_renderer_rebuilt_from_its_spec_renders_every_event_alike(renderer) -> None:
    spec = orjson.loads(orjson.dumps(renderer.spec()))  # as it travels, through JSON
    again = renderer_from_spec(spec)
    for delta in DELTAS:
        assert again.part(delta) == renderer.part(delta)
        if delta.text:
            assert again.token(delta.text) == renderer.token(delta.text)
    assert again.opening() == renderer.opening()
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert again.closing("stop", usage) == renderer.closing("stop", usage)


@pytest.mark.parametrize(
    "renderer",
    [NativeRenderer(), NativeRenderer(binary=True), ChatRenderer("c", "m", 1, False)],
    ids=["native", "binary", "chat"],
)
def test_each_event_reads_back_as_the_delta_it_rendered(renderer) -> None:
    format = renderer.spec()["format"]
    for delta in DELTAS:
        for name, data in renderer.part(delta):
            back = decode_delta(format, name, data)
            assert back is not None
            assert (back.text, back.reasoning, back.refusal) == (
                delta.text,
                delta.reasoning,
                delta.refusal,
            )
            assert bool(back.tool_calls) == bool(delta.tool_calls)


def test_events_that_are_not_tokens_read_back_as_nothing() -> None:
    chat = ChatRenderer("c", "m", 1, True)
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    events = [*chat.opening(), *chat.closing("stop", usage), *chat.error("x", "y")]
    assert all(decode_delta("chat.completion.chunk", n, d) is None for n, d in events)
    native = NativeRenderer()
    events = [*native.closing("stop", usage), ("meta", b'{"takeover":{}}')]
    assert all(decode_delta("native", n, d) is None for n, d in events)
    completion = CompletionRenderer("c", "m", 1, False)
    assert decode_delta("text_completion", None, completion.token("hi")) == Delta("hi")


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="no renderer"):
        renderer_from_spec({"format": "response"})
