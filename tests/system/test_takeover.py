"""A stream outlives the instance generating it (Redis mode): real instances on one real
redis-server, the owner SIGKILLed, paused (SIGSTOP/SIGCONT) or stopped (SIGTERM) under its
reader, who comes back with Last-Event-ID on another instance and gets the rest of the
answer, byte-exact, from there. (Three instances behind nginx on a Redis Cluster:
`test_instances.py`.)"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
import redis

from firsttoken.engines.synthetic import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from firsttoken.resume.redis_keys import events_key, meta_key
from firsttoken.resume.runs import decode_run
from tests.proxy import CuttableProxy
from tests.rawhttp import RawStream
from tests.redis_server import run_redis
from tests.servers import Server, run_server, wait_for

MAX_TOKENS = 80
COMMON = ("--synthetic-ttft-ms", "30", "--resume-grace-s", "5", "--openai-grace-s", "5")


def read_until(stream: RawStream, tokens: int, marker: bytes = b'{"token":') -> None:
    while stream.body.count(marker) < tokens:
        if not stream.read_chunk():
            raise AssertionError(f"ended early: {stream.body[-300:]!r}")


def read_to_end(stream: RawStream) -> None:
    try:
        while stream.read_chunk():
            pass
    except (ConnectionError, OSError):
        pass  # cut with its instance


def native(body: bytes) -> dict:
    """What a native stream's body says: its tokens, meta events, last id, [DONE], error."""
    decoder = EventDecoder()
    out: dict = {"tokens": [], "meta": [], "done": 0, "error": None}
    for event in decoder.feed(body):
        if event.data == "[DONE]":
            out["done"] += 1
        elif event.event == "error":
            out["error"] = json.loads(event.data or "")["error"]
        elif event.event == "meta":
            out["meta"].append(json.loads(event.data or ""))
        elif event.event is None:
            out["tokens"].append(json.loads(event.data or "")["token"])
    out["last_id"] = decoder.last_event_id
    return out


def create(server: Server, prompt: str, itl_ms: float = 20) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "synthetic": {"itl_ms": itl_ms}}
    r = httpx.post(server.v1 + "/streams", json=body, timeout=10)
    assert r.status_code == 201, r.text
    return r.json()


def resume(server: Server, created: dict, last_id: str) -> tuple[bytes, float]:
    """Read the rest from `server`; and when its first event after the resume came."""
    first_at = 0.0
    body = b""
    with httpx.stream(
        "GET",
        server.url + created["events_url"],
        headers={"Last-Event-ID": last_id},
        timeout=30,
    ) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_raw():
            if not first_at and b'{"token":' in chunk:
                first_at = time.monotonic()
            body += chunk
    return body, first_at


def held_in_redis(url: str, stream_id: str) -> bytes:
    """Every event Redis holds of a stream, in order, to its end."""
    events: list[bytes] = []
    for _, fields in redis.Redis.from_url(url).xrange(events_key(stream_id)):
        if b"end" in fields:
            break
        events += [wire for _, wire, _ in decode_run(fields, len(events))]
    return b"".join(events)


def assert_stopped(server: Server) -> None:
    """Its engine makes nothing more."""
    generated = server.metric("firsttoken_tokens_generated_total")
    time.sleep(0.5)
    assert server.metric("firsttoken_tokens_generated_total") == generated


@pytest.fixture
def redis_url() -> Iterator[str]:
    with run_redis() as url:
        yield url


def instances(url: str, n: int, *extra: str) -> tuple[ExitStack, list[Server]]:
    stack = ExitStack()
    servers = [stack.enter_context(run_server("--redis", url, *COMMON, *extra)) for _ in range(n)]
    return stack, servers


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "not_durable"])
def test_a_sigkilled_owners_stream_is_finished_exact_by_the_instance_its_reader_reaches(
    redis_url: str, durable: bool
) -> None:
    extra = ("--durable",) if durable else ()
    stack, (a, b) = instances(redis_url, 2, *extra)
    with stack:
        created = create(a, "takeover after a kill")
        stream = RawStream(a.port, "GET", created["events_url"])
        read_until(stream, 15)
        if not durable:
            # Only what Redis holds is exact: the reader leaves, and the flush catches up.
            stream.close()
            time.sleep(0.15)
        killed_at = time.monotonic()
        a.kill()
        if durable:
            read_to_end(stream)  # everything it got before the kill, Redis had
        before = native(stream.body)
        body, first_at = resume(b, created, before["last_id"])
        after = native(body)
        expected = synthetic_tokens("takeover after a kill", None, MAX_TOKENS)[0]
        assert before["tokens"] + after["tokens"] == expected
        assert after["done"] == 1 and after["error"] is None
        (takeover,) = [m["takeover"] for m in after["meta"] if "takeover" in m]
        assert takeover["at_token"] >= len(before["tokens"]) and takeover["from"] != takeover["to"]
        finish = [m for m in after["meta"] if "finish_reason" in m][-1]
        # Usage over both instances is an uninterrupted answer's.
        assert finish["finish_reason"] == "length" and finish["usage"]["completion_tokens"] == 80
        seam = first_at - killed_at
        print(f"seam after the kill: {seam * 1000:.0f} ms")
        assert seam < 3.0  # 1.2 s liveness + 0.25 s check + TTFT; the target's p99 is 2 s
        assert b.metric('firsttoken_takeovers_total{outcome="continued"}') == 1


