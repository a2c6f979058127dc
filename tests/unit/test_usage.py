"""What an answer used (`core/usage.py`): the engine's count where it is one, the stream's
otherwise; a taken-over stream's count as the whole answer's."""

from __future__ import annotations

from firsttoken.core.usage import Usage, reported, usage_of, with_carried


def test_the_stream_reports_reasoning_details_only_when_it_counted_some() -> None:
    assert reported(5, 3, 0) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert reported(5, 3, 2)["completion_tokens_details"] == {"reasoning_tokens": 2}


def test_each_field_the_engine_did_not_count_is_the_streams() -> None:
    assert usage_of(None, 5, 3, 1) == Usage(5, 3, 1)
    counted = {
        "prompt_tokens": 7,
        "completion_tokens": True,  # not a count
        "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": -1},
    }
    assert usage_of(counted, 5, 3, 1) == Usage(7, 3, 1, cached=4, cache_write=0)


def test_a_taken_over_engines_count_adds_what_the_owners_before_generated() -> None:
    counted = {
        "prompt_tokens": 40,  # the continuation's prompt: the text sent before, re-read
        "completion_tokens": 6,
        "completion_tokens_details": {"reasoning_tokens": 1, "accepted_prediction_tokens": 0},
    }
    whole = with_carried(counted, Usage(prompt=9, completion=10, reasoning=2))
    assert whole["prompt_tokens"] == 9 and whole["completion_tokens"] == 16
    assert whole["total_tokens"] == 25
    assert whole["completion_tokens_details"] == {
        "reasoning_tokens": 3,
        "accepted_prediction_tokens": 0,
    }
