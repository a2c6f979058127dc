"""Text rules every engine shares: stop strings, and counting and splitting words where an
engine has no tokenizer of its own."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["apply_stop", "count_words", "split_words"]

# Words and punctuation: near enough to a BPE count for usage and limits.
_COUNTED = re.compile(r"\w+|[^\w\s]", re.UNICODE)
# A word with the whitespace before it: joined back together, the pieces are the text.
_PIECE = re.compile(r"\s*\S+")


def count_words(text: str) -> int:
    return len(_COUNTED.findall(text))


def split_words(text: str) -> list[str]:
    """`text` as tokens that concatenate back to it (trailing whitespace aside)."""
    return _PIECE.findall(text)


def apply_stop(tokens: Sequence[str], stop: tuple[str, ...]) -> tuple[Sequence[str], bool]:
    """Cut the answer before the first stop string; the cut token keeps its prefix."""
    if not stop:
        return tokens, False
    text = "".join(tokens)
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if not hits:
        return tokens, False
    end = min(hits)
    out: list[str] = []
    pos = 0
    for token in tokens:
        if pos + len(token) <= end:
            out.append(token)
            pos += len(token)
            continue
        if end > pos:
            out.append(token[: end - pos])
        break
    return out, True
