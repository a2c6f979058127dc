"""Flow control and overload protection, each limit and trigger driven for real."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.rawhttp import RawStream
from tests.redis_server import run_redis
from tests.servers import Server, run_server, wait_for

KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"

[[keys]]
name = "bob"
key = "sk-bob"

[[keys]]
name = "carol"
key = "sk-carol"
max_streams = 1

[[keys]]
name = "dave"
key = "sk-dave"
tokens_per_minute = 50

[[keys]]
name = "erin"
key = "sk-erin"
tokens_per_minute = 100
max_streams = 50

[[keys]]
name = "frank"
key = "sk-frank"
tokens_per_minute = 100000
"""
MSG = [{"role": "user", "content": "limits"}]
GENERATED = "firsttoken_tokens_generated_total"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def rejected(server: Server) -> float:
    return server.metric('firsttoken_streams_total{outcome="rejected"}')


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    with run_server(
        "--api-keys",
        str(path),
        "--synthetic-ttft-ms",
        "10",
        "--synthetic-itl-ms",
        "20",
        "--max-streams-per-key",
        "5",
    ) as s:
        yield s


def open_stream(server: Server, key: str) -> RawStream:
    return RawStream(
        server.port,
        "POST",
        "/v1/chat/completions",
        {"messages": MSG, "stream": True, "max_tokens": 200},
        auth(key),
    )


def test_missing_or_unknown_key_is_401(keyed: Server) -> None:
    for headers in ({}, auth("sk-nobody")):
        r = httpx.post(
            keyed.v1 + "/chat/completions", json={"messages": MSG}, headers=headers, timeout=10
        )
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.v1 + "/models", timeout=10).status_code == 401
    ok = httpx.get(keyed.v1 + "/models", headers=auth("sk-alice"), timeout=10)
    assert ok.status_code == 200


def test_sixth_stream_on_a_key_is_429_other_key_unaffected(keyed: Server) -> None:
    before = rejected(keyed)
    streams = [open_stream(keyed, "sk-alice") for _ in range(5)]
    assert all(s.status == 200 for s in streams)
    sixth = httpx.post(
        keyed.v1 + "/chat/completions",
        headers=auth("sk-alice"),
        json={"messages": MSG, "stream": True},
        timeout=10,
    )
    assert sixth.status_code == 429
    assert int(sixth.headers["retry-after"]) >= 1
    err = sixth.json()["error"]
    assert (
        err["code"] == "concurrency_limit_exceeded" and "--max-streams-per-key 5" in err["message"]
    )
    bob = open_stream(keyed, "sk-bob")
    assert bob.status == 200
    assert rejected(keyed) == before + 1
    for s in [*streams, bob]:
        s.close()
    # Closing frees the slots (the engine stops and the lease goes back).
    wait_for(
        lambda: (
            httpx.post(
                keyed.v1 + "/completions",
                headers=auth("sk-alice"),
                json={"prompt": "again", "max_tokens": 1},
                timeout=10,
            ).status_code
            == 200
        ),
        timeout=5,
    )


def test_per_key_override_from_the_keys_file(keyed: Server) -> None:
    first = open_stream(keyed, "sk-carol")
    second = httpx.post(
        keyed.v1 + "/completions",
        headers=auth("sk-carol"),
        json={"prompt": "x", "max_tokens": 1},
        timeout=10,
    )
    # The limit named where it was set: the keys file's field, not the server's flag.
    assert second.status_code == 429 and "its max_streams = 1" in second.json()["error"]["message"]
    first.close()


