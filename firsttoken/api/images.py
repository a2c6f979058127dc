"""`POST /v1/images/generations`, as `/v1/embeddings` goes (`embeddings.answer_once`): behind
the keys, limits and budgets, in the ledger (its prompt's tokens at the answering target's
`prompt` price: an image itself is not priced), answered by the synthetic engine's
deterministic images or by a route's targets that declare `serves = ["images"]`, in order.
Edits and variations (multipart uploads) are not served."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from firsttoken.api.embeddings import answer_once
from firsttoken.api.protocol import _Body

__all__ = ["ImageBody", "generations"]

MAX_PROMPT_CHARS = 32_000  # OpenAI's bound (gpt-image-1)


class ImageBody(_Body):
    model: str | None = None
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
    n: Annotated[int, Field(ge=1, le=10)] | None = None
    # size, quality, response_format, background, style, user...: the target's to read.

    def inputs(self) -> tuple[str | tuple[int, ...], ...]:
        return (self.prompt,)


async def generations(request: Request) -> Response:
    return await answer_once(request, ImageBody, "images")
