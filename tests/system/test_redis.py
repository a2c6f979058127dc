"""Two gateway instances sharing a real Redis: resume on the other one, cancel from it, and
find a stream there that was created while Redis was slow."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from firsttoken.client import Client
from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.rawhttp import RawStream
from tests.redis_server import RedisServer, redis_server
from tests.servers import Server, run_server, wait_for

GENERATED = "firsttoken_tokens_generated_total"


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture(scope="module")
def pair(redis: RedisServer) -> Iterator[tuple[Server, Server]]:
    args = (
        "--redis",
        redis.url,
        "--synthetic-ttft-ms",
        "10",
        "--synthetic-itl-ms",
        "15",
        "--resume-grace-s",
        "2",
        "--openai-grace-s",
        "2",
        "--rate-limit-per-s",  # no shared bucket: admission asks Redis nothing
        "0",
    )
    with run_server(*args) as a, run_server(*args) as b:
        yield a, b


def tokens_of(body: bytes) -> tuple[list[str], str, bool]:
    decoder = EventDecoder()
    tokens, done = [], False
    for event in decoder.feed(body):
        if event.data == "[DONE]":
            done = True
        elif event.event is None:
            tokens.append(json.loads(event.data)["token"])
    return tokens, decoder.last_event_id, done


def test_start_on_a_resume_on_b_token_exact(pair: tuple[Server, Server]) -> None:
    a, b = pair
    created = httpx.post(
        a.v1 + "/streams", json={"prompt": "shared", "max_tokens": 60}, timeout=10
    ).json()
    s = RawStream(a.port, "GET", created["events_url"])
    while s.body.count(b'{"token":') < 10:
        s.read_chunk()
    s.close()
    first, last_id, _ = tokens_of(s.body)
    r = httpx.get(b.url + created["events_url"], headers={"Last-Event-ID": last_id}, timeout=20)
    rest, _, done = tokens_of(r.content)
    assert r.status_code == 200 and done
    assert first + rest == synthetic_tokens("shared", None, 60)[0]
    # A finished stream replays from B too, and a wrong token is refused there as well.
    assert tokens_of(httpx.get(b.url + created["events_url"], timeout=10).content)[0] == (
        first + rest
    )
    wrong = httpx.get(f"{b.v1}/streams/{created['id']}/events?token=nope", timeout=10)
    assert wrong.status_code == 404


def test_client_follows_a_stream_from_one_instance_to_the_other(
    pair: tuple[Server, Server],
) -> None:
    a, b = pair
    with Client(a.url) as ca:
        answer = ca.chat([{"role": "user", "content": "x"}], max_tokens=30)
        it = iter(answer)
        got = [next(it) for _ in range(5)]
    with Client(b.url) as cb:
        rest = cb.resume(answer.stream_id, answer.resume_token, answer.last_event_id)
        got += list(rest)
    assert got == synthetic_tokens("user: x", None, 30)[0]


def test_cancel_via_b_stops_engine_on_a(pair: tuple[Server, Server]) -> None:
    a, b = pair
    created = httpx.post(a.v1 + "/streams", json={"prompt": "cancel across"}, timeout=10).json()
    wait_for(lambda: a.metric("firsttoken_active_streams") >= 1)
    r = httpx.post(
        f"{b.v1}/streams/{created['id']}/cancel?token={created['resume_token']}", timeout=10
    )
    assert r.status_code == 200 and r.json()["outcome"] == "cancelled"
    stopped = a.metric(GENERATED)
    time.sleep(0.3)
    assert a.metric(GENERATED) == stopped
    assert a.metric('firsttoken_streams_total{outcome="cancelled"}') >= 1


def test_reader_on_b_keeps_stream_on_a_alive(pair: tuple[Server, Server]) -> None:
    a, b = pair
    created = httpx.post(
        a.v1 + "/streams", json={"prompt": "long", "max_tokens": 250}, timeout=10
    ).json()
    # Nobody reads on A; B reads the whole answer (~3.8 s), past A's 2 s grace window.
    r = httpx.get(b.url + created["events_url"], timeout=30)
    tokens, _, done = tokens_of(r.content)
    assert done and tokens == synthetic_tokens("long", None, 250)[0]


def test_a_stream_created_while_redis_is_slow_is_out_at_once_and_found_on_b(
    redis: RedisServer, pair: tuple[Server, Server]
) -> None:
    """A native stream's id waited for Redis to hold its meta: up to 1 s while Redis
    restarted. Now it is out at once; B, asked for it before the meta lands, waits for it."""
    a, b = pair
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)  # Redis answers nothing until SIGCONT
    paused = time.monotonic()
    try:
        started = time.monotonic()
        created = httpx.post(
            a.v1 + "/streams", json={"prompt": "paused", "max_tokens": 20}, timeout=10
        ).json()
        took = time.monotonic() - started
        read: list[httpx.Response] = []
        reader = threading.Thread(
            target=lambda: read.append(httpx.get(b.url + created["events_url"], timeout=20))
        )
        reader.start()
        # Under the owner's liveness TTL (1.2 s): A is not taken for dead meanwhile.
        time.sleep(max(0.0, paused + 0.8 - time.monotonic()))
    finally:
        redis.proc.send_signal(signal.SIGCONT)
    reader.join(30)
    assert took < 0.5  # before: ~0.8 s, until Redis answered
    assert read and read[0].status_code == 200, read and read[0].text
    tokens, _, done = tokens_of(read[0].content)
    assert done and tokens == synthetic_tokens("paused", None, 20)[0]


def test_a_streamed_response_created_while_redis_is_slow_starts_at_once_and_is_stored(
    redis: RedisServer, pair: tuple[Server, Server]
) -> None:
    """A streamed Responses create stored its input in Redis before its first event: up to
    ~1 s while Redis came back from a restart (the production day's slowest first tokens).
    Now the input is stored beside the stream, and is there once Redis answers."""
    a, _ = pair
    assert redis.proc is not None
    body = {
        "model": "synthetic",
        "input": "paused response",
        "stream": True,
        "max_output_tokens": 5,
    }
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with httpx.stream("POST", a.v1 + "/responses", json=body, timeout=10) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(lines)
            took = time.monotonic() - started
            events = [first, *lines]
    finally:
        redis.proc.send_signal(signal.SIGCONT)
    assert took < 0.5, took  # before: ~1 s, until Redis answered
    created = json.loads(next(e for e in events if e.startswith("data: "))[6:])
    response_id = created["response"]["id"]
    ended = {e.removeprefix("event: ") for e in events if e.startswith("event: ")}
    assert "response.incomplete" in ended, events[-4:]  # max_output_tokens reached: whole

    def stored() -> bool:
        items = httpx.get(f"{a.v1}/responses/{response_id}/input_items", timeout=10)
        return items.status_code == 200 and items.json()["data"][0]["content"][0]["text"] == (
            "paused response"
        )

    wait_for(stored, timeout=10)
