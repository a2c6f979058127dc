"""Responses that outlive their connection, the OpenAI SDK's way: `background: true`, then
`responses.retrieve(id)`, `retrieve(id, stream=True, starting_after=N)`, `cancel` and
`delete`, with the official openai SDK against real servers (one alone; two on one real
redis-server)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.responses import Response

from firsttoken.engines.synthetic import synthetic_tokens
from tests.redis_server import run_redis
from tests.servers import Server, run_server

KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"

[[keys]]
name = "bob"
key = "sk-bob"
"""
QUESTION = "What outlives its connection?"
TOKENS = 40
SLOW = {"seed": 7, "synthetic": {"itl_ms": 20, "answer_tokens": TOKENS}}
EXPECTED = "".join(synthetic_tokens("user: " + QUESTION, 7, None, TOKENS)[0])
ARGS = ("--synthetic-ttft-ms", "10", "--synthetic-itl-ms", "2")


def client(server: Server, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def keys_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path: Path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    return str(path)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server("--api-keys", keys_file(tmp_path_factory), *ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    keys = keys_file(tmp_path_factory)
    with run_redis() as url:
        args = ("--redis", url, "--api-keys", keys, *ARGS)
        with run_server(*args) as a, run_server(*args) as b:
            yield a, b


def events_of(body: bytes) -> list[bytes]:
    """A Responses event stream's events, as framed (each closed by its blank line)."""
    return [event + b"\n\n" for event in body.split(b"\n\n") if event.strip()]


def first_events(server: Server, count: int, **fields: object) -> tuple[str, list[bytes]]:
    """POST a streamed background response, read `count` events, and drop the connection:
    (its id, those events' bytes)."""
    body = {"model": "synthetic", "input": QUESTION, "stream": True, "background": True}
    headers = {"authorization": "Bearer sk-alice"}
    raw = b""
    with httpx.stream(
        "POST", server.v1 + "/responses", json=body | SLOW | fields, headers=headers, timeout=10
    ) as response:
        assert response.status_code == 200
        response_id = response.headers["x-stream-id"]
        for chunk in response.iter_raw():
            raw += chunk
            if raw.count(b"\n\n") >= count:
                break
    return "resp_" + response_id, events_of(raw)[:count]


def replay(server: Server, response_id: str, after: int | None = None) -> bytes:
    """The response's events (after `after`), read raw from its log."""
    query = "?stream=true" + ("" if after is None else f"&starting_after={after}")
    answer = httpx.get(
        server.v1 + f"/responses/{response_id}{query}",
        headers={"authorization": "Bearer sk-alice"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    return answer.content


def poll(server: Server, response_id: str, key: str = "sk-alice") -> Response:
    sdk = client(server, key)
    deadline = time.monotonic() + 10
    response = sdk.responses.retrieve(response_id)
    while response.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        response = sdk.responses.retrieve(response_id)
    return response


def resumed_on(reader: Server, owner: Server) -> None:
    """The first connection to `owner` drops after 6 events (sequence numbers 0-5); the SDK
    reads on from `reader` with starting_after=5: every later event, byte-exact with the
    stream undisturbed, and the whole answer."""
    response_id, first = first_events(owner, 6)
    assert b'"sequence_number":5}' in first[-1]
    events = list(client(reader).responses.retrieve(response_id, stream=True, starting_after=5))
    assert [e.sequence_number for e in events] == list(range(6, 6 + len(events)))
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    first_text = b"".join(first).decode()
    assert events[-1].response.output_text == EXPECTED
    assert EXPECTED.endswith(text) and text  # the part of the answer after the drop
    # Byte-exact: what the dropped connection got, then the resumed bytes, are the stream
    # as its log holds it, read whole after the end.
    whole = replay(owner, response_id)
    resumed = replay(reader, response_id, after=5)
    assert b"".join(first) + resumed == whole
    assert first_text.encode() == b"".join(events_of(whole)[:6])
    # And alike, ids and times aside, to the same request served undisturbed.
    undisturbed = list(
        client(owner).responses.create(
            model="synthetic", input=QUESTION, stream=True, background=True, extra_body=SLOW
        )
    )
    assert [e.type for e in undisturbed][6:] == [e.type for e in events]
    assert [getattr(e, "delta", None) for e in undisturbed][6:] == [
        getattr(e, "delta", None) for e in events
    ]


def test_background_resumed_with_starting_after_byte_exact(single: Server) -> None:
    resumed_on(single, single)


def test_background_resumed_on_another_instance(pair: tuple[Server, Server]) -> None:
    a, b = pair
    resumed_on(b, a)


def test_background_handle_then_polling_reaches_completed(single: Server) -> None:
    sdk = client(single)
    created = sdk.responses.create(
        model="synthetic", input=QUESTION, background=True, extra_body=SLOW
    )
    assert created.status in ("queued", "in_progress") and created.background
    assert created.id.startswith("resp_") and created.output == [] and created.store
    time.sleep(0.3)  # nobody reads it, and it goes on (--responses-ttl-s)
    assert sdk.responses.retrieve(created.id).status == "in_progress"
    final = poll(single, created.id)
    assert final.status == "completed" and final.output_text == EXPECTED
    assert final.usage is not None and final.usage.output_tokens == TOKENS


def test_background_polled_through_another_instance(pair: tuple[Server, Server]) -> None:
    a, b = pair
    created = client(a).responses.create(
        model="synthetic", input=QUESTION, background=True, extra_body=SLOW
    )
    final = poll(b, created.id)
    assert final.status == "completed" and final.output_text == EXPECTED
    with pytest.raises(openai.NotFoundError):
        client(b, "sk-bob").responses.retrieve(created.id)


def test_cancel_then_delete(single: Server) -> None:
    sdk = client(single)
    long = {"seed": 7, "synthetic": {"itl_ms": 20, "answer_tokens": 500}}
    created = sdk.responses.create(
        model="synthetic", input=QUESTION, background=True, extra_body=long
    )
    time.sleep(0.2)
    cancelled = sdk.responses.cancel(created.id)
    assert cancelled.id == created.id and cancelled.status == "cancelled"
    assert sdk.responses.retrieve(created.id).status == "cancelled"
    events = events_of(replay(single, created.id))
    assert b"response.created" in events[0] and len(events) < 500  # it stopped
    assert b'"status":"cancelled"' in events[-2] and b"event: error" in events[-1]
    deleted = httpx.delete(
        single.v1 + f"/responses/{created.id}", headers={"authorization": "Bearer sk-alice"}
    )
    assert deleted.json() == {"id": created.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(created.id)


def test_another_key_gets_404_for_every_verb(single: Server) -> None:
    created = client(single).responses.create(
        model="synthetic", input=QUESTION, background=True, extra_body=SLOW
    )
    bob = client(single, "sk-bob")
    with pytest.raises(openai.NotFoundError) as info:
        bob.responses.retrieve(created.id)
    assert info.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        list(bob.responses.retrieve(created.id, stream=True, starting_after=0))
    with pytest.raises(openai.NotFoundError):
        bob.responses.cancel(created.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(created.id)
    for unknown in ("resp_nope", "nope"):
        with pytest.raises(openai.NotFoundError):
            client(single).responses.retrieve(unknown)
    # bob's tries changed nothing: alice's response runs to its end.
    assert poll(single, created.id).status == "completed"


@pytest.mark.parametrize("after", ["-1", "x", "1.5", "99999", "²"])
def test_bad_starting_after_is_a_400_naming_it(single: Server, after: str) -> None:
    created = client(single).responses.create(
        model="synthetic", input=QUESTION, background=True, extra_body={"seed": 7}
    )
    poll(single, created.id)
    answer = httpx.get(
        single.v1 + f"/responses/{created.id}",
        params={"stream": "true", "starting_after": after},
        headers={"authorization": "Bearer sk-alice"},
    )
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "starting_after"


def test_background_with_store_false_is_refused(single: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(single).responses.create(
            model="synthetic", input=QUESTION, background=True, store=False
        )
    assert "store" in str(info.value)


def test_cancel_and_delete_through_another_instance(pair: tuple[Server, Server]) -> None:
    a, b = pair
    long = {"seed": 7, "synthetic": {"itl_ms": 20, "answer_tokens": 500}}
    made_on_a = [
        client(a).responses.create(
            model="synthetic", input=QUESTION, background=True, extra_body=long
        )
        for _ in range(2)
    ]
    time.sleep(0.2)
    running, ended = made_on_a
    assert client(b).responses.cancel(ended.id).status == "cancelled"
    assert poll(a, ended.id).status == "cancelled"  # its owner stopped it
    for response in (running, ended):  # deleted through b: gone from both
        client(b).responses.delete(response.id)
        for server in (a, b):
            with pytest.raises(openai.NotFoundError):
                client(server).responses.retrieve(response.id)
    made_on_b = client(b).responses.create(
        model="synthetic", input=QUESTION, background=True, extra_body=SLOW
    )
    assert poll(a, made_on_b.id).status == "completed"
    client(b).responses.delete(made_on_b.id)  # by its owner: gone from the other too
    with pytest.raises(openai.NotFoundError):
        client(a).responses.retrieve(made_on_b.id)


def test_starting_after_past_the_end_through_another_instance(pair: tuple[Server, Server]) -> None:
    a, b = pair
    created = client(a).responses.create(
        model="synthetic", input=QUESTION, background=True, extra_body={"seed": 7}
    )
    final = poll(a, created.id)
    last = len(events_of(replay(a, created.id))) - 1  # the last sequence_number
    assert final.status == "completed" and last > 10
    headers = {"authorization": "Bearer sk-alice"}
    url = b.v1 + f"/responses/{created.id}"
    past = httpx.get(url, params={"stream": "true", "starting_after": last + 1}, headers=headers)
    assert past.status_code == 400 and past.json()["error"]["param"] == "starting_after"
    assert f"(sequence_number {last})" in past.json()["error"]["message"]
    at_end = httpx.get(url, params={"stream": "true", "starting_after": last}, headers=headers)
    assert at_end.status_code == 200 and at_end.content == b""  # all of it was read


def test_a_whole_answer_is_kept_to_read_back_and_delete(pair: tuple[Server, Server]) -> None:
    a, b = pair
    whole = client(a).responses.create(model="synthetic", input=QUESTION, extra_body=SLOW)
    assert whole.status == "completed" and whole.store is True
    for server in (a, b):  # its record, in the shared store
        assert client(server).responses.retrieve(whole.id) == whole
        with pytest.raises(openai.NotFoundError):  # no events to stream: it had none
            list(client(server).responses.retrieve(whole.id, stream=True))
    with pytest.raises(openai.NotFoundError):
        client(a, "sk-bob").responses.retrieve(whole.id)
    client(b).responses.delete(whole.id)
    for server in (a, b):
        with pytest.raises(openai.NotFoundError):
            client(server).responses.retrieve(whole.id)
    unkept = client(a).responses.create(model="synthetic", input=QUESTION, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client(a).responses.retrieve(unkept.id)
