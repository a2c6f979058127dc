"""Metrics under the INTERFACE.md names, and one JSON log line per lifecycle event."""

from __future__ import annotations

import re

import httpx

from firsttoken.telemetry.metrics import INTER_CHUNK_BUCKETS, TTFT_BUCKETS
from tests.servers import Server, run_server, wait_for


def test_bucket_resolution_meets_the_interface() -> None:
    ttft = [b for b in TTFT_BUCKETS if b <= 0.5]
    assert all(b - a <= 0.010 + 1e-9 for a, b in zip([0.0, *ttft], ttft, strict=False))
    assert ttft[-1] == 0.5
    itl = [b for b in INTER_CHUNK_BUCKETS if b <= 0.1]
    assert all(b - a <= 0.002 + 1e-9 for a, b in zip([0.0, *itl], itl, strict=False))
    assert itl[-1] == 0.1


def test_metrics_names_and_histograms_move(server: Server) -> None:
    before = server.metrics()
    httpx.post(
        server.v1 + "/chat/completions",
        json={"messages": [{"role": "user", "content": "m"}], "stream": True, "max_tokens": 10},
        timeout=10,
    )
    m = server.metrics()
    assert m["firsttoken_ttft_seconds_count"] == before["firsttoken_ttft_seconds_count"] + 1
    # 10 tokens: 1 TTFT + 9 inter-chunk gaps.
    assert m["firsttoken_inter_chunk_seconds_count"] == (
        before["firsttoken_inter_chunk_seconds_count"] + 9
    )
    for name in ("firsttoken_tokens_generated_total", "firsttoken_tokens_sent_total"):
        assert m[name] == before[name] + 10
    assert "firsttoken_active_streams" in m
    for outcome in ("completed", "cancelled", "disconnected", "error", "rejected"):
        assert f'firsttoken_streams_total{{outcome="{outcome}"}}' in m


def test_ttft_histogram_matches_engine_ttft() -> None:
    with run_server("--synthetic-ttft-ms", "120", "--synthetic-itl-ms", "5") as srv:
        for _ in range(3):
            httpx.post(
                srv.v1 + "/completions",
                json={"prompt": "t", "stream": True, "max_tokens": 3},
                timeout=10,
            )
        m = srv.metrics()
        assert m['firsttoken_ttft_seconds_bucket{le="0.115"}'] == 0
        assert m['firsttoken_ttft_seconds_bucket{le="0.2"}'] == 3


def test_loop_lag_is_sampled_while_the_server_runs(server: Server) -> None:
    count = "firsttoken_loop_lag_seconds_count"
    before = server.metric(count)
    # Sampled every 50 ms on the registry's schedule, idle or not.
    wait_for(lambda: server.metric(count) >= before + 3)
    m = server.metrics()
    assert m['firsttoken_loop_lag_seconds_bucket{le="+Inf"}'] == m[count]
    assert m['firsttoken_loop_lag_seconds_bucket{le="0.5"}'] > 0


def test_a_clients_trace_ids_are_not_taken_by_default(server: Server) -> None:
    # Issue 37.11: a client's X-Request-Id or traceparent became the trace id of its stream
    # (its log lines, its spans): a client could join, or pick, another's trace.
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    for headers in ({"traceparent": f"00-{trace}-00f067aa0ba902b7-01"}, {"X-Request-Id": trace}):
        r = httpx.post(
            server.v1 + "/completions",
            json={"prompt": "log", "max_tokens": 1},
            headers=headers,
            timeout=10,
        )
        assert r.status_code == 200
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        assert r.headers["x-request-id"] != trace
    bad = httpx.post(
        server.v1 + "/chat/completions", json={}, timeout=10, headers={"X-Request-Id": "req-42"}
    )
    assert bad.headers["x-request-id"] != "req-42"


def test_trace_ids_and_lifecycle_logs() -> None:
    with run_server("--trust-trace-headers") as server:
        trace_ids_and_lifecycle_logs(server)


def trace_ids_and_lifecycle_logs(server: Server) -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = httpx.post(
        server.v1 + "/chat/completions",
        json={"messages": [{"role": "user", "content": "log"}], "stream": True, "max_tokens": 4},
        headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01"},
        timeout=10,
    )
    assert r.headers["x-request-id"] == trace
    stream_id = r.headers["x-stream-id"]

    def lines() -> list[dict]:
        return [x for x in server.log_records() if x.get("stream") == stream_id]

    wait_for(lambda: any(x["event"] == "stream.finished" for x in lines()))
    # One line per stream at info, with everything the debug lines say.
    [finished] = lines()
    assert finished["event"] == "stream.finished"
    assert finished["trace_id"] == trace
    assert finished["outcome"] == "completed"
    assert finished["tokens_generated"] == finished["tokens_sent"] == 4
    assert finished["ttft_ms"] > 0
    assert finished["model"] == "synthetic" and finished["max_tokens"] == 4
    assert finished["key"] == "open"
    # An error response carries the caller's request id too.
    bad = httpx.post(
        server.v1 + "/chat/completions", json={}, timeout=10, headers={"X-Request-Id": "req-42"}
    )
    assert bad.headers["x-request-id"] == "req-42"


def test_debug_logs_the_stream_accepted_and_its_first_token() -> None:
    with run_server("--log-level", "debug", "--trust-trace-headers") as srv:
        r = httpx.post(
            srv.v1 + "/completions",
            json={"prompt": "debug", "stream": True, "max_tokens": 3},
            headers={"X-Request-Id": "req-debug"},
            timeout=10,
        )
        stream_id = r.headers["x-stream-id"]

        def lines() -> list[dict]:
            return [x for x in srv.log_records() if x.get("stream") == stream_id]

        wait_for(lambda: any(x["event"] == "stream.finished" for x in lines()))
        assert [x["event"] for x in lines()] == [
            "stream.accepted",
            "stream.first_token",
            "stream.finished",
        ]
        assert [x["level"] for x in lines()] == ["debug", "debug", "info"]
        assert all(x["trace_id"] == "req-debug" for x in lines())
        first, finished = lines()[1], lines()[2]
        assert first["ttft_ms"] == finished["ttft_ms"] > 0


def test_a_whole_answer_logs_the_tokens_it_sent_as_the_metric_counts_them() -> None:
    with run_server("--synthetic-ttft-ms", "1", "--synthetic-itl-ms", "1") as srv:
        sent = "firsttoken_tokens_sent_total"
        before = srv.metric(sent)
        body = {"messages": [{"role": "user", "content": "whole"}], "max_tokens": 7}
        r = httpx.post(srv.v1 + "/chat/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
        stream_id = r.headers["x-stream-id"]

        def finished() -> list[dict]:
            return [
                x
                for x in srv.log_records()
                if x["event"] == "stream.finished" and x.get("stream") == stream_id
            ]

        [line] = wait_for(finished)
        # The log said 0 while the metric rose by 7 (issue 26).
        assert line["tokens_sent"] == srv.metric(sent) - before == 7


def test_health_and_readiness(server: Server) -> None:
    assert httpx.get(server.url + "/healthz", timeout=10).json() == {"status": "ok"}
    assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
