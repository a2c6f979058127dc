"""`POST /v1/moderations`, as `/v1/embeddings` goes (`embeddings.answer_once`): behind the
keys, limits and budgets, in the ledger (its texts are its prompt), answered by the
synthetic engine's deterministic moderations or by a route's targets that declare it
(`serves = ["moderations"]` in the routes file), in order."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import Response

from firsttoken.api.embeddings import MAX_INPUTS, answer_once
from firsttoken.api.protocol import _Body

__all__ = ["ModerationBody", "moderations"]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: dict[str, Any]


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ModerationBody(_Body):
    model: str | None = None
    # A text, texts, or OpenAI's multimodal parts (text and image_url).
    input: str | list[str] | list[Part]

    @field_validator("input")
    @classmethod
    def _bounded(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list):
            if not value:
                raise ValueError("must hold at least one input")
            if len(value) > MAX_INPUTS:
                raise ValueError(f"holds {len(value)} inputs; at most {MAX_INPUTS}")
        return value

    def inputs(self) -> tuple[str | tuple[int, ...], ...]:
        """The texts: each string one input; a list of parts is one input, its text parts
        (an image counts no tokens here; its upstream judges it)."""
        value = self.input
        if isinstance(value, str):
            return (value,)
        if isinstance(value[0], str):
            return tuple(value)
        return (" ".join(part.text for part in value if isinstance(part, TextPart)),)


async def moderations(request: Request) -> Response:
    return await answer_once(request, ModerationBody, "moderations")
