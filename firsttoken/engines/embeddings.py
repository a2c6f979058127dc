"""Deterministic embeddings, the synthetic engine's: each input's vector is a function of the
model's name and the input alone, of unit length, so the quick tour and the tests need no
upstream for `/v1/embeddings`; and the OpenAI `list` answer they go in.

Cost: one SHAKE-256 digest of 4 bytes a dimension per input, and the vector's packing:
~25 µs an input at 256 dimensions."""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from collections.abc import Callable, Mapping
from typing import Any

from firsttoken.generation import EmbeddingRequest, Embeddings

__all__ = ["DEFAULT_DIMENSIONS", "synthetic_embeddings", "vector"]

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
