"""--otlp-endpoint against a real OTLP/HTTP receiver on loopback (tests/otlp.py, decoding the
protobuf with opentelemetry-proto): spans and GenAI metrics by name, the client's trace
continued through the gateway to its upstream, the flush on SIGTERM, and a collector that is
away (spans dropped and counted, streams untouched)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from tests.otlp import run_collector
from tests.servers import ROOT, Server, run_server, wait_for

OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0")
FAST = ("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1", *OPEN)
# Export at once, so a test need not wait for the SDK's 5 s batches and 60 s metric periods.
QUICK = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "300"}
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CLIENT_SPAN}-01"
GENAI = (
    "gen_ai.server.time_to_first_token",
    "gen_ai.server.time_per_output_token",
    "gen_ai.server.request.duration",
    "gen_ai.client.token.usage",
)
UPSTREAM_LEG = (
    "gen_ai.client.operation.time_to_first_chunk",
    "gen_ai.client.operation.time_per_output_chunk",
    "gen_ai.client.operation.duration",
)


def chat(server: Server, max_tokens: int = 6, **headers: str) -> str:
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    text = []
    with client.chat.completions.create(
        model="synthetic",
        messages=[{"role": "user", "content": "Tell me about tracing."}],
        max_tokens=max_tokens,
        stream=True,
        extra_headers=headers,
    ) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
    return "".join(text)


TRUST = ("--trust-trace-headers",)


def test_a_relayed_stream_is_one_trace_from_the_client_to_the_upstream() -> None:
    with (
        run_collector() as collector,
        run_server(*FAST, *TRUST, "--otlp-endpoint", collector.url, env=QUICK) as upstream,
        run_server(
            "--engine", "openai", "--upstream", upstream.v1, "--otlp-endpoint", collector.url,
            *TRUST, *OPEN, env=QUICK,
        ) as gateway,
    ):  # fmt: skip
        text = chat(gateway, traceparent=TRACEPARENT)
        assert text
        trace = collector.wait_for(lambda: len(collector.in_trace(TRACE)) >= 3 and collector)
        spans = trace.in_trace(TRACE)
        # The gateway's span continues the client's; its leg is its child; the upstream's
        # span is the leg's child: the traceparent went on with the relay.
        [served] = [s for s in spans if s.parent_id == CLIENT_SPAN]
        [leg] = [s for s in spans if s.parent_id == served.span_id]
        [behind] = [s for s in spans if s.parent_id == leg.span_id]
        assert served.name == leg.name == behind.name == "chat synthetic"
        assert served.span.kind == served.span.SPAN_KIND_SERVER
        assert leg.span.kind == leg.span.SPAN_KIND_CLIENT
        assert behind.span.kind == behind.span.SPAN_KIND_SERVER
        attrs = served.attributes
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.provider.name"] == "firsttoken"
        assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "synthetic"
        assert attrs["gen_ai.usage.output_tokens"] == 6
        assert attrs["gen_ai.usage.input_tokens"] > 0
        assert attrs["gen_ai.response.finish_reasons"] == ("length",)
        assert attrs["firsttoken.outcome"] == "completed"
        assert [name for name, _ in served.events] == ["admitted", "first_token", "end"]
        assert leg.attributes["firsttoken.target"] == "upstream-1"
        assert leg.attributes["gen_ai.provider.name"] == "openai"
        assert leg.attributes["server.address"] == "127.0.0.1"
        assert leg.attributes["server.port"] == upstream.port
        assert served.resource["service.name"] == "firsttoken"
        # GenAI metrics on both legs, by their names.
        collector.wait_for(lambda: all(n in collector.points for n in GENAI + UPSTREAM_LEG))
        ttft = collector.points["gen_ai.server.time_to_first_token"]
        assert all(a["gen_ai.request.model"] == "synthetic" for a, _ in ttft)
        usage = {a["gen_ai.token.type"] for a, _ in collector.points["gen_ai.client.token.usage"]}
        assert usage == {"input", "output"}
        # Prometheus stays as it was, with the drop counter beside it.
        metrics = gateway.metrics()
        assert metrics["firsttoken_otel_dropped_total"] == 0
        assert metrics["firsttoken_ttft_seconds_count"] == 1


def test_without_export_the_clients_traceparent_still_reaches_the_upstream() -> None:
    with (
        run_collector() as collector,
        run_server(*FAST, *TRUST, "--otlp-endpoint", collector.url, env=QUICK) as upstream,
        run_server("--engine", "openai", "--upstream", upstream.v1, *TRUST, *OPEN) as gateway,
    ):
        assert chat(gateway, traceparent=TRACEPARENT)
        [behind] = collector.wait_for(lambda: collector.in_trace(TRACE))
        assert behind.parent_id == CLIENT_SPAN  # the gateway took no part, and said so
        assert "firsttoken_otel_dropped_total" not in gateway.metrics()


def test_by_default_a_clients_trace_is_a_link_and_the_gateway_starts_its_own() -> None:
    # Issue 37.11: a client's trace id was adopted (unrelated users could share a trace), its
    # flag 00 turned export of its spans off, and its X-Request-Id became the trace id.
    with (
        run_collector() as collector,
        run_server(*FAST, *TRUST, "--otlp-endpoint", collector.url, env=QUICK) as upstream,
        run_server(
            "--engine", "openai", "--upstream", upstream.v1, "--otlp-endpoint", collector.url,
            *OPEN, env=QUICK,
        ) as gateway,
    ):  # fmt: skip
        unsampled = f"00-{TRACE}-{CLIENT_SPAN}-00"
        assert chat(gateway, traceparent=unsampled, **{"X-Request-Id": TRACE})
        served = collector.wait_for(
            lambda: [s for s in collector.named("chat synthetic") if s.parent_id == ""]
        )[0]
        assert served.trace_id != TRACE and collector.in_trace(TRACE) == []
        [link] = served.span.links
        assert (link.trace_id.hex(), link.span_id.hex()) == (TRACE, CLIENT_SPAN)
        # The rest of the trace is the gateway's: its leg, and the upstream behind it (which
        # trusts the gateway).
        spans = collector.wait_for(lambda: len(collector.in_trace(served.trace_id)) >= 3 and
                                   collector.in_trace(served.trace_id))  # fmt: skip
        [leg] = [s for s in spans if s.parent_id == served.span_id]
        assert [s for s in spans if s.parent_id == leg.span_id]
        # A version-ff traceparent is no link, and no trace id either.
        ff = f"ff-{'1' * 32}-{CLIENT_SPAN}-01"
        r = httpx.post(
            gateway.v1 + "/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"traceparent": ff},
            timeout=10,
        )
        assert r.status_code == 200 and r.headers["x-request-id"] != "1" * 32


def test_an_upstream_error_code_is_one_of_a_closed_set_on_spans_and_metrics() -> None:
    # Issue 37.11: an upstream's error `code` became `error.type`, an unbounded metric value.
    from tests.upstreams import scripted_upstream

    with (
        run_collector() as collector,
        scripted_upstream({"synthetic": "openai-event-error"}) as up,
        run_server(
            "--engine", "openai", "--upstream", up.url, "--otlp-endpoint", collector.url,
            *OPEN, env=QUICK,
        ) as gateway,
    ):  # fmt: skip
        r = httpx.post(
            gateway.v1 + "/completions",
            json={"model": "synthetic", "prompt": "x", "max_tokens": 1},
            timeout=10,
        )
        assert r.json()["error"]["code"] == "server_error"  # the client reads it
        spans = collector.wait_for(lambda: collector.named("text_completion synthetic"))
        types = {s.attributes.get("error.type") for s in spans}
        assert "server_error" not in types and "_OTHER" in types
        collector.wait_for(lambda: "gen_ai.server.request.duration" in collector.points)
        points = collector.points["gen_ai.server.request.duration"]
        assert {a.get("error.type") for a, _ in points} <= {None, "_OTHER"}


def test_an_invalid_traceparent_starts_a_new_trace() -> None:
    with (
        run_collector() as collector,
        run_server(*FAST, "--otlp-endpoint", collector.url, env=QUICK) as server,
    ):
        zero = f"00-{'0' * 32}-{CLIENT_SPAN}-01"
        assert chat(server, traceparent=zero)
        [span] = collector.wait_for(lambda: collector.named("chat synthetic"))
        assert span.parent_id == ""
        assert span.trace_id != "0" * 32


def test_sigterm_flushes_what_is_pending() -> None:
    # Batches every minute: only the shutdown's flush can deliver these.
    slow = {"OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_METRIC_EXPORT_INTERVAL": "60000"}
    with run_collector() as collector, run_server(
        *FAST, "--otlp-endpoint", collector.url, env=slow
    ) as server:
        for _ in range(3):
            assert chat(server)
        assert collector.spans == [] and collector.points == {}
        server.kill(signal.SIGTERM)
        assert server.proc.returncode == 0
        assert len(collector.named("chat synthetic")) == 3
        assert all(name in collector.points for name in GENAI)
        [ttft] = [p for _, p in collector.points["gen_ai.server.time_to_first_token"]]
        assert ttft.count == 3


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_collector_that_is_away_costs_spans_not_streams() -> None:
    away = f"http://127.0.0.1:{_closed_port()}"
    with run_server(*FAST, "--otlp-endpoint", away, env=QUICK) as server:
        for _ in range(5):
            r = httpx.post(
                server.v1 + "/chat/completions",
                json={"model": "synthetic", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4, "stream": True},
                timeout=10,
            )  # fmt: skip
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        wait_for(lambda: server.metric("firsttoken_otel_dropped_total") >= 5, timeout=30)
        records = server.log_records()
        assert [r for r in records if r.get("event") == "otel.export_failed"]
        assert server.metric('firsttoken_streams_total{outcome="completed"}') == 5


def test_a_slow_collector_does_not_hold_the_shutdown() -> None:
    with run_collector(delay_s=30) as collector, run_server(
        *FAST, "--otlp-endpoint", collector.url, env=QUICK
    ) as server:
        assert chat(server)
        server.kill(signal.SIGTERM)  # waits at most 10 s: the flush gives up after 5
        assert server.proc.returncode == 0
        assert any(r.get("event") == "otel.flush_timeout" for r in server.log_records())


@pytest.mark.parametrize(
    "missing", ["opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"]
)
def test_the_flag_without_the_packages_is_one_line_at_start(missing: str) -> None:
    # The packages hidden from the import system, as on an install without the extra.
    hide = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        f"    def find_spec(self, name, path, target=None):\n"
        f"        if name == {missing!r} or name.startswith({missing!r} + '.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from firsttoken.cli import main\n"
        "sys.argv = ['firsttoken', 'serve', '--otlp-endpoint', 'http://127.0.0.1:4318']\n"
        "raise SystemExit(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"needs {missing}: FIRSTTOKEN_EXTRAS=otel ./scripts/serve installs it" in done.stderr
