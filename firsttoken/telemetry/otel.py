"""OpenTelemetry export (`--otlp-endpoint`): every stream a trace, GenAI metrics on both legs.

One span per stream (`{operation} {model}`, kind SERVER), continued from the client's
`traceparent`, with events for what happened to it (admitted, first token, each failover,
splice or hand-off, cancel or disconnect, end); one child span per upstream leg (kind CLIENT),
whose context the upstream gets as its `traceparent`. Metrics in the GenAI semantic
conventions' names: the server's time to first token, time per output token and request
duration, the tokens used, and on each upstream leg its time to first chunk, time per chunk
and duration. The difference of the two first-token times is the gateway's own overhead.

The cost stays per stream: a span opens at the start and closes at the end, and nothing runs
per token (`core/stream.py` is untouched; its hooks are the registry's first-token and end
callbacks). Per upstream chunk there is one histogram record. Export never waits on the
collector: ended spans go to the SDK's batch processor, a bounded queue a thread drains;
spans it drops (queue full, or a batch the collector did not take) are counted in
`firsttoken_otel_dropped_total`. The app's shutdown flushes what is pending, for at most
`FLUSH_TIMEOUT_S`.

This module imports the SDK; the app imports it only when `--otlp-endpoint` is set.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from prometheus_client.core import CounterMetricFamily, Metric

from firsttoken.core.stream import Outcome, Stream
from firsttoken.generation import EngineError, GenerationRequest
from firsttoken.routing.config import TargetConfig
from firsttoken.telemetry.log import log_event
from firsttoken.version import __version__

__all__ = ["ERROR_TYPES", "FLUSH_TIMEOUT_S", "Telemetry", "error_type"]

FLUSH_TIMEOUT_S = 5.0  # the longest a shutdown waits for the collector
# A batch the collector does not take in this long is dropped (and counted); the SDK's
# default of 10 s would hold a shutdown that long when the collector is away.
EXPORT_TIMEOUT_S = 5.0

# Bucket boundaries the GenAI conventions advise for each histogram.
_TTFT_BUCKETS: tuple[float, ...]
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5)
_TTFT_BUCKETS += (7.5, 10)
_PER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))  # 0.01 to 81.92 s
_TOKEN_BUCKETS = tuple(4**i for i in range(14))  # 1 to 67,108,864

# gen_ai.provider.name of each target kind (the conventions' values where one exists).
_PROVIDERS = {"openai": "openai", "anthropic": "anthropic", "llamacpp": "llama.cpp"}
SELF = "firsttoken"  # the provider of what this gateway serves, and of its own engines

_HEX = frozenset("0123456789abcdef")


class _StreamIds(RandomIdGenerator):
    """Random ids, except a root span's trace id: the stream's own (its X-Request-Id and the
    `trace_id` of its log lines), handed over for the one `start_span` call that needs it."""

    def __init__(self) -> None:
        self.next_trace_id = 0

    def generate_trace_id(self) -> int:
        given, self.next_trace_id = self.next_trace_id, 0
        return given or super().generate_trace_id()


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting the spans of every batch the collector did not take, and
    saying so once per outage (the SDK's own log lines are silenced: one per batch)."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.dropped = 0
        self.failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            if self.failing:
                self.failing = False
                log_event("otel.export_recovered")
            return result
        self.dropped += len(spans)  # one thread exports: no lock needed
        if not self.failing:
            self.failing = True
            log_event("otel.export_failed", logging.WARNING, spans=len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _Batch(BatchSpanProcessor):
    """The SDK's batch processor (bounded queue, one export thread), counting the spans it
    drops when the queue is full (a slow or absent collector)."""

    def __init__(self, exporter: SpanExporter, max_queue_size: int | None = None) -> None:
        batch = None if max_queue_size is None else min(512, max_queue_size)
        super().__init__(exporter, max_queue_size=max_queue_size, max_export_batch_size=batch)
        # The SDK's queue, a deque with a maxlen that drops the oldest span when full.
        self._queue = getattr(self._batch_processor, "_queue", None)
        self.full_drops = 0

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        if queue is not None and len(queue) == queue.maxlen:
            context = span.context
            if context is not None and context.trace_flags.sampled:
                self.full_drops += 1
        super().on_end(span)


class _Trace:
    """A live stream's span, the context its legs start in, and its metric attributes."""

    __slots__ = ("attrs", "context", "operation", "span")

    def __init__(self, span: trace.Span, operation: str, attrs: dict[str, str]) -> None:
        self.span = span
        self.context = trace.set_span_in_context(span, Context())
        self.operation = operation
        self.attrs = attrs


