"""The synthetic engine's embeddings: a function of the model and the input alone, of unit
length, the same numbers as floats and as base64, counted as the engine counts a prompt."""

from __future__ import annotations

import base64
import math
import struct

from firsttoken.engines.embeddings import DEFAULT_DIMENSIONS, synthetic_embeddings, vector
from firsttoken.engines.text import count_words
from firsttoken.generation import EmbeddingRequest


def ask(*inputs: str | tuple[int, ...], **body: object) -> EmbeddingRequest:
    return EmbeddingRequest("e1", "synthetic", inputs, {"model": "synthetic", **body})


def test_a_vector_is_the_inputs_alone_and_of_unit_length() -> None:
    one = vector("synthetic", "hello", 64)
    assert one == vector("synthetic", "hello", 64)
    assert one != vector("synthetic", "hello!", 64) != vector("other", "hello", 64)
    assert math.isclose(math.sqrt(sum(v * v for v in one)), 1.0, rel_tol=1e-6)


def test_an_answer_numbers_its_inputs_and_counts_them() -> None:
    answer = synthetic_embeddings(ask("hello world", (1, 2, 3)), count_words)
    data = answer.body["data"]
    assert [d["index"] for d in data] == [0, 1] and len(data[0]["embedding"]) == DEFAULT_DIMENSIONS
    assert answer.prompt_tokens == 2 + 3 == answer.body["usage"]["prompt_tokens"]


def test_base64_carries_the_same_numbers_as_floats() -> None:
    floats = synthetic_embeddings(ask("hi", dimensions=16), count_words).body["data"][0]
    packed = synthetic_embeddings(ask("hi", dimensions=16, encoding_format="base64"), count_words)
    raw = base64.b64decode(packed.body["data"][0]["embedding"])
    assert list(struct.unpack("<16f", raw)) == floats["embedding"]
