"""The diag report's reading of a stream's event ids (`firsttoken/tools/_report.py`)."""

from __future__ import annotations

from firsttoken.tools._measure import Event, Kind, StreamResult
from firsttoken.tools._report import _ids


def _result(ids: list[str | None]) -> StreamResult:
    result = StreamResult("http://x/v1/streams", Kind.NATIVE, 0.0)
    result.events = [Event(0.0, "{}", None, i, 10) for i in ids]
    return result


def test_a_takeovers_ids_read_on_from_their_seq_not_as_a_gap() -> None:
    """After a takeover the new owner's ids are fence × 10¹² + seq (`formats.sse.ids_from`)."""
    ids = _ids(_result(["1", "2", "3", "2000000000004", None, "2000000000005"]))
    assert ids == {"seen": 5, "gaps": 0, "missing": 0, "out_of_order": 0}
    assert _ids(_result(["1", "3"]))["missing"] == 1