def spend_budget(first: Server, second: Server) -> None:
    """dave has 50 tokens a minute: 1 + 40 are admitted; another 40 does not fit in what is
    left, and is refused rather than lowered; 1 + 8 is admitted, and the next is refused."""
    if (left := 60 - time.time() % 60) < 10:
        time.sleep(left + 0.5)  # don't straddle the minute the budget counts in
    for srv, asked, status in ((first, 40, 200), (second, 40, 429), (first, 8, 200)):
        r = httpx.post(
            srv.v1 + "/completions",
            headers=auth("sk-dave"),
            json={"prompt": "budget", "max_tokens": asked},
            timeout=10,
        )
        assert r.status_code == status, r.text
        if status == 200:
            assert r.json()["usage"]["completion_tokens"] == asked
    refused = httpx.post(
        second.v1 + "/completions",
        headers=auth("sk-dave"),
        json={"prompt": "budget", "max_tokens": 1},
        timeout=10,
    )
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "token_budget_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    other = httpx.post(
        second.v1 + "/completions",
        headers=auth("sk-bob"),
        json={"prompt": "budget", "max_tokens": 1},
        timeout=10,
    )
    assert other.status_code == 200


def test_tokens_per_minute_budget(keyed: Server) -> None:
    spend_budget(keyed, keyed)


def billed(server: Server, key: str) -> tuple[float, float]:
    """(prompt, completion) tokens billed to the key so far."""
    metrics = server.metrics()
    return tuple(  # type: ignore[return-value]
        metrics[f'firsttoken_key_tokens_total{{key="{key}",kind="{kind}"}}']
        for kind in ("prompt", "completion")
    )


def outside_a_minute_boundary() -> None:
    if (left := 60 - time.time() % 60) < 10:
        time.sleep(left + 0.5)  # don't straddle the minute the budget counts in


def burst_on_erin(servers: list[Server], n: int) -> list[httpx.Response]:
    """`n` requests of up to 50 answer tokens at once from erin (100 tokens a minute),
    spread over `servers`."""

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        servers[i % len(servers)].v1 + "/completions",
                        headers=auth("sk-erin"),
                        json={"prompt": "budget", "max_tokens": 50},
                    )
                    for i in range(n)
                )
            )

    outside_a_minute_boundary()
    answers = asyncio.run(burst())
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert ok and len(ok) < n
    assert {r.json()["error"]["code"] for r in refused} == {"token_budget_exceeded"}
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    # Never over: a request whose max_tokens does not fit in what is left is refused (it
    # could go over by a whole request before, and one request's max_tokens has no bound).
    assert used <= 100
    return ok


def test_concurrent_requests_never_go_over_a_budget(keyed: Server) -> None:
    # Each request holds its prompt + 50 at admission, or is refused, so the ones admitted
    # while the minute had room are all that run (an admission check alone let all 20 in:
    # 1,040 tokens).
    ok = burst_on_erin([keyed], 20)
    prompt, completion = billed(keyed, "erin")
    assert prompt + completion == sum(r.json()["usage"]["total_tokens"] for r in ok)


