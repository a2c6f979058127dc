"""Two tiers on loopback: an edge firsttoken (canned greetings, a small in-process model that
starts answers) in front of a center firsttoken (the big model, slower to its first token).
The hand-off's text must equal the center's own uninterrupted answer (both tiers are the same
synthetic model here), and resume, cancel and an unreachable center must stay honest."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from firsttoken.formats.sse import EventDecoder
from tests.servers import Server, run_server, wait_for
from tests.upstreams import free_port

CENTER = ("--synthetic-ttft-ms", "300", "--synthetic-itl-ms", "5", "--ttft-slo-ms", "0")
BODY = {"messages": [{"role": "user", "content": "Tell me about tides."}], "max_tokens": 40}
GENERATED = "firsttoken_tokens_generated_total"
# The hand-off by count alone (no prefill, no pace): the tests below that place the seam.
BY_COUNT = ", prefill = false, pace_ms = 0"


def _routes(tmp: Path, center_url: str, *, fallback: bool = True, seam: str = BY_COUNT) -> str:
    path = tmp / f"routes-{fallback}-{len(seam)}.toml"
    path.write_text(
        f"""
[targets.small]
kind = "synthetic"
ttft_ms = 20
itl_ms = 5

[targets.center]
kind = "openai"
url = "{center_url}"
model = "synthetic"
continuation = "vllm"
first_token_timeout_s = 5

[models.chat]
targets = ["center"]
handoff = {{ from = "small", after_tokens = 8, fallback = {str(fallback).lower()}{seam} }}
"""
    )
    return str(path)


@pytest.fixture(scope="module")
def center() -> Iterator[Server]:
    with run_server(*CENTER, "--rate-limit-per-s", "0") as s:
        yield s


@pytest.fixture(scope="module")
def edge(center: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("edge")
    canned = tmp / "canned.toml"
    canned.write_text('[answers]\n"hi" = "Hello! How can I help you today?"\n')
    with run_server("--routes", _routes(tmp, center.v1), "--canned-answers", str(canned)) as s:
        yield s


def _center_answer(center: Server) -> str:
    resp = httpx.post(center.v1 + "/chat/completions", json={**BODY, "model": "synthetic"})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def test_a_greeting_is_answered_at_the_edge(edge: Server, center: Server) -> None:
    before = center.metric(GENERATED)
    client = openai.OpenAI(base_url=edge.v1, api_key="x", max_retries=0)
    answer = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hi!"}]
    )
    assert answer.choices[0].message.content == "Hello! How can I help you today?"
    assert center.metric(GENERATED) == before  # the center made nothing


def test_the_hand_off_equals_the_centers_own_answer(edge: Server, center: Server) -> None:
    expected = _center_answer(center)
    client = openai.OpenAI(base_url=edge.v1, api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="chat", stream=True, stream_options={"include_usage": True}, **BODY
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 40
    handoffs = [r for r in edge.log_records() if r["event"] == "route.handoff"]
    assert handoffs and handoffs[-1]["at_token"] == 8
    assert edge.metric('firsttoken_handoffs_total{route="chat"}') >= 1


def _native(server: Server, body: dict, params: dict | None = None) -> tuple[list, dict]:
    created = httpx.post(server.v1 + "/streams", json=body)
    assert created.status_code == 201, created.text
    info = created.json()
    return _read(server, info, params or {}), info


def _read(server: Server, info: dict, params: dict, stop_after: int | None = None) -> list:
    events: list[tuple[str | None, str | None, str]] = []
    decoder = EventDecoder()
    url = server.url + info["events_url"]
    with httpx.stream(
        "GET", url, params={"token": info["resume_token"], **params}, timeout=30
    ) as resp:
        assert resp.status_code == 200
        for raw in resp.iter_raw():
            for e in decoder.feed(raw):
                if e.data is not None:
                    events.append((e.event, e.id, e.data))
            tokens = [x for x in events if x[0] is None and x[2] != "[DONE]"]
            if stop_after is not None and len(tokens) >= stop_after:
                return events
    return events


def _text(events: list) -> str:
    return "".join(json.loads(d)["token"] for n, _, d in events if n is None and d != "[DONE]")


def test_resume_across_the_tiers(edge: Server) -> None:
    body = {"prompt": "Tell me about tides.", "model": "chat", "max_tokens": 40}
    created = httpx.post(edge.v1 + "/streams", json=body).json()
    first = _read(edge, created, {}, stop_after=12)  # past the hand-off at 8
    last_id = [i for n, i, d in first if n is None][-1]
    rest = _read(edge, created, {"last_event_id": last_id})
    whole, _ = _native(edge, body)
    assert _text(first) + _text(rest) == _text(whole)
    assert rest[-1][2] == "[DONE]"
    metas = [json.loads(d) for n, _, d in whole if n == "meta"]
    assert [m["handoff"]["at_token"] for m in metas if "handoff" in m] == [8]


def test_cancel_reaches_the_center(edge: Server, center: Server) -> None:
    body = {"prompt": "Tell me a long story.", "model": "chat", "max_tokens": 2000}
    created = httpx.post(edge.v1 + "/streams", json=body).json()
    _read(edge, created, {}, stop_after=20)  # the center has the answer by now
    before = center.metric('firsttoken_streams_total{outcome="disconnected"}')
    cancel = httpx.post(
        edge.url + created["events_url"].replace("/events", "/cancel"),
        headers={"authorization": f"Bearer {created['resume_token']}"},
    )
    assert cancel.status_code < 300, cancel.text
    wait_for(
        lambda: center.metric('firsttoken_streams_total{outcome="disconnected"}') > before,
        timeout=10,
    )


@pytest.mark.parametrize("fallback", [True, False])
def test_a_dead_center_during_the_edges_part(tmp_path: Path, fallback: bool) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with run_server("--routes", _routes(tmp_path, dead, fallback=fallback)) as gw:
        body = {"prompt": "Tell me about tides.", "model": "chat", "max_tokens": 40}
        events, _ = _native(gw, body)
        metas = [json.loads(d) for n, _, d in events if n == "meta"]
        handoff = [m["handoff"] for m in metas if "handoff" in m]
        if fallback:
            # The edge finished the answer itself, and said so.
            assert events[-1][2] == "[DONE]"
            assert handoff == [{"from": "small", "to": "small", "at_token": 8, "fallback": True}]
            assert any(r["event"] == "route.handoff_fallback" for r in gw.log_records())
            tokens = [d for n, _, d in events if n is None and d != "[DONE]"]
            assert len(tokens) == 40
        else:
            errors = [json.loads(d)["error"] for n, _, d in events if n == "error"]
            assert [e["code"] for e in errors] == ["upstream_unavailable"]
            assert events[-1][2] != "[DONE]" and handoff == []
            assert _text(events)  # what the edge said is kept


SLOW_CENTER = ("--synthetic-ttft-ms", "900", "--synthetic-itl-ms", "20", "--ttft-slo-ms", "0")
# The center continues the edge's text whatever it is, and its TTFT is its prefill's.
KNOBS = {"continue_any": True, "prefix_cache": True}


def _timed_chat(server: Server, model: str) -> tuple[list[float], str]:
    """The arrival times of the content chunks of one streamed chat answer, and its text."""
    import time

    body = {**BODY, "max_tokens": 60, "model": model, "stream": True, "synthetic": KNOBS}
    times: list[float] = []
    text = ""
    start = time.monotonic()
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        decoder = EventDecoder()
        for raw in resp.iter_raw():
            for e in decoder.feed(raw):
                if e.data is None or e.data == "[DONE]":
                    continue
                chunk = json.loads(e.data)
                piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if piece:
                    times.append(time.monotonic() - start)
                    text += piece
    return times, text


def test_a_slow_center_takes_over_without_the_pause_of_a_hand_off_by_count(
    tmp_path: Path,
) -> None:
    with run_server(*SLOW_CENTER, "--rate-limit-per-s", "0") as slow:
        path = tmp_path / "seam.toml"
        path.write_text(
            f"""
