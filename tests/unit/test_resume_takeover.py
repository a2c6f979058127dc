"""What a claimed stream's entries give its new owner (`firsttoken/resume/takeover.py`): every
event from its first, or nothing when one is missing. The claim itself runs against a real
Redis in tests/system/test_takeover*.py and test_orphan_billing.py."""

from __future__ import annotations

from firsttoken.resume.takeover import held_events
from tests.unit.test_resume_sweeper import entry


def test_a_claim_goes_on_from_every_event_redis_holds_resent_runs_once() -> None:
    entries = [entry(1, 3), entry(1, 5, {4: 3}), entry(6, 1)]
    events = held_events(entries)
    assert events is not None
    assert [seq for seq, _, _ in events] == [1, 2, 3, 4, 5, 6]
    assert events[3] == (4, b"e4", 3)  # the resent run adds only what is new


def test_a_claim_has_nothing_to_go_on_from_a_stream_whose_start_is_gone() -> None:
    assert held_events([entry(4, 3)]) is None  # trimmed: no text to go on from
    assert held_events([entry(1, 2), entry(5, 1)]) is None  # a hole: lost
    assert held_events([entry(1, 2), (b"2-1", {b"end": b"completed"})]) is not None
