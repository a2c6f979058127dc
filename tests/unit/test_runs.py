"""Runs (`firsttoken/resume/runs.py`): a stream's events of one flush in one entry, and back."""

from __future__ import annotations

from firsttoken.resume.runs import decode_run, encode_run, run_first


def fields_of(first: int, wires: list[bytes], counts: dict[int, int]) -> dict[bytes, bytes]:
    """As Redis hands an entry's fields back: names and values as bytes."""
    out = {}
    for name, value in encode_run(first, wires, counts).items():
        out[name.encode()] = value if isinstance(value, bytes) else str(value).encode()
    return out


def test_a_run_splits_back_into_its_events_with_their_counts() -> None:
    wires = [b"id: 7\ndata: a\n\n", b"", b"id: 9\ndata: \xc3\xa9t\xc3\xa9\n\n", b"x" * 70_000]
    fields = fields_of(7, wires, {8: 0, 10: 3})
    assert run_first(fields) == 7
    assert list(decode_run(fields)) == [
        (7, wires[0], 1),
        (8, b"", 0),
        (9, wires[2], 1),
        (10, wires[3], 3),
    ]


def test_counts_of_one_are_not_written() -> None:
    assert "t" not in encode_run(1, [b"a", b"b"], {})
    assert len(encode_run(1, [b"a", b"b"], {2: 5})["t"]) == 8  # one (offset, tokens) pair


def test_a_reader_takes_only_the_events_after_its_own() -> None:
    fields = fields_of(3, [b"c", b"d", b"e", b"f"], {5: 2})
    assert list(decode_run(fields, after=4)) == [(5, b"e", 2), (6, b"f", 1)]
    assert list(decode_run(fields, after=2)) == list(decode_run(fields))
    assert list(decode_run(fields, after=6)) == []
    assert list(decode_run(fields, after=100)) == []
