"""`/v1/moderations`' body (`firsttoken/api/moderations.py`): OpenAI's three input shapes as
the engine's inputs (a list of parts is one input), and its bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from firsttoken.api.moderations import ModerationBody


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("one text", ("one text",)),
        (["a", "b"], ("a", "b")),
        (
            [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                {"type": "text", "text": "here"},
            ],
            ("look here",),
        ),
    ],
)
def test_each_input_shape_becomes_the_engines_inputs(given: object, inputs: tuple) -> None:
    assert ModerationBody.model_validate({"input": given}).inputs() == inputs


@pytest.mark.parametrize("given", [[], ["x"] * 2049, [{"type": "audio", "audio": "x"}], 3])
def test_a_bad_input_is_refused(given: object) -> None:
    with pytest.raises(ValidationError) as info:
        ModerationBody.model_validate({"input": given})
    assert info.value.errors()[0]["loc"][0] == "input"