def test_a_reader_ahead_of_redis_is_told_never_given_other_text(redis_url: str) -> None:
    """Without --durable a reader may have events Redis never got: told `stream_lost`."""
    stack, (a, b) = instances(redis_url, 2, "--redis-flush-ms", "1000")
    with stack:
        created = create(a, "ahead of the store")
        stream = RawStream(a.port, "GET", created["events_url"])
        read_until(stream, 15)
        a.kill()
        read_to_end(stream)
        before = native(stream.body)
        r = httpx.get(
            b.url + created["events_url"], headers={"Last-Event-ID": before["last_id"]}, timeout=20
        )
        after = native(r.content)
        assert after["error"]["code"] == "stream_lost" and not after["tokens"]
        assert b.metric('firsttoken_takeovers_total{outcome="lost"}') == 1


def test_sigterm_hands_streams_over_and_exits_within_two_seconds(redis_url: str) -> None:
    stack, (a, b) = instances(redis_url, 2)
    with stack:
        prompts = [f"handed over {i}" for i in range(4)]
        made = [create(a, p, itl_ms=30) for p in prompts]
        streams = [RawStream(a.port, "GET", c["events_url"]) for c in made]
        for s in streams:
            read_until(s, 5)
        started = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        a.proc.wait(timeout=10)
        exited = time.monotonic() - started
        print(f"exited {exited:.2f} s after SIGTERM")
        assert exited <= 2.0
        for prompt, created, s in zip(prompts, made, streams, strict=True):
            read_to_end(s)
            before = native(s.body)
            assert before["done"] == 0 and before["error"] is None  # cut, not ended
            body, _ = resume(b, created, before["last_id"])
            after = native(body)
            expected = synthetic_tokens(prompt, None, MAX_TOKENS)[0]
            assert before["tokens"] + after["tokens"] == expected and after["done"] == 1
        assert b.metric('firsttoken_takeovers_total{outcome="continued"}') == 4


def test_a_paused_owner_finds_its_stream_taken_and_stops_its_engine(redis_url: str) -> None:
    stack, (a, b) = instances(redis_url, 2, "--durable")
    with stack:
        created = create(a, "paused owner", itl_ms=25)
        stream = RawStream(a.port, "GET", created["events_url"])
        read_until(stream, 10)
        stream.close()
        before = native(stream.body)
        a.proc.send_signal(signal.SIGSTOP)
        try:
            body, _ = resume(b, created, before["last_id"])
        finally:
            a.proc.send_signal(signal.SIGCONT)
        after = native(body)
        expected = synthetic_tokens("paused owner", None, MAX_TOKENS)[0]
        assert before["tokens"] + after["tokens"] == expected and after["done"] == 1
        # A's next write was refused: it let the stream go and its engine stopped.
        wait_for(lambda: a.metric("firsttoken_streams_moved_total") == 1, timeout=10)
        assert any('"stream.fenced"' in line for line in a.log)
        assert a.metric("firsttoken_redis_fenced_writes_total") >= 1
        assert_stopped(a)
        # What Redis holds is one answer: no event of A's after the takeover.
        held = native(held_in_redis(redis_url, created["id"]))
        assert held["tokens"] == expected and held["done"] == 1
        fence = redis.Redis.from_url(redis_url).hget(meta_key(created["id"]), "fence")
        assert int(fence) == 2


