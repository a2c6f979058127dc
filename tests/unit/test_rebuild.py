"""A renderer rebuilt on another instance (`firsttoken/formats/rebuild.py`): from its spec, as
it travels (through JSON), and brought by the deltas its events carry to the state the
stream left it in, so that the rest renders as it would have on the first instance."""

from __future__ import annotations

import orjson
import pytest

from firsttoken.delta import Delta, ToolCallDelta
from firsttoken.formats.anthropic import MessagesRenderer
from firsttoken.formats.rebuild import decode, rebuild, replay
from firsttoken.formats.render import ChatRenderer, CompletionRenderer, NativeRenderer
from firsttoken.formats.responses import ResponsesRenderer

USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def renderers() -> dict[str, object]:
    return {
        "native": NativeRenderer(),
        "binary": NativeRenderer(binary=True),
        "chat": ChatRenderer("chatcmpl-x", "m", 123, True),
        "completion": CompletionRenderer("cmpl-x", "m", 123, False),
        "responses": ResponsesRenderer({"id": "resp_x", "model": "m", "created_at": 1}, "x"),
        "messages": MessagesRenderer("msg_x", "m", 7),
    }


def answer(with_calls: bool) -> list[Delta]:
    deltas = [Delta(reasoning="hmm"), Delta(reasoning=" so"), Delta("Hel"), Delta('lo "x"\n')]
    if with_calls:
        deltas += [
            Delta(tool_calls=(ToolCallDelta(0, "call_1", "f", ""),)),
            Delta(tool_calls=(ToolCallDelta(0, None, None, '{"a"'),)),
        ]
    return deltas


def render(renderer, deltas: list[Delta]) -> list[tuple[str | None, bytes]]:
    """As a stream drives its renderer: the opening, then `render_more`."""
    return [*renderer.opening(), *render_more(renderer, deltas)]


@pytest.mark.parametrize("name", list(renderers()))
def test_a_rebuilt_renderer_renders_the_rest_as_the_first_one_would(name: str) -> None:
    first = renderers()[name]
    calls = name not in ("completion",)  # legacy completions carry text only
    before = answer(calls)
    events = render(first, before)
    again = rebuild(orjson.loads(orjson.dumps(first.spec())))  # as it travels
    deltas = list(decode(first.spec()["format"], iter(events)))
    replay(again, deltas)
    # The rest, rendered by both: the same bytes.
    rest = [Delta(" more"), Delta(reasoning="later")]
    assert render_more(again, rest) == render_more(first, rest)
    assert again.closing("stop", USAGE) == first.closing("stop", USAGE)


def render_more(renderer, deltas: list[Delta]) -> list[tuple[str | None, bytes]]:
    """A text run's start and its tokens, and the parts."""
    out = []
    for delta in deltas:
        if delta.structured:
            out += renderer.part(delta)
        else:
            out += renderer.begin_text()
            out.append((renderer.token_event, renderer.token(delta.text)))
    return out


@pytest.mark.parametrize("name", list(renderers()))
def test_the_events_read_back_as_the_answers_text(name: str) -> None:
    renderer = renderers()[name]
    events = render(renderer, answer(with_calls=False))
    events += renderer.closing("stop", USAGE)
    deltas = list(decode(renderer.spec()["format"], iter(events)))
    assert "".join(d.text for d in deltas) == 'Hello "x"\n'
    if name != "completion":
        assert "".join(d.reasoning for d in deltas) == "hmm so"


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="no renderer"):
        rebuild({"format": "nope"})


@pytest.mark.parametrize("name", ["chat", "completion"])
def test_an_openai_chunk_reads_back_whole_as_the_relay_reads_it(name: str) -> None:
    """The relay's decoder (`formats/chunks.py`): a chunk's logprobs, and every field the
    renderer put in one chunk, come back in one delta."""
    renderer = renderers()[name]
    scored = {"content": [{"token": "Hel", "logprob": -0.5, "top_logprobs": []}]}
    given = [Delta("Hel", logprobs=scored)]
    if name == "chat":
        given.append(Delta("lo", reasoning="so", extra={"annotations": [1]}))
    events = [*render(renderer, given), *renderer.closing("stop", USAGE)]
    assert list(decode(renderer.spec()["format"], iter(events))) == given
