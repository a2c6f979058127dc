"""The SSE encoder: no text can end an event early or forge another (property tests)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firsttoken.formats import sse
from firsttoken.formats.sse import EventDecoder, ServerSentEvent, comment, encode_event


def reference_parse(stream: str) -> list[dict[str, str | None]]:
    """The WHATWG event-stream interpretation, written straight from the spec, independently
    of firsttoken's own decoder."""
    events: list[dict[str, str | None]] = []
    data, event_type, last_id = "", "", ""
    # Lines end at CRLF, LF or CR; a trailing partial line is discarded.
    lines = re.split(r"\r\n|\r|\n", stream)
    for line in lines[:-1]:
        if line == "":
            if data:
                events.append(
                    {"data": data[:-1], "event": event_type or None, "id": last_id or None}
                )
            data, event_type = "", ""
            continue
        if line.startswith(":"):
            continue
        if ":" in line:
            name, value = line.split(":", 1)
            if value.startswith(" "):
                value = value[1:]
        else:
            name, value = line, ""
        if name == "data":
            data += value + "\n"
        elif name == "event":
            event_type = value
        elif name == "id" and "\0" not in value:
            last_id = value
    return events


field_text = st.text(
    alphabet=st.characters(blacklist_characters="\r\n\0", blacklist_categories=("Cs",)), max_size=20
)
any_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
hostile = st.sampled_from(
    [
        "\n\ndata: [DONE]\n\n",
        "\r",
        "\r\n",
        "\n",
        "\0",
        "event: error\n",
        "id: 99\n\n",
        ": ping\n\n",
        "data:",
        "\u2028",
        "🚀",
        "한국어",
    ]
)
payloads = st.lists(st.one_of(any_text, hostile), max_size=6).map("".join)


@settings(max_examples=400, deadline=None)
@given(
    events=st.lists(
        st.tuples(payloads, st.none() | field_text, st.none() | field_text), min_size=1, max_size=8
    )
)
def test_round_trip_through_independent_parser(
    events: list[tuple[str, str | None, str | None]],
) -> None:
    wire = b"".join(
        ServerSentEvent(data=data, event=name, id=eid).encode() for data, name, eid in events
    )
    parsed = reference_parse(wire.decode())
    assert len(parsed) == len(events)
    last_id: str | None = None
    for got, (data, name, eid) in zip(parsed, events, strict=True):
        last_id = eid if eid is not None else last_id
        # Line breaks of any kind come back as LF: that is the spec's normalisation.
        assert got["data"] == re.sub(r"\r\n|\r", "\n", data)
        assert got["event"] == (name or None)
        assert got["id"] == (last_id or None)


@settings(max_examples=200, deadline=None)
@given(data=payloads, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10))
def test_library_decoder_agrees_on_any_chunking(data: str, cuts: list[int]) -> None:
    wire = ServerSentEvent(data=data, id="7").encode() + encode_event(8, b'{"token":"x"}')
    decoder = EventDecoder()
    out = []
    prev = 0
    for cut in sorted(c for c in cuts if c < len(wire)):
        out += decoder.feed(wire[prev:cut])
        prev = cut
    out += decoder.feed(wire[prev:])
    expected = reference_parse(wire.decode())
    assert [(e.data, e.id) for e in out] == [(e["data"], e["id"]) for e in expected]
    assert decoder.last_event_id == "8"


@pytest.mark.parametrize("field", ["id", "event"])
@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\0b"])
def test_line_breaks_never_allowed_in_id_or_event(field: str, bad: str) -> None:
    with pytest.raises(ValueError):
        ServerSentEvent(data="x", **{field: bad}).encode()


def test_exact_framing() -> None:
    assert ServerSentEvent(data="a\r\nb\rc\nd", event="meta", id="3", retry=1000).encode() == (
        b"id: 3\nevent: meta\nretry: 1000\ndata: a\ndata: b\ndata: c\ndata: d\n\n"
    )
    assert encode_event(5, b'{"token":"hi"}') == b'id: 5\ndata: {"token":"hi"}\n\n'
    # The fast path must fall back to full framing when the payload has a line break.
    assert encode_event(6, b"x\ny") == b"id: 6\ndata: x\ndata: y\n\n"
    assert comment("ping") == b": ping\n\n"
    assert ServerSentEvent(data="").encode() == b"data: \n\n"


def test_decoder_ignores_a_retry_that_is_not_ascii_digits() -> None:
    # '²' passes str.isdigit() and int() refuses it; 5,000 digits pass too and exceed int's
    # limit: an upstream's garbage `retry:` must not raise in the relay's read path.
    for bad in ("²", "1²", "9" * 5000, ""):
        decoder = EventDecoder()
        events = decoder.feed(f"retry: {bad}\ndata: x\n\n".encode())
        assert [e.data for e in events] == ["x"] and decoder.retry is None
    decoder = EventDecoder()
    decoder.feed(b"retry: 2500\ndata: x\n\n")
    assert decoder.retry == 2500


def test_a_token_frame_takes_its_seq_and_text_and_escapes_percent_signs() -> None:
    frame = sse.token_frame(None, b'{"p":"100%","t":', b"}")
    assert frame % (7, b'"hi"') == b'id: 7\ndata: {"p":"100%","t":"hi"}\n\n'
    named = sse.token_frame("delta", b"[", b"]")
    assert named % (1, b"x") == b"id: 1\nevent: delta\ndata: [x]\n\n"
    assert sse.DATA_FRAME % (2, b"{}") == sse.encode_event(2, b"{}")


def test_an_events_name_and_data_read_back_from_its_frame() -> None:
    assert sse.event_payload(sse.encode_event(3, b'{"a":1}', "error")) == ("error", b'{"a":1}')
    assert sse.event_payload(sse.encode_event(4, b"[DONE]")) == (None, b"[DONE]")


def test_response_headers_and_the_send_stamp() -> None:
    headers = sse.response_headers("s1", "t1", {"X-Resume-Token": "r"})
    assert headers[: len(sse.SSE_HEADERS)] == list(sse.SSE_HEADERS)
    assert headers[len(sse.SSE_HEADERS) :] == [
        (b"x-stream-id", b"s1"),
        (b"x-request-id", b"t1"),
        (b"x-resume-token", b"r"),
    ]
    assert sse.stamp(1.5) == b": t=1.500000\n"


def test_a_takeover_owners_ids_name_their_owner_and_read_back_as_their_seq() -> None:
    base = sse.ids_from(2)
    assert sse.ids_from(1) == 0 and base == 2 * sse.OWNER_IDS
    framed = sse.token_frame(None, b'{"token":', b"}", base) % (57, b'"hi"')
    assert framed == b'id: 2000000000057\ndata: {"token":"hi"}\n\n'
    assert sse.event_id_of(framed) == base + 57 and sse.owner_of_id(base + 57) == (2, 57)
    assert sse.token_frame("delta", b"", b"") % (3, b"x") == b"id: 3\nevent: delta\ndata: x\n\n"
    assert sse.owner_of_id(57) == (1, 57) and sse.event_id_of(b": ping\n\n") is None
    assert sse.event_id_of(encode_event(12, b"{}", "meta")) == 12
