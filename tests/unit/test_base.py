"""The engine interface's request (`firsttoken/generation.py`): built by keyword only, what a
stream keeps of it once the engine has it, and its JSON (a takeover's)."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from firsttoken.generation import GenerationRequest, from_stored, stored_request

CLEARED = {"prompt": "", "messages": None, "body": None, "options": {}}


def test_a_request_without_inputs_keeps_every_other_field() -> None:
    given = GenerationRequest(
        request_id="r1",
        prompt="a long prompt",
        model="m",
        max_tokens=7,
        seed=3,
        temperature=0.5,
        stop=("x",),
        messages=({"role": "user", "content": "hi"},),
        body={"model": "m"},
        options={"synthetic": {}},
        tenant="team-a",
        priority=2,
        weight=0.25,
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        prompt_tokens=3,
        trace_id="t1",
        linked_traceparent="00-" + "3" * 32 + "-" + "4" * 16 + "-01",
    )
    # Every field set above differs from its default: a field added later and not carried
    # over by `without_inputs` fails here.
    for f in dataclasses.fields(GenerationRequest):
        default = f.default_factory() if callable(f.default_factory) else f.default
        assert getattr(given, f.name) != default, f"give {f.name} a value in this test"
    kept = given.without_inputs()
    for f in dataclasses.fields(GenerationRequest):
        expected = CLEARED.get(f.name, getattr(given, f.name))
        assert getattr(kept, f.name) == expected, f.name


def test_a_request_as_admitted_changes_only_what_admission_decided() -> None:
    given = GenerationRequest(
        request_id="r1", prompt="a prompt", model="m", max_tokens=100_000, body={"x": 1}
    )
    admitted = given.admitted(995, 2, "t1", None, "00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    changed = {"max_tokens", "prompt_tokens", "trace_id", "linked_traceparent"}
    for f in dataclasses.fields(GenerationRequest):
        if f.name not in changed:
            assert getattr(admitted, f.name) == getattr(given, f.name), f.name
    assert (admitted.max_tokens, admitted.prompt_tokens, admitted.trace_id) == (995, 2, "t1")


def test_a_request_is_built_by_keyword_only() -> None:
    # max_tokens and seed are both `int | None`: by position a swap would pass unnoticed.
    with pytest.raises(TypeError):
        GenerationRequest("r1", "a prompt", "m", 100, 7)  # type: ignore[misc]


# A request as an instance of the version before stored it with its stream (a takeover's
# handover): what every version reads, and writes again, in a rolling deploy.
STORED = {
    "prompt": "user: hi",
    "model": "synthetic",
    "max_tokens": 10,
    "seed": 3,
    "temperature": 0.5,
    "stop": ["END"],
    "messages": [{"role": "user", "content": "hi"}],
    "body": {"model": "synthetic", "max_tokens": 10},
    "options": {"synthetic": {"itl_ms": 5}},
    "tenant": "ops",
}


def test_a_stored_request_reads_back_as_it_was_and_is_stored_in_the_same_fields() -> None:
    request = from_stored(
        STORED, request_id="s1", model="synthetic", tenant="ops", priority=2, weight=0.5
    )
    assert (request.max_tokens, request.seed, request.temperature) == (10, 3, 0.5)
    assert request.stop == ("END",) and request.messages == ({"role": "user", "content": "hi"},)
    assert (request.request_id, request.priority, request.weight) == ("s1", 2, 0.5)
    assert request.body == STORED["body"] and request.options == STORED["options"]
    assert orjson.loads(orjson.dumps(stored_request(request))) == STORED