class _Leg:
    """One upstream leg's span and its client metrics (the route's `LegWatch`)."""

    __slots__ = ("attrs", "chunks", "last", "owner", "span", "started")

    def __init__(self, owner: Telemetry, span: trace.Span, attrs: dict[str, str], now: float):
        self.owner = owner
        self.span = span
        self.attrs = attrs
        self.started = now
        self.last = 0.0
        self.chunks = 0

    def chunk(self, now: float) -> None:
        owner = self.owner
        if self.chunks:
            owner.time_per_chunk.record(now - self.last, self.attrs)
        else:
            owner.time_to_first_chunk.record(now - self.started, self.attrs)
            self.span.add_event("first_chunk")
        self.chunks += 1
        self.last = now

    def end(self, failure: BaseException | None) -> None:
        span = self.span
        span.set_attribute("firsttoken.chunks", self.chunks)
        attrs = self.attrs
        if isinstance(failure, EngineError):
            kind = error_type(failure.code)
            attrs = {**attrs, "error.type": kind}
            span.set_attribute("error.type", kind)
            span.set_status(Status(StatusCode.ERROR, kind))
        elif failure is not None:
            # The router closed the leg (a hand-off, a cancelled stream): no fault of it.
            span.set_attribute("firsttoken.leg_closed", type(failure).__name__)
        self.owner.client_duration.record(self.owner.loop_clock() - self.started, attrs)
        span.end()


