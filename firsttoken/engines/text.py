"""Text rules every engine shares: stop strings, and counting and splitting words where an
engine has no tokenizer of its own."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

__all__ = ["EXACT_CHARS", "StopCut", "apply_stop", "count_words", "estimate", "split_words"]

# Words and punctuation: near enough to a BPE count for usage and limits.
_COUNTED = re.compile(r"\w+|[^\w\s]", re.UNICODE)
# A word with the whitespace before it: joined back together, the pieces are the text.
_PIECE = re.compile(r"\s*\S+")


# Past this many characters a text's count is estimated from samples: counting all of a
# 1 MiB prompt holds the event loop for ~50 ms, and the count is only an estimate anyway.
EXACT_CHARS = 32 * 1024
_SAMPLES = 8
_SAMPLE_CHARS = EXACT_CHARS // _SAMPLES


def count_words(text: str) -> int:
    """Words and punctuation marks: exact up to `EXACT_CHARS`, estimated past it."""
    if len(text) <= EXACT_CHARS:
        return len(_COUNTED.findall(text))
    return estimate(text, lambda part: len(_COUNTED.findall(part)))


def estimate(text: str, count: Callable[[str], int]) -> int:
    """`count(text)` from `_SAMPLES` evenly spaced slices of `_SAMPLE_CHARS`: their density
    times the length, the same bounded work whatever the text's size."""
    size = len(text)
    if size <= EXACT_CHARS:
        return count(text)
    step = (size - _SAMPLE_CHARS) // (_SAMPLES - 1)
    counted = sum(count(text[i * step : i * step + _SAMPLE_CHARS]) for i in range(_SAMPLES))
    return round(counted * size / (_SAMPLE_CHARS * _SAMPLES))


def split_words(text: str) -> list[str]:
    """`text` as tokens that concatenate back to it (trailing whitespace aside)."""
    return _PIECE.findall(text)


def apply_stop(tokens: Sequence[str], stop: tuple[str, ...]) -> tuple[Sequence[str], bool]:
    """Cut the answer before the first stop string; the cut token keeps its prefix."""
    if not stop:
        return tokens, False
    cut = StopCut(tokens, stop)
    out = list(cut)
    return (out, True) if cut.stopped else (tokens, False)


class StopCut:
    """`apply_stop`, lazily: the tokens up to the first stop string, read from `tokens` only
    as far as that takes (an engine does not build an answer past its stop).

    A token is held back until no stop string can begin inside it any more, that is until
    the longest stop's length of text after it has been read: so the tokens passed on are
    exactly `apply_stop`'s, where the first stop string is the one that begins first.
    `stopped` says, once the tokens are all read, whether a stop string cut them."""

    __slots__ = ("_done", "_held", "_longest", "_out", "_stops", "_tokens", "_window", "stopped")

    def __init__(self, tokens: Iterable[str], stop: tuple[str, ...]) -> None:
        self._tokens = iter(tokens)
        self._stops = tuple(s for s in stop if s)
        self._longest = max(map(len, self._stops), default=0)
        self._held: deque[str] = deque()  # read, not yet passed on
        self._window = ""  # the held tokens' text
        self._out: deque[str] = deque()  # ready to pass on
        self._done = False
        self.stopped = False

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while not self._out:
            if self._done:
                raise StopIteration
            self._read()
        return self._out.popleft()

    def _read(self) -> None:
        token = next(self._tokens, None)
        held = self._held
        if token is not None:
            held.append(token)
            self._window += token
        window = self._window
        hits = [i for i in (window.find(s) for s in self._stops) if i >= 0]
        if hits:
            end = min(hits)
            # Final once a stop string that begins before `end` would have been read whole.
            if token is None or len(window) >= end + self._longest - 1:
                self._cut(end)
            return
        if token is None:
            self._out.extend(held)
            held.clear()
            self._done = True
            return
        # Pass on the tokens that no stop string can begin inside any more.
        while held and len(window) - len(held[0]) >= self._longest - 1:
            first = held.popleft()
            window = window[len(first) :]
            self._out.append(first)
        self._window = window

    def _cut(self, end: int) -> None:
        pos = 0
        for token in self._held:
            if pos + len(token) <= end:
                self._out.append(token)
                pos += len(token)
                continue
            if end > pos:
                self._out.append(token[: end - pos])
            break
        self._held.clear()
        self._window = ""
        self._done = True
        self.stopped = True
