"""OpenTelemetry export with the SDK's in-memory exporter and reader: the span of a stream and
its events, a client's trace continued, each upstream leg a child span whose context the
upstream gets, the GenAI metrics, and spans dropped while the collector is away counted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from firsttoken.core.stream import Outcome, Stream
from firsttoken.formats.render import ChatRenderer
from firsttoken.generation import EngineError, GenerationRequest
from firsttoken.routing.engine import RoutedEngine
from firsttoken.telemetry.otel import Telemetry, error_type
from tests.unit import virtual_loop
from tests.unit.clock import FakeClock
from tests.unit.scripted import ANSWER, Scripted, answer, cut, tokens
from tests.unit.test_routed_engine import chat, play, router

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
USER = {"role": "user", "content": "hi"}


def telemetry(
    exporter: SpanExporter | None = None, clock: FakeClock | None = None, **kw: Any
) -> tuple[Telemetry, InMemorySpanExporter, InMemoryMetricReader]:
    memory = InMemorySpanExporter()
    reader = InMemoryMetricReader()
    tel = Telemetry(
        None, span_exporter=exporter or memory, metric_reader=reader, clock=clock or FakeClock()
    )
    return tel, memory, reader


def stream(
    request_id: str = "s1",
    *,
    trace_id: str = TRACE,
    traceparent: str | None = None,
    linked: str | None = None,
    messages: bool = True,
    accepted_at: float = 1000.0,
) -> Stream:
    request = GenerationRequest(
        request_id=request_id,
        prompt="user: hi",
        model="synthetic",
        max_tokens=8,
        messages=(USER,) if messages else None,
        traceparent=traceparent,
        linked_traceparent=linked,
    )
    s = Stream(
        request,
        ChatRenderer("chatcmpl-1", "synthetic", 0, False),
        format="openai",
        trace_id=trace_id,
        grace_s=0,
        prompt_tokens=3,
        max_events=64,
        accepted_at=accepted_at,
    )
    return s


def traced(tel: Telemetry, s: Stream) -> Stream:
    """The stream wired as the registry wires it: started, then its callbacks."""
    s.on_first_token = tel.first_token
    s.on_end = tel.ended
    tel.started(s)
    s.begin()
    return s


def spans(tel: Telemetry, memory: InMemorySpanExporter) -> list[ReadableSpan]:
    tel.flush()
    return list(memory.get_finished_spans())


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Metric name -> its data points."""
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def event_names(span: ReadableSpan) -> list[str]:
    return [e.name for e in span.events]


# -- a stream's span -----------------------------------------------------------------------------


