"""The seam of a hand-off: when the edge's part ends, and how fast its text leaves.

The center must continue exactly the text the client will read, so it can only be asked once
the edge has stopped, and what the client would wait through at the seam is the center's delay
to its first token on the continuation. Three things hide it:

- the center starts at once: at the request's start it is asked for the conversation alone,
  one token, thrown away (`prefill_request`): that prefill warms its prefix cache, so that the
  continuation later pays only for the edge's few tokens, and its answer says when the center
  is ready;
- the edge writes faster than anyone reads, so part of its text is held back and let out at
  an even pace (`EdgePacer`): the text held is time in hand;
- the hand-off is timed (`Seam`): it happens at the first token boundary where the time in
  hand covers the center's expected delay, `after_tokens` being the latest point; a center
  that is ready before the edge has said much takes over at the next token boundary, and so
  does a ready center when the edge cannot get ahead of the pace (nothing to hold back).

After the hand-off the held text is spread over the center's expected delay, and what is left
when the center's first token comes leaves at once. The expected delay is learned per target
(`Target.prefill_s`, `Target.handoff_s`), as the hedge learns a target's first-token time.

Cost: per edge token a deque append and a few comparisons; nothing once the center's text
flows. The clock is passed in (the loop's time).
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import replace
from typing import Any

from firsttoken.generation import Delta, GenerationRequest

__all__ = ["EdgePacer", "Seam", "prefill_id", "prefill_request"]

_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class EdgePacer:
    """The edge's deltas on their way to the client, one text delta every `pace_s` at most.

    Every delta goes through in order; only text deltas are paced (a meta event or a bare
    finish leaves with the delta before it). The first delta leaves at once: the first token
    is the edge's, as fast as it comes."""

    __slots__ = ("_held", "_last", "_until", "pace_s", "released")

    def __init__(self, pace_s: float) -> None:
        self.pace_s = pace_s
        self._held: deque[Delta] = deque()
        self._last: float | None = None  # when the last text delta left
        self._until: float | None = None  # after the hand-off: the center's expected first token
        self.released = False  # the center's text has come (or the answer ended): no pacing

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, delta: Delta) -> None:
        self._held.append(delta)

    def next_at(self, now: float) -> float | None:
        """When the next held delta may leave (None: nothing is held)."""
        held = self._held
        if not held:
            return None
        if self.released or self._last is None or not held[0].text:
            return now
        interval = self.pace_s
        if self._until is not None:
            # Handed off: the held text spread evenly up to the center's expected first
            # token, never slower than the pace (a late center is waited through at it).
            texts = sum(1 for d in held if d.text)
            spread = (self._until - self._last) / (texts + 1)
            if 0 < spread < interval:
                interval = spread
        return self._last + interval

    def take(self, now: float) -> Delta:
        delta = self._held.popleft()
        if delta.text:
            self._last = now
        return delta

    def in_hand(self, now: float) -> float:
        """Seconds from `now` that the held text covers at the pace: a delta the center
        sends by then follows the last held one within one pace."""
        texts = sum(1 for d in self._held if d.text)
        if not texts:
            return 0.0
        first = now if self._last is None else max(now, self._last + self.pace_s)
        return first - now + texts * self.pace_s

    def handed_off(self, expected_at: float | None) -> None:
        self._until = expected_at

    def release(self) -> None:
        """What is held leaves at once, and nothing is held any more."""
        self.released = True


class Seam:
    """When the edge's part ends. `after_tokens` is the latest point (and with
    `at = "sentence"`, the first sentence end past it); before it, the edge hands off at
    the first token boundary (a sentence end with `at = "sentence"`) where the text in hand
    covers the time to the center's expected first token if it were asked now."""

    __slots__ = ("after_tokens", "expect_ready_at", "prefill", "ready_at", "sentence", "warm_s")

    def __init__(
        self,
        after_tokens: int,
        *,
        sentence: bool = False,
        prefill: bool = True,
        warm_s: float | None = None,
        expect_ready_at: float | None = None,
    ) -> None:
        self.after_tokens = after_tokens
        self.sentence = sentence
        self.prefill = prefill
        # The center's usual delay to a continuation's first token once it is ready (with a
        # prefill: its prefix cached; without: the whole prefill). None: not known yet.
        self.warm_s = warm_s
        self.expect_ready_at = expect_ready_at  # the prefill's answer, as its usual time says
        self.ready_at: float | None = None  # the prefill's answer came

    def ready(self, now: float) -> None:
        self.ready_at = now

    def expected_first(self, now: float) -> float | None:
        """When the center's first token would come if it were asked now (None: unknown)."""
        if not self.prefill:
            return None if self.warm_s is None else now + self.warm_s
        ready = self.ready_at if self.ready_at is not None else self.expect_ready_at
        if ready is None:
            return None
        # A center not ready yet answers once its prefill is done; one that is ready and
        # whose delay is not known yet is taken for fast (the next boundary hands off).
        return max(now, ready) + (self.warm_s or 0.0)

    def hands_off(
        self,
        now: float,
        text_tokens: int,
        in_hand: float,
        sentence_end: bool,
        *,
        edge_itl: float | None = None,
        pace_s: float = 0.0,
    ) -> bool:
        """Whether the edge's part ends at this token boundary. `edge_itl`: the edge's own
        time per token so far in this answer; `pace_s`: the pace (0: none)."""
        if self.sentence and not sentence_end:
            return False
        if text_tokens >= self.after_tokens:
            return True
        expected = self.expected_first(now)
        if expected is None:
            return False
        if now + in_hand >= expected:
            return True
        # A ready center, and an edge that cannot get ahead of the pace (or no pace): no
        # text will be held back to cover its delay, and each token more only lengthens
        # the prefix the center must read. It takes over now.
        return self.ready_at is not None and edge_itl is not None and edge_itl >= pace_s


def prefill_request(request: GenerationRequest) -> GenerationRequest:
    """The conversation alone, one token asked and thrown away: the center's prefill of the
    prompt, done while the edge writes (its prefix cache holds it for the continuation)."""
    body: dict[str, Any] | None = None
    if request.body is not None:
        body = dict(request.body)
        for key in _LIMITS:
            body.pop(key, None)
        body["max_tokens"] = 1
        body.pop("stream_options", None)
    return replace(
        request,
        request_id=prefill_id(request.request_id),
        max_tokens=1,
        body=body,
    )


def prefill_id(request_id: str) -> str:
    """The prefill's own request id: 32 hex digits, as the stream's (an upstream may insist
    on a UUID in `X-Request-Id`: llama-cpp-python's server answers anything else 400)."""
    return hashlib.blake2b(f"{request_id}\x00prefill".encode(), digest_size=16).hexdigest()
