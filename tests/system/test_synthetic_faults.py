"""The synthetic engine's failures: `--synthetic-fail-rate` is an engine fault (the breaker
counts it), a request's own `synthetic.fail_after` is the client's doing (it does not)."""

from __future__ import annotations

import json

import httpx

from tests.servers import run_server

FAST = ("--synthetic-ttft-ms", "1", "--synthetic-itl-ms", "1", "--rate-limit-per-s", "0")
BREAKER = ("--breaker-min-streams", "3", "--breaker-window-s", "30", "--breaker-open-s", "30")
CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}


def streamed(url: str, **extra: object) -> tuple[int, list[dict], bool]:
    """Status, error events and whether [DONE] came, of one streamed chat."""
    errors, done = [], False
    with httpx.stream("POST", url, json={**CHAT, "stream": True, **extra}, timeout=10) as r:
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                done = done or line == "data: [DONE]"
                if event == "error":
                    errors.append(json.loads(line[6:])["error"])
                event = None
        return r.status_code, errors, done


def test_the_fail_rate_fails_streams_as_engine_faults() -> None:
    with run_server(*FAST, *BREAKER, "--synthetic-fail-rate", "1") as srv:
        url = srv.v1 + "/chat/completions"
        for _ in range(3):
            status, errors, done = streamed(url)
            assert status == 200 and not done  # never passed off as a finished answer
            assert [e["code"] for e in errors] == ["engine_error"]
            assert "--synthetic-fail-rate" in errors[0]["message"]
        # Three engine faults in three streams: the breaker opens for everyone.
        shed = httpx.post(url, json=CHAT, timeout=10)
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "engine_unavailable"


def test_a_requested_failure_does_not_open_the_breaker() -> None:
    with run_server(*FAST, *BREAKER) as srv:
        url = srv.v1 + "/chat/completions"
        for _ in range(6):
            status, errors, done = streamed(url, synthetic={"fail_after": 2, "error_code": "boom"})
            assert status == 200 and not done and [e["code"] for e in errors] == ["boom"]
            whole = httpx.post(url, json={**CHAT, "synthetic": {"fail_after": 0}}, timeout=10)
            assert whole.status_code == 500
            assert whole.json()["error"]["code"] == "engine_error"
        assert httpx.post(url, json=CHAT, timeout=10).status_code == 200
        assert httpx.get(srv.url + "/readyz", timeout=10).status_code == 200
        assert srv.metric('firsttoken_breaker_state{state="closed"}') == 1