def test_two_instances_hold_one_budget_in_redis(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    with run_redis() as url:
        args = ("--redis", url, "--api-keys", str(keys), "--synthetic-itl-ms", "5")
        with run_server(*args) as a, run_server(*args) as b:
            burst_on_erin([a, b], 20)


def test_a_stream_its_client_cuts_is_billed_what_was_generated(keyed: Server) -> None:
    before = billed(keyed, "frank")
    with httpx.stream(
        "POST",
        keyed.v1 + "/chat/completions",
        headers=auth("sk-frank"),
        json={"messages": MSG, "stream": True, "max_tokens": 200},
        timeout=10,
    ) as r:
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                chunks += 1
                if chunks == 5:
                    break  # the client leaves after 5 chunks

    def finished() -> dict | None:
        return next(
            (
                rec
                for rec in keyed.log_records()
                if rec.get("event") == "stream.finished" and rec.get("key") == "frank"
            ),
            None,
        )

    wait_for(lambda: finished() is not None, timeout=10)
    record = finished()
    assert record is not None and record["outcome"] == "disconnected"
    prompt, completion = billed(keyed, "frank")
    assert completion - before[1] == record["tokens_generated"]  # what was generated...
    assert 5 <= record["tokens_generated"] < 200  # ...not the 200 it asked for
    assert prompt - before[0] > 0  # and its prompt


def test_burst_over_the_new_stream_bucket() -> None:
    with run_server(
        "--rate-limit-per-s",
        "2",
        "--rate-limit-burst",
        "3",
        "--synthetic-ttft-ms",
        "1",
        "--synthetic-itl-ms",
        "1",
    ) as srv:
        codes = [
            httpx.post(srv.v1 + "/completions", json={"prompt": "b", "max_tokens": 1}, timeout=10)
            for _ in range(5)
        ]
        assert [r.status_code for r in codes[:3]] == [200, 200, 200]
        assert codes[3].status_code == 429
        assert codes[3].json()["error"]["code"] == "rate_limit_exceeded"
        assert codes[3].headers["retry-after"] == "1"
        time.sleep(0.6)  # 2 per second: one more token has dripped in
        again = httpx.post(
            srv.v1 + "/completions", json={"prompt": "b", "max_tokens": 1}, timeout=10
        )
        assert again.status_code == 200


def test_two_instances_share_one_per_key_limit_and_leases_expire(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    with run_redis() as url:
        args = (
            "--redis",
            url,
            "--api-keys",
            str(keys),
            "--max-streams-per-key",
            "2",
            "--synthetic-ttft-ms",
            "10",
            "--synthetic-itl-ms",
            "20",
        )
        with run_server(*args) as a, run_server(*args) as b:
            spend_budget(a, b)  # the token budget is shared too
            on_a = open_stream(a, "sk-bob")
            on_b = open_stream(b, "sk-bob")
            assert on_a.status == on_b.status == 200
            for srv in (a, b):
                third = httpx.post(
                    srv.v1 + "/completions",
                    headers=auth("sk-bob"),
                    json={"prompt": "x", "max_tokens": 1},
                    timeout=10,
                )
                assert third.status_code == 429
            on_b.close()  # a slot frees on B: A can use it
            wait_for(
                lambda: (
                    httpx.post(
                        a.v1 + "/completions",
                        headers=auth("sk-bob"),
                        json={"prompt": "x", "max_tokens": 1},
                        timeout=10,
                    ).status_code
                    == 200
                ),
                timeout=5,
            )
            # A crashes holding a slot: its lease expires (5 s) instead of leaking forever.
            held = open_stream(a, "sk-bob")
            assert held.status == 200
            a.kill()
            on_a.close()
            held.close()

            def b_status() -> int:
                return httpx.post(
                    b.v1 + "/completions",
                    headers=auth("sk-bob"),
                    json={"prompt": "x", "max_tokens": 1},
                    timeout=10,
                ).status_code

            assert b_status() == 429  # the dead instance's two leases still count...
            wait_for(lambda: b_status() == 200, timeout=10, interval=0.5)  # ...until they expire


def test_reader_that_never_reads_is_bounded_and_dropped() -> None:
    with run_server(
        "--send-timeout-s",
        "1.5",
        "--stream-buffer-events",
        "64",
        "--synthetic-ttft-ms",
        "1",
        "--synthetic-itl-ms",
        "1",
    ) as srv:
        disconnected = srv.metric('firsttoken_streams_total{outcome="disconnected"}')
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        body = (
            b'{"messages":[{"role":"user","content":"slow"}],"stream":true,'
            b'"synthetic":{"answer_tokens":5000}}'
        )
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )

        # Generation pauses once the socket and the stream's window are full...
        def stable() -> float | None:
            before = srv.metric(GENERATED)
            time.sleep(0.3)  # 300 token intervals
            return before if before and srv.metric(GENERATED) == before else None

        paused = wait_for(stable, timeout=10)
        assert paused < 2500  # 5,000 tokens at 1 ms each would be far past this by now
        # ...and the stalled reader is cut after the send timeout, its engine request stopped.
        wait_for(
            lambda: (
                srv.metric('firsttoken_streams_total{outcome="disconnected"}') == disconnected + 1
            ),
            timeout=10,
        )
        assert srv.metric("firsttoken_active_streams") == 0
        sock.settimeout(5)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        sock.close()
        assert b"[DONE]" not in received


def test_engine_errors_open_the_breaker_then_it_recovers() -> None:
    with run_server(
        "--breaker-min-streams",
        "5",
        "--breaker-window-s",
        "5",
        "--breaker-open-s",
        "1",
        "--synthetic-ttft-ms",
        "1",
        "--synthetic-itl-ms",
        "1",
        # An engine fault (a request's own fail_after is the client's, and not counted). The
        # engine draws its failures from a generator seeded with 0: of the first six streams
        # the third and the fifth fail.
        "--synthetic-fail-rate",
        "0.5",
    ) as srv:
        statuses = [
            httpx.post(
                srv.v1 + "/completions", json={"prompt": "f", "max_tokens": 30}, timeout=10
            ).status_code
            for _ in range(5)
        ]
        assert statuses == [200, 200, 500, 200, 500]
        shed = httpx.post(
            srv.v1 + "/completions", json={"prompt": "f", "max_tokens": 1}, timeout=10
        )
        assert shed.status_code == 503 and shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(srv.url + "/readyz", timeout=10).status_code == 503
        m = srv.metrics()
        assert m['firsttoken_breaker_state{state="open"}'] == 1
        assert m['firsttoken_shedding{reason="breaker"}'] == 1
        time.sleep(1.1)
        # Half-open: one probe goes through; it succeeds, so the breaker closes.
        probe = httpx.post(
            srv.v1 + "/completions", json={"prompt": "f", "max_tokens": 1}, timeout=10
        )
        assert probe.status_code == 200
        assert httpx.get(srv.url + "/readyz", timeout=10).status_code == 200
        assert srv.metric('firsttoken_breaker_state{state="closed"}') == 1
        assert any(r["event"] == "shed.breaker" and r["state"] == "open" for r in srv.log_records())


def test_what_a_request_causes_itself_trips_neither_guard() -> None:
    guards = (
        "--breaker-min-streams", "20", "--breaker-window-s", "30", "--ttft-slo-ms", "500",
        "--synthetic-ttft-ms", "1", "--synthetic-itl-ms", "1",
    )  # fmt: skip

    def tripped(srv: Server) -> bool:
        m = srv.metrics()
        if m['firsttoken_breaker_state{state="open"}'] or m['firsttoken_shedding{reason="ttft"}']:
            return True
        return httpx.get(srv.url + "/readyz", timeout=10).status_code != 200

    async def at_once(srv: Server, body: dict, n: int) -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            post = [client.post(srv.v1 + "/completions", json=body) for _ in range(n)]
            return [r.status_code for r in await asyncio.gather(*post)]

    with run_server(*guards) as srv:
        # One key's own faults and chosen latencies (issue 25: these shut everyone out).
        failing = {"prompt": "f", "max_tokens": 3, "synthetic": {"fail_after": 0}}
        assert asyncio.run(at_once(srv, failing, 25)) == [500] * 25
        slow = {"prompt": "s", "max_tokens": 1, "synthetic": {"ttft_ms": 700}}
        assert asyncio.run(at_once(srv, slow, 20)) == [200] * 20
        time.sleep(0.2)  # the TTFT guard looks at most ten times a second
        assert not tripped(srv)
        ok = httpx.post(srv.v1 + "/completions", json={"prompt": "o", "max_tokens": 1})
        assert ok.status_code == 200  # everyone else is still served
    with run_server(*guards, "--synthetic-fail-rate", "1") as srv:
        # The engine's own faults still open the breaker.
        plain = {"prompt": "f", "max_tokens": 3}
        assert asyncio.run(at_once(srv, plain, 20)) == [500] * 20
        assert tripped(srv)
        shed = httpx.post(srv.v1 + "/completions", json=plain, timeout=10)
        assert (shed.status_code, shed.json()["error"]["code"]) == (503, "engine_unavailable")


def test_slow_ttft_refuses_new_streams_until_it_recovers() -> None:
    # The engine is slow (the server's setting): a latency a request sets for itself would
    # not count (test_what_a_request_causes_itself_trips_neither_guard).
    with run_server(
        "--ttft-slo-ms",
        "300",
        "--breaker-min-streams",
        "3",
        "--breaker-window-s",
        "2",
        "--synthetic-ttft-ms",
        "400",
        "--synthetic-itl-ms",
        "5",
    ) as srv:
        long = RawStream(
            srv.port,
            "POST",
            "/v1/chat/completions",
            {"messages": MSG, "stream": True, "max_tokens": 500},
        )
        for _ in range(3):
            httpx.post(
                srv.v1 + "/completions",
                json={"prompt": "s", "stream": True, "max_tokens": 1},
                timeout=10,
            )
        shed = httpx.post(
            srv.v1 + "/completions", json={"prompt": "s", "max_tokens": 1}, timeout=10
        )
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "overloaded"
        assert "retry-after" in shed.headers
        assert httpx.get(srv.url + "/readyz", timeout=10).status_code == 503
        assert srv.metric('firsttoken_shedding{reason="ttft"}') == 1
        body = long.read_all()  # the stream already running is untouched
        long.close()
        assert body.endswith(b"data: [DONE]\n\n")
        wait_for(
            lambda: httpx.get(srv.url + "/readyz", timeout=10).status_code == 200,
            timeout=6,
            interval=0.2,
        )
        ok = httpx.post(srv.v1 + "/completions", json={"prompt": "s", "max_tokens": 1}, timeout=10)
        assert ok.status_code == 200


def test_memory_over_limit_refuses_and_ends_the_oldest_stream() -> None:
    with run_server() as probe:
        base = wait_for(lambda: probe.metric("firsttoken_memory_rss_bytes"))
    limit = int((base + 24 * 2**20) / 0.8)
    capacity = 30_000  # events kept per stream for resume
    with run_server(
        "--memory-limit", str(limit), "--resume-max-events", str(capacity),
        "--synthetic-ttft-ms", "0", "--synthetic-itl-ms", "0", "--heartbeat-s", "0.5",
    ) as srv:  # fmt: skip
        created = []
        # Nobody reads these streams: each generates into its resume buffer until the buffer
        # is full (~3 MB of events), then waits for a reader, still running.
        request = {"prompt": "m", "synthetic": {"answer_tokens": capacity + 10_000}}
        for _ in range(60):
            r = httpx.post(srv.v1 + "/streams", json=request, timeout=10)
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "overloaded"
                break
            created.append(r.json())
            time.sleep(0.2)
        else:
            pytest.fail("memory never crossed the limit")
        assert httpx.get(srv.url + "/readyz", timeout=10).status_code == 503
        assert srv.metric('firsttoken_shedding{reason="memory"}') == 1
        oldest = created[0]
        # Its last events: the buffer has moved past the first ones.
        late = {"last-event-id": str(capacity - 1_000)}
        body = httpx.get(srv.url + oldest["events_url"], headers=late, timeout=10).content
        assert b'event: error\ndata: {"error":{"code":"overloaded"' in body
        assert srv.metric('firsttoken_streams_total{outcome="error"}') >= 1


def test_slow_loris_headers_and_body_are_cut() -> None:
    with run_server("--header-timeout-s", "0.5", "--body-timeout-s", "0.5") as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            t0 = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the server
            assert time.monotonic() - t0 < 3
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"pro'
            )
            answer = sock.recv(65536)
            while b"request_timeout" not in answer and (more := sock.recv(65536)):
                answer += more
            assert answer.startswith(b"HTTP/1.1 408 ")
