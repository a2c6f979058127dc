"""Styled synthetic answers: Markdown and hostile text, deterministic and of the asked length."""

from __future__ import annotations

import random
import re

import pytest

from firsttoken.engines import synthetic_tokens
from firsttoken.engines.styles import styled_answer, tokenize


def text(style: str, seed: int, target: int) -> str:
    return "".join(styled_answer(style, random.Random(seed), target))


@pytest.mark.parametrize("style", ["markdown", "hostile"])
def test_same_generator_state_same_tokens(style: str) -> None:
    a = styled_answer(style, random.Random(11), 800)
    assert a == styled_answer(style, random.Random(11), 800)
    assert a != styled_answer(style, random.Random(12), 800)


@pytest.mark.parametrize("style", ["markdown", "hostile"])
@pytest.mark.parametrize("target", [1, 2, 7, 60, 300, 4000])
def test_length_is_the_target(style: str, target: int) -> None:
    for seed in range(5):
        tokens = styled_answer(style, random.Random(seed), target)
        assert len(tokens) == target
        assert all(isinstance(t, str) and t for t in tokens)


def test_markdown_has_every_construct() -> None:
    md = text("markdown", 1, 600)
    assert re.search(r"^# \S", md, re.M)  # ATX heading
    assert re.search(r"^## \S", md, re.M)
    assert re.search(r"^- \S", md, re.M)  # bulleted list
    assert re.search(r"^1\. \S", md, re.M) and re.search(r"^2\. \S", md, re.M)
    assert re.search(r"\*\*[^*\n]+\*\*", md)  # bold
    assert re.search(r"`[^`\n]+`", md)  # inline code
    assert re.search(r"^```\w*\n.*?^```$", md, re.M | re.S)  # a fenced block, closed
    assert re.search(r"^\|.*\|\n\|[-:| ]+\|\n\|.*\|$", md, re.M)  # table: header, rule, row
    assert re.search(r"\[[^\]]+\]\((https?|mailto):[^)]+\)", md)  # link


def test_a_long_markdown_answer_is_rich_throughout() -> None:
    md = text("markdown", 5, 4000)
    # Every quarter has its own fences and tables, opened and closed.
    quarters = [md[i * len(md) // 4 : (i + 1) * len(md) // 4] for i in range(4)]
    for quarter in quarters:
        assert len(re.findall(r"^```", quarter, re.M)) >= 2
        assert len(re.findall(r"^\|[-:| ]+\|$", quarter, re.M)) >= 1  # a table's rule row
        assert re.search(r"^#{1,3} ", quarter, re.M)
    assert len(re.findall(r"^```", md, re.M)) % 2 == 0  # every fence closes
    assert len(set(re.findall(r"^## (.+)$", md, re.M))) >= 5  # sections vary
    assert len(set(re.findall(r"^```(\w*)$", md, re.M))) >= 3  # so do languages


def test_markdown_tokens_split_constructs_like_a_model_would() -> None:
    tokens = styled_answer("markdown", random.Random(2), 4000)
    assert "```" in tokens and "python" in tokens
    i = tokens.index("```")
    assert tokens[i + 2] == "\n" or tokens[i + 1] == "\n"  # "```", "python", "\n"
    assert tokens.count("|") > 20 and " |" in tokens  # table cells come piece by piece
    assert "**" in tokens or " **" in tokens
    assert max(len(t) for t in tokens if t.strip()) <= 12  # indentation may be longer


def test_hostile_has_html_script_and_bad_links() -> None:
    hostile = text("hostile", 3, 300)
    for needle in (
        "<img src=x onerror=",
        "<script>",
        "</script>",
        "<iframe src=",
        "](javascript:",
        'href="javascript:',
        "onload=",
    ):
        assert needle in hostile, needle
    assert "<script>" in text("hostile", 3, 30)  # even a short answer


def test_tokens_concatenate_back() -> None:
    sample = "```python\nx = 1\n```\n| a | b |\n**bold** `code` 流式传输 🚀\tend"
    assert "".join(tokenize(sample)) == sample
    assert tokenize("```python\n")[:3] == ["```", "python", "\n"]


def test_the_engine_answers_in_the_style() -> None:
    tokens, finish = synthetic_tokens("hi", seed=4, style="markdown")
    assert finish == "stop" and 270 <= len(tokens) <= 330
    assert "".join(tokens).startswith("# ")
    tokens, _ = synthetic_tokens("hi", seed=4, answer_tokens=4000, style="markdown")
    assert len(tokens) == 4000