[targets.small]
kind = "synthetic"
ttft_ms = 20
itl_ms = 10

[targets.center]
kind = "openai"
url = "{slow.v1}"
model = "synthetic"
continuation = "vllm"

[models.seamless]
targets = ["center"]
handoff = {{ from = "small", after_tokens = 40 }}

[models.counted]
targets = ["center"]
handoff = {{ from = "small", after_tokens = 8{BY_COUNT} }}
"""
        )
        with run_server("--routes", str(path)) as gw:
            counted, counted_text = _timed_chat(gw, "counted")  # first: nothing cached yet
            expected = httpx.post(
                slow.v1 + "/chat/completions",
                json={**BODY, "max_tokens": 60, "model": "synthetic", "synthetic": KNOBS},
                timeout=30,
            ).json()["choices"][0]["message"]["content"]
            seamless = [_timed_chat(gw, "seamless") for _ in range(3)]
            handoffs = [r for r in gw.log_records() if r["event"] == "route.handoff"]
    assert counted_text == expected
    assert all(text == expected for _, text in seamless)

    def longest(times: list[float]) -> float:
        return max(b - a for a, b in itertools.pairwise(times))

    assert longest(counted) > 0.8  # by count: the center's whole TTFT at the seam
    for times, _ in seamless:
        assert times[0] < 0.5  # the edge's first token
        assert longest(times) < 0.3, longest(times)  # prefilled and paced: no freeze
    assert handoffs[0]["at_token"] == 8
    # The first answer finds the center's prefill time unknown (after_tokens bounds it); later
    # ones know it, and hand off by time.
    assert all(h["at_token"] < 40 for h in handoffs[2:]), [h["at_token"] for h in handoffs]


def test_a_dead_center_with_the_seams_prefill_leaves_the_edge_to_finish(tmp_path: Path) -> None:
    # The prefill fails at once (nothing listens): the hand-off goes by after_tokens, the
    # center cannot take it, and the edge finishes, its text paced but whole.
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with run_server("--routes", _routes(tmp_path, dead, seam="")) as gw:
        body = {"prompt": "Tell me about tides.", "model": "chat", "max_tokens": 40}
        events, _ = _native(gw, body)
        records = gw.log_records()
    assert events[-1][2] == "[DONE]"
    tokens = [d for n, _, d in events if n is None and d != "[DONE]"]
    assert len(tokens) == 40
    metas = [json.loads(d) for n, _, d in events if n == "meta"]
    assert [m["handoff"] for m in metas if "handoff" in m] == [
        {"from": "small", "to": "small", "at_token": 8, "fallback": True}
    ]
    assert any(r["event"] == "route.prefill_failed" for r in records)
