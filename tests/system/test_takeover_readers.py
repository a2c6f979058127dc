"""Every reader of a stream taken over gets exactly its answer, or is told (`stream_lost`):
real instances on one real redis-server, two readers of one stream on two instances, the
owner SIGKILLed or paused (SIGSTOP/SIGCONT) under them, each reader coming back with its
Last-Event-ID on a third instance."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from firsttoken.engines.synthetic import synthetic_tokens
from tests.proxy import CuttableProxy
from tests.rawhttp import RawStream
from tests.servers import Server, run_server, wait_for
from tests.system.test_takeover import (
    COMMON,
    MAX_TOKENS,
    create,
    instances,
    native,
    read_until,
    redis_url,  # noqa: F401 (a fixture)
    resume,
)


def read_while(stream: RawStream, seconds: float) -> bool:
    """Read for up to `seconds`; True once the response ended (or its connection)."""
    deadline = time.monotonic() + seconds
    stream.sock.settimeout(0.5)
    while time.monotonic() < deadline:
        try:
            if not stream.read_chunk():
                return True
        except TimeoutError:
            continue
        except (ConnectionError, OSError):
            return True
    return False


def assert_exact_or_told(prompt: str, before: dict, after: dict) -> str:
    """The reader's text is the answer, or the part it had then `stream_lost`: never a
    different text that ends as if complete."""
    expected = synthetic_tokens(prompt, None, MAX_TOKENS)[0]
    if after["error"] is not None:
        assert after["error"]["code"] == "stream_lost", after["error"]
        assert not after["tokens"] and after["done"] == 0, after
        assert before["tokens"] == expected[: len(before["tokens"])]
        return "told"
    assert before["tokens"] + after["tokens"] == expected, (before["tokens"], after["tokens"])
    assert after["done"] == 1
    return "exact"


def test_a_reader_ahead_of_redis_resuming_after_another_readers_takeover_is_told(
    redis_url: str,  # noqa: F811
) -> None:
    """Reader 1 reads on A; reader 2 reads the same stream through B. A is cut off from
    Redis, goes on a moment (reader 1 gets events Redis never does, as it may for a flush
    interval before any kill), and is killed: B's reader claims and B continues. Reader 1
    comes back on C after B went on: it is told `stream_lost` (its last events were A's,
    not B's), never B's text stitched after A's. Reader 2, cut later, resumes on C exact."""
    url = redis_url
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    proxy = CuttableProxy(port)
    with run_server("--redis", f"redis://127.0.0.1:{proxy.port}/0", *COMMON) as a:
        stack, (b, c) = instances(url, 2)
        with stack:
            prompts = [f"two readers {i}" for i in range(3)]
            made = [create(a, p, itl_ms=20) for p in prompts]
            ones = [RawStream(a.port, "GET", m["events_url"]) for m in made]
            twos = [RawStream(b.port, "GET", m["events_url"]) for m in made]
            for one in ones:
                read_until(one, 10)
            proxy.close()  # what A makes from now on reaches its readers only
            for one in ones:
                read_until(one, 20)
            a.kill()
            # B's readers make B claim and go on; they read B's events for a while.
            for two in twos:
                read_until(two, 30)
            time.sleep(0.3)
            outcomes = []
            for prompt, created, one in zip(prompts, made, ones, strict=True):
                read_while(one, 0.1)
                before = native(one.body)
                body, _ = resume(c, created, before["last_id"])
                outcomes.append(assert_exact_or_told(prompt, before, native(body)))
            print(f"A's readers, back on C after B's takeover: {outcomes}")
            assert outcomes == ["told"] * 3
            for prompt, created, two in zip(prompts, made, twos, strict=True):
                two.close()
                before = native(two.body)
                body, _ = resume(c, created, before["last_id"])
                assert assert_exact_or_told(prompt, before, native(body)) == "exact"


def resumed_or_refused(server: Server, created: dict, last_id: str) -> dict:
    """What a reader back on `server` gets: the rest of the stream, or a 409 `stream_lost`
    before the first byte (its last event is not the one the instance has of that seq)."""
    r = httpx.get(
        server.url + created["events_url"], headers={"Last-Event-ID": last_id}, timeout=30
    )
    if r.status_code == 409:
        return {"tokens": [], "done": 0, "error": r.json()["error"]}
    assert r.status_code == 200, r.text
    return native(r.content)


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "not_durable"])
def test_a_paused_owners_reader_is_let_go_and_finishes_on_the_new_owner(
    redis_url: str,  # noqa: F811
    durable: bool,
) -> None:
    """A is stopped 2.5 s under two readers, one on A and one through B; B's claims and
    finishes the stream. A, back, finds its writes refused: its own reader's connection
    ends (no terminal event), and that reader resumes on B: with --durable it gets exactly
    the rest (it saw nothing Redis lacked); without, exactly the rest or `stream_lost` (it
    may have read what A made after the claim), never A's text with B's after it."""
    stack, (a, b) = instances(redis_url, 2, *(("--durable",) if durable else ()))
    with stack:
        prompt = "paused under two readers"
        created = create(a, prompt, itl_ms=25)
        one = RawStream(a.port, "GET", created["events_url"])
        read_until(one, 10)
        got: dict = {}
        a.proc.send_signal(signal.SIGSTOP)
        try:
            two = threading.Thread(
                target=lambda: got.update(body=resume(b, created, "")[0]), daemon=True
            )
            two.start()
            wait_for(lambda: b.metric('firsttoken_takeovers_total{outcome="continued"}'), 10)
            time.sleep(1.0)  # paused 2.5 s or more in all
        finally:
            a.proc.send_signal(signal.SIGCONT)
        two.join(timeout=30)
        expected = synthetic_tokens(prompt, None, MAX_TOKENS)[0]
        assert native(got["body"])["tokens"] == expected
        assert read_while(one, 10), "A's reader was left hanging on A"
        before = native(one.body)
        assert before["done"] == 0 and before["error"] is None
        after = resumed_or_refused(b, created, before["last_id"])
        told = assert_exact_or_told(prompt, before, after)
        print(f"A's reader, back on B after A was fenced: {told}")
        assert told == "exact" or not durable
