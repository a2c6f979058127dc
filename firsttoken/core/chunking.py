"""The coalescer: tokens merged into chunks at natural boundaries, never held too long.

Pure and clock-free (the caller passes `now`), so its rules are property-tested on a fake
clock. Rules, in order:
- the first token of an answer leaves at once (coalescing must never cost TTFT);
- a chunk leaves when its text ends at a boundary (sentence end, punctuation, newline; Latin
  and CJK), when `max_wait_s` has passed since its oldest token arrived, or when the next
  token would take it over `max_bytes` (UTF-8);
- a single token over `max_bytes` is split at character boundaries, so UTF-8 is never cut.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BOUNDARIES", "Chunk", "CoalescePolicy", "Coalescer"]

BOUNDARIES = frozenset(".!?;:,\n)]…。！？；：，、）」』】")


@dataclass(frozen=True, slots=True)
class CoalescePolicy:
    max_wait_s: float = 0.050
    max_bytes: int = 1024
    boundaries: frozenset[str] = BOUNDARIES


@dataclass(frozen=True, slots=True)
class Chunk:
    text: str
    tokens: int


class Coalescer:
    def __init__(self, policy: CoalescePolicy) -> None:
        self.policy = policy
        self._parts: list[str] = []
        self._bytes = 0
        self._since = 0.0
        self._started = False

    @property
    def deadline(self) -> float | None:
        """When the pending chunk must leave, or None when nothing is pending."""
        return self._since + self.policy.max_wait_s if self._parts else None

    def push(self, text: str, now: float) -> list[Chunk]:
        out: list[Chunk] = []
        if not self._started:
            self._started = True
            out.extend(self._split(text))
            return out
        size = len(text.encode())
        if self._parts and self._bytes + size > self.policy.max_bytes:
            out.extend(self.flush())
        if size > self.policy.max_bytes:
            out.extend(self._split(text))
            return out
        if not self._parts:
            self._since = now
        self._parts.append(text)
        self._bytes += size
        if text and text[-1] in self.policy.boundaries:
            out.extend(self.flush())
        return out

    def due(self, now: float) -> list[Chunk]:
        deadline = self.deadline
        return self.flush() if deadline is not None and now >= deadline else []

    def flush(self) -> list[Chunk]:
        if not self._parts:
            return []
        chunk = Chunk("".join(self._parts), len(self._parts))
        self._parts, self._bytes = [], 0
        return [chunk]

    def _split(self, text: str) -> list[Chunk]:
        """One token as one chunk, or as several when it is over max_bytes."""
        limit = self.policy.max_bytes
        if len(text.encode()) <= limit:
            return [Chunk(text, 1)]
        pieces: list[str] = []
        current: list[str] = []
        size = 0
        for char in text:
            n = len(char.encode())
            if size + n > limit and current:
                pieces.append("".join(current))
                current, size = [], 0
            current.append(char)
            size += n
        pieces.append("".join(current))
        # The token counts once, on its last piece, so usage stays exact.
        return [Chunk(p, 0) for p in pieces[:-1]] + [Chunk(pieces[-1], 1)]