def test_a_stream_is_one_server_span_named_by_the_genai_conventions() -> None:
    tel, memory, _ = telemetry()
    s = traced(tel, stream())
    s.push("Hel")
    s.push("lo")
    s.push("!", "stop")
    [span] = spans(tel, memory)
    assert span.name == "chat synthetic"
    assert span.kind is SpanKind.SERVER
    attrs = dict(span.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "firsttoken"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "synthetic"
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.usage.input_tokens"] == 3
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",)
    assert attrs["firsttoken.outcome"] == "completed"
    assert attrs["firsttoken.stream_id"] == "s1"
    assert event_names(span) == ["admitted", "first_token", "end"]
    assert span.status.status_code is StatusCode.UNSET
    # The stream's own trace id (its X-Request-Id, its log lines') is the span's.
    assert span.context is not None and f"{span.context.trace_id:032x}" == TRACE
    assert span.parent is None


def test_the_span_starts_at_the_requests_first_byte() -> None:
    clock = FakeClock(1000.5)
    tel, memory, _ = telemetry(clock=clock)
    s = traced(tel, stream(accepted_at=1000.0))  # started half a second after it arrived
    s.push("a", "stop")
    [span] = spans(tel, memory)
    admitted = span.events[0].timestamp
    assert span.start_time is not None
    assert admitted - span.start_time == pytest.approx(500_000_000, abs=2_000_000)


def test_a_clients_traceparent_is_continued() -> None:
    tel, memory, _ = telemetry()
    other = "0af7651916cd43dd8448eb211c80319c"
    s = traced(tel, stream(trace_id=other, traceparent=f"00-{other}-{CLIENT_SPAN}-01"))
    s.push("a", "stop")
    [span] = spans(tel, memory)
    assert span.context is not None and f"{span.context.trace_id:032x}" == other
    assert span.parent is not None and f"{span.parent.span_id:016x}" == CLIENT_SPAN
    assert span.parent.is_remote


def test_a_client_that_does_not_sample_gets_no_span_and_no_drop() -> None:
    tel, memory, _ = telemetry()
    s = traced(tel, stream(traceparent=f"00-{TRACE}-{CLIENT_SPAN}-00"))
    s.push("a", "stop")
    assert spans(tel, memory) == []
    assert tel.dropped == 0


def test_a_client_trace_not_trusted_is_a_link_of_a_new_trace() -> None:
    # Issue 37.11: without --trust-trace-headers the gateway's own trace id goes with the
    # stream, and the client's context (unsampled here) is a link: it neither joins the
    # trace nor turns its export off.
    tel, memory, _ = telemetry()
    s = traced(tel, stream(linked=f"00-{'1' * 32}-{CLIENT_SPAN}-00"))
    s.push("a", "stop")
    [span] = spans(tel, memory)
    assert span.context is not None and f"{span.context.trace_id:032x}" == TRACE
    assert span.parent is None
    [link] = span.links
    assert f"{link.context.trace_id:032x}" == "1" * 32
    assert f"{link.context.span_id:016x}" == CLIENT_SPAN


def test_error_types_are_a_closed_set() -> None:
    # An upstream's own code string (any short identifier) became a metric value.
    assert error_type("upstream_timeout") == "upstream_timeout"
    assert error_type("upstream_503") == "upstream_503"
    assert error_type("upstream_999") == "_OTHER"
    assert error_type("my_secret_code_123") == "_OTHER"
    assert error_type("server_error") == "_OTHER"
    tel, memory, reader = telemetry()
    s = traced(tel, stream())
    s.fail(EngineError("tenant-acme.invoice-4711", "hi"))
    [span] = spans(tel, memory)
    assert (span.attributes or {})["error.type"] == "_OTHER"
    [duration] = points(reader)["gen_ai.server.request.duration"]
    assert duration.attributes["error.type"] == "_OTHER"


def test_a_request_id_that_is_no_trace_id_gets_a_random_trace() -> None:
    tel, memory, _ = telemetry()
    s = traced(tel, stream(trace_id="req-42"))
    s.push("a", "stop")
    [span] = spans(tel, memory)
    assert span.context is not None and span.context.trace_id != 0
    assert (span.attributes or {})["firsttoken.request_id"] == "req-42"
    # The next root span does not inherit an id meant for another stream.
    s2 = traced(tel, stream("s2"))
    s2.push("a", "stop")
    s3 = traced(tel, stream("s3", trace_id="req-43"))
    s3.push("a", "stop")
    ids = [sp.context.trace_id for sp in spans(tel, memory) if sp.context is not None]
    assert len(set(ids)) == 3


def test_a_bare_prompt_is_a_text_completion() -> None:
    tel, memory, _ = telemetry()
    s = traced(tel, stream(messages=False))
    s.push("a", "length")
    [span] = spans(tel, memory)
    assert span.name == "text_completion synthetic"
    assert (span.attributes or {})["gen_ai.response.finish_reasons"] == ("length",)


@pytest.mark.parametrize("outcome", [Outcome.CANCELLED, Outcome.DISCONNECTED])
def test_a_cancel_or_a_disconnect_is_an_event_not_an_error(outcome: Outcome) -> None:
    tel, memory, _ = telemetry()
    s = traced(tel, stream())
    s.push("a")
    s.stop(outcome)
    [span] = spans(tel, memory)
    assert event_names(span) == ["admitted", "first_token", outcome.value, "end"]
    assert span.status.status_code is StatusCode.UNSET
    assert (span.attributes or {})["firsttoken.outcome"] == outcome.value
    assert "gen_ai.response.finish_reasons" not in (span.attributes or {})


def test_an_engine_error_marks_the_span_and_the_duration() -> None:
    tel, memory, reader = telemetry()
    s = traced(tel, stream())
    s.fail(EngineError("upstream_unavailable", "no target"))
    [span] = spans(tel, memory)
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes or {})["error.type"] == "upstream_unavailable"
    assert event_names(span) == ["admitted", "end"]
    [duration] = points(reader)["gen_ai.server.request.duration"]
    assert duration.attributes["error.type"] == "upstream_unavailable"
    assert "gen_ai.server.time_to_first_token" not in points(reader)