def test_a_chat_completions_stream_is_taken_over_too(redis_url: str) -> None:
    stack, (a, b) = instances(redis_url, 2, "--durable")
    with stack:
        body = {
            "model": "synthetic",
            "messages": [{"role": "user", "content": "a chat taken over"}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "synthetic": {"itl_ms": 20},
        }
        events = taken_over(a, b, "/v1/chat/completions", body, b'"content":"')
        assert [e.data for e in events].count("[DONE]") == 1
        chunks = [json.loads(e.data) for e in events if e.data != "[DONE]"]
        assert len({c["id"] for c in chunks}) == 1
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        whole = httpx.post(b.v1 + "/chat/completions", json={**body, "stream": False}, timeout=30)
        assert text == whole.json()["choices"][0]["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_an_owner_cut_off_from_redis_finds_its_stream_taken_when_it_is_back(
    redis_url: str,
) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = CuttableProxy(port)
    through = f"redis://127.0.0.1:{proxy.port}/0"
    with (
        run_server("--redis", through, *COMMON, "--durable") as a,
        run_server("--redis", redis_url, *COMMON, "--durable") as b,
    ):
        created = create(a, "partitioned owner", itl_ms=100)
        stream = RawStream(a.port, "GET", created["events_url"])
        read_until(stream, 5)
        stream.close()
        before = native(stream.body)
        proxy.close()  # A goes on generating, alone: nothing of it reaches Redis
        got: dict = {}
        reader = threading.Thread(
            target=lambda: got.update(body=resume(b, created, before["last_id"])[0])
        )
        reader.start()
        wait_for(lambda: b.metric('firsttoken_takeovers_total{outcome="continued"}'), 10)
        proxy.reopen()  # A is back, still generating: its next write is refused
        wait_for(lambda: a.metric("firsttoken_streams_moved_total") == 1, timeout=10)
        assert any('"stream.fenced"' in line for line in a.log)
        reader.join(timeout=30)
        after = native(got["body"])
        expected = synthetic_tokens("partitioned owner", None, MAX_TOKENS)[0]
        assert before["tokens"] + after["tokens"] == expected and after["done"] == 1
        assert_stopped(a)
        # None of A's late events.
        assert native(held_in_redis(redis_url, created["id"]))["tokens"] == expected


def test_a_reader_on_an_owner_cut_off_from_redis_reads_on_then_is_told_it_was_taken(
    redis_url: str,
) -> None:
    """`--durable`, the owner cut off from Redis: it cannot tell that from Redis being away,
    so its reader goes on getting events Redis never confirmed (no stall). Another instance
    takes the stream over from what Redis held; the owner, back, finds its write fenced and
    tells its reader `stream_lost`: it was past the takeover's starting point, and moved
    there it would read on from another text."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = CuttableProxy(port)
    through = f"redis://127.0.0.1:{proxy.port}/0"
    with (
        run_server("--redis", through, *COMMON, "--durable") as a,
        run_server("--redis", redis_url, *COMMON, "--durable") as b,
    ):
        created = create(a, "reader on a cut-off owner", itl_ms=100)
        local = RawStream(a.port, "GET", created["events_url"])
        read_until(local, 5)
        before = native(local.body)
        proxy.close()
        cut_at = time.monotonic()
        read_until(local, len(before["tokens"]) + 5)  # events Redis never got, as they come
        assert time.monotonic() - cut_at < 2.0
        got: dict = {}
        reader = threading.Thread(
            target=lambda: got.update(body=resume(b, created, before["last_id"])[0])
        )
        reader.start()
        wait_for(lambda: b.metric('firsttoken_takeovers_total{outcome="continued"}'), 10)
        proxy.reopen()
        read_to_end(local)
        seen = native(local.body)
        assert seen["error"] is not None and seen["error"]["code"] == "stream_lost"
        assert len(seen["tokens"]) >= len(before["tokens"]) + 5 and not seen["done"]
        wait_for(lambda: any('"stream.fenced"' in line for line in a.log), 5)
        fenced = [json.loads(line) for line in a.log if '"stream.fenced"' in line]
        assert fenced[0]["lost"] is True
        reader.join(timeout=30)
        after = native(got["body"])  # the reader that was behind: exact
        expected = synthetic_tokens("reader on a cut-off owner", None, MAX_TOKENS)[0]
        assert before["tokens"] + after["tokens"] == expected and after["done"] == 1


def test_the_keys_slot_follows_the_stream_and_the_dead_instances_is_given_back(
    redis_url: str, tmp_path
) -> None:
    """A key allowed one stream at a time: the instance that takes its stream over takes the
    slot the dead one held (not waiting out its lease), and frees it at the end."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "alice"\nkey = "sk-alice"\nmax_streams = 1\n')
    stack, (a, b) = instances(redis_url, 2, "--api-keys", str(keys), "--durable")
    auth = {"Authorization": "Bearer sk-alice"}
    with stack:
        body = {"prompt": "one at a time", "max_tokens": 40, "synthetic": {"itl_ms": 20}}
        created = httpx.post(a.v1 + "/streams", json=body, headers=auth, timeout=10).json()
        stream = RawStream(a.port, "GET", created["events_url"])
        read_until(stream, 10)
        a.kill()
        read_to_end(stream)
        before = native(stream.body)
        body_b, _ = resume(b, created, before["last_id"])
        after = native(body_b)
        assert before["tokens"] + after["tokens"] == synthetic_tokens("one at a time", None, 40)[0]
        # Ended on B: the slot is free at once (the dead instance's lease would have held it 5 s).
        again = httpx.post(b.v1 + "/streams", json=body, headers=auth, timeout=10)
        assert again.status_code == 201, again.text


def taken_over(a: Server, b: Server, path: str, body: dict, marker: bytes) -> list:
    """The events of a stream read on A until `marker` came 15 times, A killed, then read on
    from B with the resume token and Last-Event-ID its head gave."""
    stream = RawStream(a.port, "POST", path, body)
    read_until(stream, 15, marker)
    a.kill()
    read_to_end(stream)
    decoder = EventDecoder()
    events = list(decoder.feed(stream.body))
    stream_id, token = stream.headers["x-stream-id"], stream.headers["x-resume-token"]
    r = httpx.get(
        f"{b.v1}/streams/{stream_id}/events?token={token}",
        headers={"Last-Event-ID": decoder.last_event_id},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return events + EventDecoder().feed(r.content)


def test_a_responses_stream_is_taken_over_numbered_as_one(redis_url: str) -> None:
    """Its events are numbered and its closing events repeat the whole text: the renderer
    rebuilt on B from the events A sent numbers on and closes with every character."""
    stack, (a, b) = instances(redis_url, 2, "--durable")
    with stack:
        body = {
            "model": "synthetic",
            "input": "a response taken over",
            "max_output_tokens": MAX_TOKENS,
            "stream": True,
            "synthetic": {"itl_ms": 20, "reasoning_tokens": 5},
        }
        events = taken_over(a, b, "/v1/responses", body, b"response.output_text.delta")
        datas = [json.loads(e.data) for e in events]
        assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
        text = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
        (done,) = [d for d in datas if d["type"] == "response.output_text.done"]
        assert done["text"] == text
        final = datas[-1]["response"]
        whole = httpx.post(b.v1 + "/responses", json={**body, "stream": False}, timeout=30)
        assert whole.status_code == 200
        ids = {item["id"] for item in final["output"]}
        assert len(ids) == len(final["output"])  # one item each, named once
        same = [{k: v for k, v in item.items() if k != "id"} for item in final["output"]]
        assert same == [{k: v for k, v in i.items() if k != "id"} for i in whole.json()["output"]]
        assert final["usage"] == whole.json()["usage"]


def test_a_messages_stream_is_taken_over_with_its_blocks(redis_url: str) -> None:
    stack, (a, b) = instances(redis_url, 2, "--durable")
    with stack:
        body = {
            "model": "synthetic",
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": "a message taken over"}],
            "stream": True,
            "synthetic": {"itl_ms": 20, "reasoning_tokens": 5},
        }
        events = taken_over(a, b, "/v1/messages", body, b'"text_delta"')
        kinds = [e.event for e in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert kinds.count("message_start") == 1 and kinds.count("message_stop") == 1
        datas = [json.loads(e.data) for e in events]
        starts = [d["index"] for d in datas if d["type"] == "content_block_start"]
        stops = [d["index"] for d in datas if d["type"] == "content_block_stop"]
        assert starts == stops == list(range(len(starts)))  # thinking, then text: 0, 1
        text = "".join(
            d["delta"]["text"]
            for d in datas
            if d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta"
        )
        whole = httpx.post(b.v1 + "/messages", json={**body, "stream": False}, timeout=30)
        (block,) = [c for c in whole.json()["content"] if c["type"] == "text"]
        assert text == block["text"]
        (usage,) = [d["usage"] for d in datas if d["type"] == "message_delta"]
        assert usage["output_tokens"] == whole.json()["usage"]["output_tokens"]
