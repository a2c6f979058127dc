"""bench/production_day.py's bookkeeping: which fault a wait is counted after, how a stream's
ending is judged, and how many of the reference's tokens a cut text holds."""

from __future__ import annotations

import httpx
import numpy as np
import openai

from bench.production_day import Ask, Reading, Windows, delivered_tokens, error_name, judge
from firsttoken.client import StreamError

ASK = Ask("chat", 0, 5)


def reference(pieces: list[str]) -> Reading:
    r = Reading(ASK, "alice", pieces=list(pieces), text="".join(pieces))
    r.usage_tokens, r.chunks = len(pieces), len(pieces)
    return r


def windows(*marks: tuple[float, str]) -> Windows:
    w = Windows(after_s=10.0)
    w.marks.extend(marks)
    return w


def test_a_wait_is_outside_before_the_first_fault_and_after_its_window() -> None:
    w = windows((100.0, "reload"))
    assert w.of(50.0, 60.0) == "outside"
    assert w.of(111.0, 112.0) == "outside"
    assert w.of(100.0) == w.of(110.0) == "reload"


def test_a_wait_begun_in_a_faults_window_counts_after_that_fault_even_past_the_next() -> None:
    # A retry after a 503 of the SIGTERMed instance lands in the next fault's window: the
    # cause is the first fault.
    w = windows((10.0, "instance_term"), (15.0, "reload"))
    assert w.of(12.0, 17.5) == "instance_term"
    assert w.of(16.0, 17.0) == "reload"


def test_a_wait_begun_outside_counts_after_the_first_fault_during_it() -> None:
    w = windows((10.0, "redis_restart"), (15.0, "instance_kill"))
    assert w.of(5.0, 16.0) == "redis_restart"
    assert w.of(30.0, 40.0) == "outside"


def test_gaps_are_filed_as_each_would_be_alone() -> None:
    w = windows((10.0, "upstream_kill"), (12.0, "reload"), (40.0, "upstream_kill"))
    ends = np.array([5.0, 10.5, 13.0, 25.0, 23.0, 45.0, 60.0])
    gaps = np.array([0.02, 1.5, 0.5, 1.0, 12.0, 0.03, 0.04])
    filed = w.file(gaps, ends)
    for gap, end in zip(gaps, ends, strict=True):
        assert gap in filed[w.of(end - gap, end)]
    assert sorted(filed["outside"]) == [0.02, 0.04, 1.0]  # 24 to 25 s: after reload's window
    assert sorted(filed["upstream_kill"]) == [0.03, 1.5, 12.0]
    assert sorted(filed["reload"]) == [0.5]


def test_without_faults_every_gap_is_outside() -> None:
    filed = windows().file(np.array([0.1, 0.2]), np.array([1.0, 2.0]))
    assert list(filed) == ["outside"] and list(filed["outside"]) == [0.1, 0.2]


def test_endings_error_before_short_and_the_text_only_once_the_end_came() -> None:
    def reading(text: str, terminal: bool, error: str = "", hung: bool = False) -> Reading:
        return Reading(ASK, "alice", text=text, terminal=terminal, error=error, hung=hung)

    assert judge(reading("ab", True), "ab") == "exact"
    assert judge(reading("ax", True), "ab") == "wrong"
    assert judge(reading("a", False), "ab") == "short"
    assert judge(reading("a", False, error="openai.APIConnectionError"), "ab") == "error"
    assert judge(reading("a", False, hung=True), "ab") == "hung"


def test_delivered_tokens_count_the_reference_pieces_a_prefix_holds() -> None:
    ref = reference(["Hello", " wor", "ld", "!"])
    assert delivered_tokens("Hello wor", ref) == 2
    assert delivered_tokens("Hello world!", ref) == 4
    assert delivered_tokens("", ref) == 0
    assert delivered_tokens("Help", ref) is None  # not the reference's text: not counted


def test_delivered_tokens_unknown_when_the_reference_was_not_one_event_per_token() -> None:
    ref = reference(["Hello", " world"])
    ref.usage_tokens = 3
    assert delivered_tokens("Hello", ref) is None


def test_error_names_carry_the_package_the_type_and_the_code() -> None:
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    lost = StreamError("stream_lost", "gone", "")
    assert error_name(lost) == "firsttoken.StreamError stream_lost"
    assert error_name(openai.APIConnectionError(request=request)) == "openai.APIConnectionError"
    assert error_name(httpx.RemoteProtocolError("cut")) == "httpx.RemoteProtocolError"