# -- the server's metrics ------------------------------------------------------------------------


def test_server_metrics_one_record_each_per_stream() -> None:
    clock = FakeClock(1000.0)
    tel, _, reader = telemetry(clock=clock)
    s = stream(accepted_at=1000.0)
    tel.started(s)
    clock.advance(0.2)
    s.first_token_at = 1000.2
    tel.first_token(s, 0.2)
    clock.advance(1.0)  # 11 tokens: 10 after the first, in a second
    s.tokens_generated = 11
    s.finish_reason = "stop"
    s.outcome = Outcome.COMPLETED
    tel.ended(s)
    got = points(reader)
    [ttft] = got["gen_ai.server.time_to_first_token"]
    assert ttft.count == 1 and ttft.sum == pytest.approx(0.2)
    assert ttft.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "firsttoken",
        "gen_ai.request.model": "synthetic",
        "gen_ai.response.model": "synthetic",
    }
    [per_token] = got["gen_ai.server.time_per_output_token"]
    assert per_token.count == 1 and per_token.sum == pytest.approx(0.1)
    [duration] = got["gen_ai.server.request.duration"]
    assert duration.sum == pytest.approx(1.2)
    usage = {p.attributes["gen_ai.token.type"]: p.sum for p in got["gen_ai.client.token.usage"]}
    assert usage == {"input": 3, "output": 11}
    # The advised buckets (the conventions'), not the SDK's defaults.
    assert list(ttft.explicit_bounds)[:3] == [0.001, 0.005, 0.01]


# -- upstream legs -------------------------------------------------------------------------------


def test_each_upstream_leg_is_a_child_span_and_the_upstream_gets_its_context() -> None:
    tel, memory, reader = telemetry()
    a = Scripted([*tokens(3), cut()])
    b = Scripted(answer)
    engine = router({"a": a, "b": b})
    engine.observer = tel
    s = stream()
    tel.started(s)
    server = tel._live["s1"].span.get_span_context()
    out = virtual_loop.run(play(engine, chat()))
    assert out.error is None
    s.outcome = Outcome.COMPLETED
    tel.ended(s)
    finished = spans(tel, memory)
    legs = [sp for sp in finished if sp.kind is SpanKind.CLIENT]
    assert [sp.attributes["firsttoken.target"] for sp in legs] == ["a", "b"]  # type: ignore[index]
    for leg in legs:
        assert leg.name == "chat chat"  # the model the target is asked for: the route's
        assert leg.parent is not None and leg.parent.span_id == server.span_id
        assert leg.context is not None and leg.context.trace_id == server.trace_id
        assert (leg.attributes or {})["gen_ai.request.model"] == "chat"
        assert event_names(leg) == ["first_chunk"]
    cut_leg, whole_leg = legs
    assert cut_leg.status.status_code is StatusCode.ERROR
    assert (cut_leg.attributes or {})["error.type"] == "upstream_truncated"
    assert (cut_leg.attributes or {})["firsttoken.chunks"] == 3
    assert whole_leg.status.status_code is StatusCode.UNSET
    # Each upstream got its own leg's context, and the client's trace.
    for engine_, leg in ((a, cut_leg), (b, whole_leg)):
        assert leg.context is not None
        sent = engine_.requests[0].traceparent
        assert sent == f"00-{server.trace_id:032x}-{leg.context.span_id:016x}-01"
    # The router's events land on the stream's span.
    [server_span] = [sp for sp in finished if sp.kind is SpanKind.SERVER]
    names = event_names(server_span)
    assert "route.target_failed" in names and "route.splice" in names
    splice = next(e for e in server_span.events if e.name == "route.splice")
    assert dict(splice.attributes or {}) == {
        "route": "chat",
        "phase": "mid_stream",
        "from": "a",
        "to": "b",
        "at_token": 3,
    }
    # Client metrics: one first chunk per leg, one record per later chunk.
    got = points(reader)
    first = got["gen_ai.client.operation.time_to_first_chunk"]
    assert sum(p.count for p in first) == 2
    chunks = len([d for d in out.deltas if d.meta is None])
    later = got["gen_ai.client.operation.time_per_output_chunk"]
    assert sum(p.count for p in later) == chunks - 2
    assert {p.attributes["gen_ai.provider.name"] for p in first} == {"firsttoken"}
    durations = got["gen_ai.client.operation.duration"]
    assert {p.attributes.get("error.type") for p in durations} == {"upstream_truncated", None}


