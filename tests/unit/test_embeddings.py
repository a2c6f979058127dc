"""The synthetic engine's embeddings: a function of the model and the input alone, of unit
length, the same numbers as floats and as base64, counted as the engine counts a prompt; its
moderations: the categories an input names, flagged, the rest scored low, deterministically."""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import replace

import pytest

from firsttoken.engines.embeddings import (
    CATEGORIES,
    DEFAULT_DIMENSIONS,
    png,
    synthetic_answer,
    synthetic_embeddings,
    vector,
)
from firsttoken.engines.text import count_words
from firsttoken.generation import EmbeddingRequest, EngineError


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


def moderation(*inputs: str) -> EmbeddingRequest:
    body = {"input": list(inputs)}
    return EmbeddingRequest("m1", "synthetic", inputs, body, endpoint="moderations")


def test_a_moderation_flags_the_categories_its_input_names_and_nothing_else() -> None:
    answer = synthetic_answer(
        moderation("a calm day", "Violence, then self-harm/intent."), count_words
    )
    calm, named = answer.body["results"]
    assert calm["flagged"] is False and not any(calm["categories"].values())
    assert max(calm["category_scores"].values()) < 0.01
    assert named["flagged"] is True
    assert {c for c, on in named["categories"].items() if on} == {"violence", "self-harm/intent"}
    assert named["category_scores"]["violence"] == 0.9
    assert list(calm["categories"]) == list(CATEGORIES)
    assert answer.prompt_tokens == count_words("a calm day") + count_words(
        "Violence, then self-harm/intent."
    )
    # The same input, the same answer (its id is the request's).
    assert synthetic_answer(moderation("a calm day"), count_words).body["results"][0] == calm


def test_an_endpoint_the_synthetic_engine_has_not_is_a_404_naming_it() -> None:
    asked = EmbeddingRequest("a1", "synthetic", ("a cat",), {}, endpoint="audio")
    with pytest.raises(EngineError) as info:
        synthetic_answer(asked, count_words)
    assert info.value.status == 404 and info.value.code == "audio_not_served"


def test_an_image_is_a_png_of_the_prompt_alone() -> None:
    asked = EmbeddingRequest("i1", "synthetic", ("a red fox",), {"n": 2}, endpoint="images")
    answer = synthetic_answer(asked, count_words)
    first, second = (base64.b64decode(d["b64_json"]) for d in answer.body["data"])
    assert first.startswith(b"\x89PNG\r\n\x1a\n") and first != second  # each its own colour
    again = synthetic_answer(replace(asked, request_id="i2"), count_words)
    assert again.body["data"] == answer.body["data"]
    assert answer.prompt_tokens == count_words("a red fox")
    assert png(b"\x00\x00\x00")[16:24] == struct.pack(">II", 16, 16)  # IHDR: 16 × 16
