"""Answers written in a style other than plain prose: Markdown, and hostile text that a page
must show as text. Deterministic: the caller's seeded generator decides everything."""

from __future__ import annotations

import random

__all__ = ["styled_answer"]


def styled_answer(style: str, rng: random.Random, target: int) -> tuple[str, ...]:
    """About `target` tokens in `style` ("markdown" or "hostile")."""
    if style == "hostile":
        piece = ["<img", " src=x", " onerror=alert(1)>", " <script>", "alert(2)", "</script>"]
    else:
        piece = ["# Title", "\n\n", "- one", "\n", "- **two**", "\n\n", "`code`", "\n\n"]
    tokens: list[str] = []
    while len(tokens) < target:
        tokens.extend(piece)
    return tuple(tokens[:target])
