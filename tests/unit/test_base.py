"""The engine interface's request: what a stream keeps of it once the engine has it."""

from __future__ import annotations

import dataclasses

from firsttoken.generation import GenerationRequest

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