def test_a_leg_of_a_stream_without_a_span_passes_its_request_through() -> None:
    tel, memory, _ = telemetry()
    engine = router({"a": Scripted(answer)})
    engine.observer = tel
    request = chat()
    out = virtual_loop.run(play(engine, request))
    assert out.text == "".join(ANSWER)
    assert engine.targets["a"].engine.requests[0].traceparent is None  # type: ignore[attr-defined]
    assert spans(tel, memory) == []


def test_no_observer_no_traceparent_is_made_up() -> None:
    engine: RoutedEngine = router({"a": Scripted(answer)})
    virtual_loop.run(play(engine, chat()))
    assert engine.targets["a"].engine.requests[0].traceparent is None  # type: ignore[attr-defined]


# -- delivery ------------------------------------------------------------------------------------


class _Refusing(SpanExporter):
    """A collector that is away: every batch fails."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass


class _Stuck(SpanExporter):
    """A collector that does not answer until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def _finish(tel: Telemetry, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        s = traced(tel, stream(f"s{i}"))
        s.push("a", "stop")


def test_spans_a_collector_refuses_are_counted_as_dropped() -> None:
    tel, _, _ = telemetry(exporter=_Refusing())
    _finish(tel, 3)
    tel.flush()
    assert tel.dropped == 3
    [family] = list(tel.collect())
    assert family.name == "firsttoken_otel_dropped"
    assert family.samples[0].value == 3


def test_a_full_queue_drops_spans_and_counts_them_without_waiting() -> None:
    stuck = _Stuck()
    tel = Telemetry(
        None,
        span_exporter=stuck,
        metric_reader=InMemoryMetricReader(),
        max_queue_size=2,
        clock=FakeClock(),
    )
    _finish(tel, 2)  # a full batch: the export thread takes it and hangs on the collector
    assert stuck.entered.wait(10)
    _finish(tel, 4, start=2)  # two fill the queue, two more push the oldest out
    assert tel.dropped == 2
    stuck.release.set()
    tel.flush()
    assert stuck.exported == 4  # the hung batch and the queue's last two
    assert tel.dropped == 2


def test_close_gives_up_on_a_collector_that_does_not_answer() -> None:
    stuck = _Stuck()
    tel, _, _ = telemetry(exporter=stuck)
    _finish(tel, 1)
    try:
        assert asyncio.run(tel.close(timeout_s=0.2)) is False
    finally:
        stuck.release.set()


def test_close_flushes_what_is_pending() -> None:
    tel, memory, _ = telemetry()
    _finish(tel, 2)
    assert memory.get_finished_spans() == ()  # still in the batch queue
    assert asyncio.run(tel.close()) is True
    assert len(memory.get_finished_spans()) == 2