class Telemetry:
    """The SDK's tracer and meter providers with OTLP/HTTP exporters, fed by the registry
    (`StreamTracer`) and the routes (`RouteObserver`); `firsttoken_otel_dropped_total` for
    /metrics. Tests hand it an in-memory exporter and reader instead."""

    def __init__(
        self,
        endpoint: str | None,
        *,
        span_exporter: SpanExporter | None = None,
        metric_reader: MetricReader | None = None,
        max_queue_size: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        loop_clock: Callable[[], float] = lambda: asyncio.get_running_loop().time(),
    ) -> None:
        base = (endpoint or "").rstrip("/")
        self.endpoint = base
        resource = Resource.create(
            {"service.version": __version__}
            | ({} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SELF})
        )
        if span_exporter is None:
            span_exporter = OTLPSpanExporter(
                endpoint=base + "/v1/traces", timeout=_export_timeout("TRACES")
            )
        if metric_reader is None:
            metric_reader = PeriodicExportingMetricReader(
                OTLPMetricExporter(
                    endpoint=base + "/v1/metrics", timeout=_export_timeout("METRICS")
                )
            )
        self._exporter = _CountingExporter(span_exporter)
        self._batch = _Batch(self._exporter, max_queue_size)
        self._ids = _StreamIds()
        # No atexit hooks: the app's shutdown flushes, bounded; the SDK's would wait 30 s.
        self.tracer_provider = TracerProvider(
            resource=resource, id_generator=self._ids, shutdown_on_exit=False
        )
        self.tracer_provider.add_span_processor(self._batch)
        self.meter_provider = MeterProvider(
            resource=resource, metric_readers=[metric_reader], shutdown_on_exit=False
        )
        self.tracer = self.tracer_provider.get_tracer("firsttoken", __version__)
        self._measures(self.meter_provider.get_meter("firsttoken", __version__))
        self.clock = clock  # the streams' clock (perf_counter): accepted_at, first_token_at
        self.loop_clock = loop_clock  # the legs' clock: the loop's time
        self._live: dict[str, _Trace] = {}
        self._attrs: dict[tuple[str, str], dict[str, str]] = {}
        self._legs: dict[tuple[str, str], dict[str, str]] = {}
        self._addresses: dict[str, dict[str, Any]] = {}
        # One line per outage from our exporter instead of one per batch from the SDK's.
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)

    def _measures(self, meter: Meter) -> None:
        """The GenAI semantic conventions' histograms, with their bucket advice."""

        def histogram(name: str, unit: str, description: str, buckets: Sequence[float]) -> Any:
            return meter.create_histogram(
                name, unit, description, explicit_bucket_boundaries_advisory=buckets
            )

        # The server's measures, one record each per stream ...
        self.ttft = histogram(
            "gen_ai.server.time_to_first_token", "s", "Time to the first token", _TTFT_BUCKETS
        )
        self.time_per_token = histogram(
            "gen_ai.server.time_per_output_token",
            "s",
            "Time per output token after the first (a stream's mean)",
            _PER_TOKEN_BUCKETS,
        )
        self.duration = histogram(
            "gen_ai.server.request.duration", "s", "Request duration", _DURATION_BUCKETS
        )
        self.token_usage = histogram(
            "gen_ai.client.token.usage", "{token}", "Input and output tokens", _TOKEN_BUCKETS
        )
        # ... and each upstream leg's, as its client (one record per chunk after the first).
        self.time_to_first_chunk = histogram(
            "gen_ai.client.operation.time_to_first_chunk",
            "s",
            "Time to the upstream's first chunk",
            _TTFT_BUCKETS,
        )
        self.time_per_chunk = histogram(
            "gen_ai.client.operation.time_per_output_chunk",
            "s",
            "Time from the upstream's previous chunk to this one",
            _PER_TOKEN_BUCKETS,
        )
        self.client_duration = histogram(
            "gen_ai.client.operation.duration", "s", "Upstream leg duration", _DURATION_BUCKETS
        )

    # -- the registry's hooks (StreamTracer) --------------------------------------------------

    def started(self, stream: Stream) -> None:
        request = stream.request
        # A conversation is a chat; a bare prompt (/v1/completions, native streams) is not.
        operation = "chat" if request.messages is not None else "text_completion"
        model = request.model
        context = _parent(request.traceparent)
        if context is None:
            context = Context()
            self._ids.next_trace_id = _trace_id(stream.trace_id)
        # A client's trace context not trusted as the parent: a link, which joins nothing.
        linked = _span_context(request.linked_traceparent)
        links = [Link(linked)] if linked is not None else None
        now_ns = time.time_ns()
        start_ns = now_ns - int((self.clock() - stream.accepted_at) * 1e9)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": SELF,
            "gen_ai.request.model": model,
            "firsttoken.stream_id": stream.id,
            "firsttoken.request_id": stream.trace_id,
            "firsttoken.api": stream.format,
        }
        if request.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = request.max_tokens
        span = self.tracer.start_span(
            f"{operation} {model}",
            context,
            SpanKind.SERVER,
            attributes,
            links,
            start_time=min(start_ns, now_ns),
        )
        self._ids.next_trace_id = 0
        span.add_event("admitted", timestamp=now_ns)
        self._live[stream.id] = _Trace(span, operation, self._metric_attrs(operation, model))

    def first_token(self, stream: Stream, ttft_s: float) -> None:
        live = self._live.get(stream.id)
        if live is None:
            return
        live.span.add_event("first_token", {"ttft_ms": round(ttft_s * 1000, 3)})
        self.ttft.record(ttft_s, live.attrs)

    def ended(self, stream: Stream) -> None:
        live = self._live.pop(stream.id, None)
        if live is None:
            return
        outcome = stream.outcome
        assert outcome is not None
        now = self.clock()
        span = live.span
        attrs = live.attrs
        span.set_attribute("gen_ai.response.model", stream.request.model)
        span.set_attribute("gen_ai.usage.input_tokens", stream.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", stream.tokens_generated)
        span.set_attribute("firsttoken.outcome", outcome.value)
        if stream.finish_reason is not None:
            span.set_attribute("gen_ai.response.finish_reasons", (stream.finish_reason,))
        if outcome is Outcome.CANCELLED or outcome is Outcome.DISCONNECTED:
            span.add_event(outcome.value, {"firsttoken.tokens": stream.tokens_generated})
        elif outcome is Outcome.ERROR:
            code = error_type(stream.error_code or "error")
            attrs = {**attrs, "error.type": code}
            span.set_attribute("error.type", code)
            span.set_status(Status(StatusCode.ERROR, code))
        span.add_event("end", {"firsttoken.outcome": outcome.value})
        span.end()
        self.duration.record(now - stream.accepted_at, attrs)
        first = stream.first_token_at
        tokens = stream.tokens_generated
        if outcome is Outcome.COMPLETED and first is not None and tokens > 1:
            # One record per stream: the answer's mean time per token after the first.
            self.time_per_token.record((now - first) / (tokens - 1), attrs)
        self.token_usage.record(stream.prompt_tokens, {**attrs, "gen_ai.token.type": "input"})
        self.token_usage.record(tokens, {**attrs, "gen_ai.token.type": "output"})

    # -- the routes' hooks (RouteObserver) ----------------------------------------------------

    def leg(
        self, request: GenerationRequest, target: TargetConfig, model: str, now: float
    ) -> tuple[GenerationRequest, _Leg | None]:
        live = self._live.get(request.request_id)
        if live is None:
            return request, None
        provider = _PROVIDERS.get(target.kind, SELF)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": live.operation,
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "firsttoken.target": target.name,
            **self._address(target),
        }
        span = self.tracer.start_span(
            f"{live.operation} {model}", live.context, SpanKind.CLIENT, attributes
        )
        context = span.get_span_context()
        if context.is_valid:
            request = replace(request, traceparent=_traceparent(context))
        key = (target.name, model)
        attrs = self._legs.get(key)
        if attrs is None:
            attrs = self._legs[key] = {
                "gen_ai.operation.name": live.operation,
                "gen_ai.provider.name": provider,
                "gen_ai.request.model": model,
                **self._address(target),
            }
        return request, _Leg(self, span, attrs, now)

    def event(self, event: str, fields: Mapping[str, Any]) -> None:
        stream_id = fields.get("stream")
        live = self._live.get(stream_id) if isinstance(stream_id, str) else None
        if live is None:
            return
        attributes = {
            k: v if isinstance(v, (str, bool, int, float)) else str(v)
            for k, v in fields.items()
            if k != "stream" and v is not None
        }
        live.span.add_event(event, attributes)

    # -- export ---------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        return self._exporter.dropped + self._batch.full_drops

    def collect(self) -> Iterator[Metric]:
        dropped = CounterMetricFamily(
            "firsttoken_otel_dropped",
            "Spans not exported: the export queue was full, or the collector did not take them.",
        )
        dropped.add_metric([], self.dropped)
        yield dropped

    def flush(self) -> None:
        """Export what is pending now, in this thread (tests)."""
        self.tracer_provider.force_flush()
        self.meter_provider.force_flush()

    async def close(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Flush what is pending and stop the export threads, waiting at most `timeout_s`
        (a collector that is away must not hold a shutdown). True if it all went out."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def shut() -> None:
            try:
                self.tracer_provider.shutdown()
                self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
            finally:
                try:
                    loop.call_soon_threadsafe(_settle, done)
                except RuntimeError:  # the loop is gone: nobody waits any more
                    pass

        # A daemon thread: one still stuck on the collector does not keep the process alive.
        threading.Thread(target=shut, name="firsttoken-otel-flush", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except TimeoutError:
            log_event("otel.flush_timeout", logging.WARNING, timeout_s=timeout_s)
            return False
        return True

    # -- helpers ----------------------------------------------------------------------------

    def _metric_attrs(self, operation: str, model: str) -> dict[str, str]:
        key = (operation, model)
        attrs = self._attrs.get(key)
        if attrs is None:
            attrs = self._attrs[key] = {
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": SELF,
                "gen_ai.request.model": model,
                "gen_ai.response.model": model,
            }
        return attrs

    def _address(self, target: TargetConfig) -> dict[str, Any]:
        address = self._addresses.get(target.name)
        if address is None:
            address = {}
            if target.url:
                parts = urlsplit(target.url)
                if parts.hostname:
                    address["server.address"] = parts.hostname
                    address["server.port"] = parts.port or (443 if parts.scheme == "https" else 80)
            self._addresses[target.name] = address
        return address


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def _export_timeout(signal: str) -> float | None:
    """The SDK reads OTEL_EXPORTER_OTLP_[SIGNAL_]TIMEOUT itself when one is set."""
    for name in (f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        if os.environ.get(name):
            return None
    return EXPORT_TIMEOUT_S


def _span_context(traceparent: str | None) -> SpanContext | None:
    """A traceparent's span (the gateway validated the header's form)."""
    if traceparent is None:
        return None
    _version, trace_id, span_id, flags = traceparent.split("-")[:4]
    return SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16))
    )


