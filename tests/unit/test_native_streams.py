"""The native read's answer for a stream whose log is closed (`api/native/streams.py`): 204
"all delivered" only when the log's close is the stream's end."""

from __future__ import annotations

from firsttoken.api.native.streams import _ended
from firsttoken.core.mirror import Mirror
from firsttoken.core.stream import Stream
from firsttoken.engines import GenerationRequest
from firsttoken.formats.render import NativeRenderer
from firsttoken.resume import StreamRecord


def _stream() -> Stream:
    return Stream(
        GenerationRequest(request_id="s1", prompt="hi", model="synthetic"),
        NativeRenderer(),
        format="native",
        trace_id="t",
        grace_s=0.0,
        prompt_tokens=1,
        max_events=16,
        accepted_at=0.0,
    )


def test_a_finished_stream_s_closed_log_is_its_end() -> None:
    stream = _stream()
    stream.begin()
    stream.push("a", "stop")
    assert stream.log.closed and _ended(stream)


def test_a_handed_over_stream_s_closed_log_is_not_its_end() -> None:
    stream = _stream()
    stream.begin()
    stream.push("a")
    stream.move()
    assert stream.log.closed and not _ended(stream)


def test_a_mirror_s_closed_log_is_its_end_only_when_the_store_said_so() -> None:
    mirror = Mirror(StreamRecord("s1", "native", "d", "t", "synthetic"), max_events=16)
    mirror.log.close()
    assert not _ended(mirror)
    mirror.ended_there = True
    assert _ended(mirror)
