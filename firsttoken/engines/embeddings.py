"""Deterministic embeddings, moderations and images, the synthetic engine's, so the quick tour
and the tests need no upstream for `/v1/embeddings`, `/v1/moderations` or
`/v1/images/generations`.

An embedding is a function of the model's name and the input alone, of unit length, in the
OpenAI `list` answer. A moderation flags each of OpenAI's categories whose name the input
holds as a word (`violence`, `self-harm/intent`...), scored 0.9; every other score is small
(under 0.01) and a function of the model, the input and the category alone. An image is a
16 × 16 PNG of one colour, a function of the model, the prompt and its place.

Cost: one SHAKE-256 digest of 4 bytes a dimension (a category) per input, and the vector's
packing: ~25 µs an input at 256 dimensions."""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from firsttoken.generation import EmbeddingRequest, Embeddings, not_embedding

__all__ = [
    "CATEGORIES",
    "DEFAULT_DIMENSIONS",
    "png",
    "synthetic_answer",
    "synthetic_embeddings",
    "synthetic_images",
    "synthetic_moderations",
    "vector",
]

DEFAULT_DIMENSIONS = 256  # without `dimensions` in the request


def vector(model: str, item: str | tuple[int, ...], dimensions: int) -> tuple[float, ...]:
    """The input's vector: unit length, in float32 precision (what `base64` carries)."""
    digest = hashlib.shake_256(f"{model}\0{item!r}".encode()).digest(4 * dimensions)
    raw = [v / 4294967296.0 - 0.5 for v in struct.unpack(f"<{dimensions}I", digest)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    packed = struct.pack(f"<{dimensions}f", *(v / norm for v in raw))
    return struct.unpack(f"<{dimensions}f", packed)


def synthetic_embeddings(request: EmbeddingRequest, count: Callable[[str], int]) -> Embeddings:
    """The answer to `request`, its inputs counted by `count` (token ids count one each)."""
    body: Mapping[str, Any] = request.body
    dimensions = body.get("dimensions") or DEFAULT_DIMENSIONS
    as_base64 = body.get("encoding_format") == "base64"
    data = []
    for index, item in enumerate(request.inputs):
        values = vector(request.model, item, dimensions)
        embedding: str | list[float] = (
            base64.b64encode(struct.pack(f"<{dimensions}f", *values)).decode()
            if as_base64
            else list(values)
        )
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(count(item) if isinstance(item, str) else len(item) for item in request.inputs)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    answer = {"object": "list", "data": data, "model": request.model, "usage": usage}
    return Embeddings(answer, tokens)


# OpenAI's moderation categories (omni-moderation), in its order.
CATEGORIES = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/intent",
    "self-harm/instructions",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)
FLAGGED_SCORE = 0.9


def synthetic_moderations(request: EmbeddingRequest, count: Callable[[str], int]) -> Embeddings:
    """The answer to `request` (its `moderations` body's texts as `inputs`)."""
    results = []
    for item in request.inputs:
        text = item if isinstance(item, str) else " ".join(map(str, item))
        words = set(text.lower().replace(",", " ").replace(".", " ").split())
        digest = hashlib.shake_256(f"{request.model}\0{text}".encode()).digest(4 * len(CATEGORIES))
        small = struct.unpack(f"<{len(CATEGORIES)}I", digest)
        flags = {name: name in words for name in CATEGORIES}
        scores = {
            name: FLAGGED_SCORE if flags[name] else round(v / 4294967296.0 / 100, 6)
            for name, v in zip(CATEGORIES, small, strict=True)
        }
        applied = {name: ["text"] for name in CATEGORIES}
        results.append(
            {
                "flagged": any(flags.values()),
                "categories": flags,
                "category_scores": scores,
                "category_applied_input_types": applied,
            }
        )
    answer_id = "modr-" + hashlib.sha256(request.request_id.encode()).hexdigest()[:24]
    answer = {"id": answer_id, "model": request.model, "results": results}
    tokens = sum(count(item) if isinstance(item, str) else len(item) for item in request.inputs)
    return Embeddings(answer, tokens)


IMAGE_SIDE = 16  # a synthetic image's width and height, whatever `size` asks


def png(rgb: bytes, side: int = IMAGE_SIDE) -> bytes:
    """A `side` × `side` PNG of one colour (8-bit RGB, unfiltered rows)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    rows = b"".join(b"\0" + rgb * side for _ in range(side))
    idat = zlib.compress(rows, 9)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def synthetic_images(request: EmbeddingRequest, count: Callable[[str], int]) -> Embeddings:
    """`/v1/images/generations`: `n` images (1 by default) of one colour each, a function of
    the model, the prompt and the image's place alone, as `b64_json` (no URL to host)."""
    prompt = request.inputs[0] if request.inputs else ""
    n = request.body.get("n") or 1
    data = []
    for index in range(n):
        colour = hashlib.shake_256(f"{request.model}\0{prompt!r}\0{index}".encode()).digest(3)
        image = base64.b64encode(png(colour)).decode()
        data.append({"b64_json": image, "revised_prompt": prompt})
    tokens = count(prompt) if isinstance(prompt, str) else len(prompt)
    answer = {"created": int(time.time()), "data": data}
    return Embeddings(answer, tokens)


def synthetic_answer(request: EmbeddingRequest, count: Callable[[str], int]) -> Embeddings:
    """The synthetic engine's answer to whichever endpoint `request` names."""
    if request.endpoint == "embeddings":
        return synthetic_embeddings(request, count)
    if request.endpoint == "moderations":
        return synthetic_moderations(request, count)
    if request.endpoint == "images":
        return synthetic_images(request, count)
    raise not_embedding(request.model, request.endpoint)