def _parent(traceparent: str | None) -> Context | None:
    """The client's span as the parent context (only with --trust-trace-headers)."""
    parent = _span_context(traceparent)
    if parent is None:
        return None
    return trace.set_span_in_context(NonRecordingSpan(parent), Context())


# `error.type` on spans and metrics: a closed set, as the conventions ask of a metric's
# attribute. An upstream's own code strings (any `[A-Za-z0-9_.:-]{1,64}`) are the client's
# to read in the error body; here they are `_OTHER`.
ERROR_TYPES = frozenset(
    (
        "error",
        "cancelled",
        "context_length_exceeded",
        "engine_error",
        "engine_unavailable",
        "internal_error",
        "invalid_continuation",
        "invalid_value",
        "overloaded",
        "queue_timeout",
        "rate_limit_exceeded",
        "response_too_large",
        "resume_expired",
        "server_shutdown",
        "stopped",
        "stream_abandoned",
        "stream_lost",
        "unsupported_for_target",
        "upstream_bad_response",
        "upstream_error",
        "upstream_rejected",
        "upstream_timeout",
        "upstream_truncated",
        "upstream_unavailable",
    )
)
_STATUS_TYPE = re.compile(r"^upstream_[45][0-9][0-9]$")


def error_type(code: str) -> str:
    """A stream's or leg's error code as `error.type`: ours and `upstream_<4xx|5xx>` as they
    are, anything else `_OTHER`."""
    if code in ERROR_TYPES or _STATUS_TYPE.match(code):
        return code
    return "_OTHER"


def _trace_id(given: str) -> int:
    """The stream's trace id as a span's, when it is one (32 hex digits, not all zeros): a
    made-up id or a traceparent's; an X-Request-Id of another form gets a random one."""
    if len(given) == 32 and _HEX.issuperset(given):
        return int(given, 16)
    return 0


def _traceparent(context: SpanContext) -> str:
    """Version 00 with the sampled flag only: the SDK's level-2 `random` flag would claim an
    id chosen by a client (X-Request-Id, a traceparent) was random."""
    flags = int(context.trace_flags) & 1
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"
