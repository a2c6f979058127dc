"""A real OTLP/HTTP receiver on loopback: takes what `--otlp-endpoint` sends to /v1/traces
and /v1/metrics and decodes the protobuf with opentelemetry-proto, as a collector would.

It can be slow (`delay_s` before each answer) or refuse (`status`), for the tests and the
benchmark of a collector that is slow or away.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

__all__ = ["Collector", "ReceivedSpan", "attributes", "run_collector"]


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def attributes(kvs: Any) -> dict[str, Any]:
    """A protobuf attribute list as a dict."""
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    """One span as the collector got it, with its resource's attributes."""

    span: Span
    resource: dict[str, Any]

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attributes(self) -> dict[str, Any]:
        return attributes(self.span.attributes)

    @property
    def events(self) -> list[tuple[str, dict[str, Any]]]:
        return [(e.name, attributes(e.attributes)) for e in self.span.events]


@dataclass
class Collector:
    url: str = ""
    delay_s: float = 0.0  # a slow collector: each answer waits this long
    status: int = 200  # anything else: a collector that refuses
    spans: list[ReceivedSpan] = field(default_factory=list)
    # metric name -> every data point received (attributes, and the point itself)
    points: dict[str, list[tuple[dict[str, Any], Any]]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)  # paths, in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, path: str, body: bytes) -> bytes | None:
        if path == "/v1/traces":
            traces = ExportTraceServiceRequest.FromString(body)
            with self.lock:
                self.requests.append(path)
                for rs in traces.resource_spans:
                    resource = attributes(rs.resource.attributes)
                    for ss in rs.scope_spans:
                        self.spans.extend(ReceivedSpan(s, resource) for s in ss.spans)
            return ExportTraceServiceResponse().SerializeToString()
        if path == "/v1/metrics":
            metrics = ExportMetricsServiceRequest.FromString(body)
            with self.lock:
                self.requests.append(path)
                for rm in metrics.resource_metrics:
                    for sm in rm.scope_metrics:
                        for metric in sm.metrics:
                            data = getattr(metric, metric.WhichOneof("data"))
                            points = self.points.setdefault(metric.name, [])
                            points.extend((attributes(p.attributes), p) for p in data.data_points)
            return ExportMetricsServiceResponse().SerializeToString()
        return None

    def wait_for(self, check: Callable[[], Any], timeout_s: float = 15.0) -> Any:
        """Poll until `check()` is truthy (returns it), or fail after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                found = check()
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"the collector did not receive it within {timeout_s} s")
            time.sleep(0.05)

    def named(self, name: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.name == name]

    def in_trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length)
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        collector = self.server.collector
        if collector.delay_s:
            time.sleep(collector.delay_s)
        if collector.status != 200:
            self._answer(collector.status, b"")
            return
        answer = collector.take(self.path, body)
        if answer is None:
            self._answer(404, b"")
            return
        self._answer(200, answer)

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    collector: Collector


@contextmanager
def run_collector(port: int = 0, **options: Any) -> Iterator[Collector]:
    """An OTLP/HTTP receiver on 127.0.0.1 (`port` 0: a free one) for the block's duration."""
    server = _Server(("127.0.0.1", port), _Handler)
    collector = Collector(url=f"http://127.0.0.1:{server.server_address[1]}", **options)
    server.collector = collector
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="otlp-receiver")
    thread.start()
    try:
        yield collector
    finally:
        server.shutdown()
        server.server_close()
