"""Errors before the first byte: what of a client's input they repeat, and how often they log."""

from __future__ import annotations

from firsttoken.formats.errors import MESSAGE_CHARS, APIError, RefusalLog, echo
from tests.unit.clock import FakeClock


def test_echo_quotes_short_values_whole_and_cuts_long_ones() -> None:
    assert echo("gpt-x") == "'gpt-x'"
    long = echo("m" * 1_000_000)
    assert len(long) == 201 and long.endswith("…") and long.startswith("'mmm")
    assert echo(None) == "None"


def test_a_message_has_a_ceiling_whatever_built_it() -> None:
    error = APIError(400, "invalid_value", "x" * 1_000_000)
    assert len(error.message) == MESSAGE_CHARS + 1 and error.message.endswith("…")


def test_refusal_lines_come_in_bursts_then_at_the_rate_and_count_the_rest() -> None:
    clock = FakeClock()
    log = RefusalLog(rate=10.0, burst=3, clock=clock)
    assert [log.take() for _ in range(3)] == [0, 0, 0]  # the burst: logged
    assert [log.take() for _ in range(5)] == [None] * 5  # not logged, counted
    clock.advance(0.1)  # one token back
    assert log.take() == 5  # logged, and says five were not
    assert log.take() is None
    clock.advance(10.0)  # refills to the burst, no further
    assert [log.take() for _ in range(4)] == [1, 0, 0, None]
