"""Stored conversations with the official openai SDK against real servers (one alone; two on
one real redis-server): `responses.input_items.list(id)` and `previous_response_id`, each
key's own, and the stored-response caps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

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
ARGS = ("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1")
SEED = {"seed": 3}


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


def answer_to(prompt: str) -> str:
    """The synthetic engine's answer to `prompt` (the conversation as "role: text" lines)."""
    return "".join(synthetic_tokens(prompt, SEED["seed"], None, None)[0])


def poll(server: Server, response_id: str) -> openai.types.responses.Response:
    sdk = client(server)
    deadline = time.monotonic() + 10
    response = sdk.responses.retrieve(response_id)
    while response.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        response = sdk.responses.retrieve(response_id)
    return response


def test_previous_response_id_prepends_the_stored_conversation(single: Server) -> None:
    sdk = client(single)
    first = sdk.responses.create(
        model="synthetic", input="My name is Ada.", instructions="Be brief.", extra_body=SEED
    )
    assert first.output_text == answer_to("system: Be brief.\nuser: My name is Ada.")
    second = sdk.responses.create(
        model="synthetic",
        input="What is my name?",
        previous_response_id=first.id,
        extra_body=SEED,
    )
    assert second.previous_response_id == first.id
    # The engine saw the first turn and its answer (not its instructions: OpenAI's rule).
    seen = f"user: My name is Ada.\nassistant: {first.output_text}\nuser: What is my name?"
    assert second.output_text == answer_to(seen)
    items = list(sdk.responses.input_items.list(second.id, order="asc"))
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items[1].id == first.output[0].id  # the earlier output, by its own id
    assert items[2].content[0].text == "What is my name?"
    third = sdk.responses.create(
        model="synthetic", input="And then?", previous_response_id=second.id, extra_body=SEED
    )
    assert len(list(sdk.responses.input_items.list(third.id))) == 5  # the chain, grown


def test_input_items_pages_as_the_sdk_asks(single: Server) -> None:
    sdk = client(single)
    messages = [{"role": "user", "content": f"message {n}"} for n in range(5)]
    created = sdk.responses.create(model="synthetic", input=messages, extra_body=SEED)
    page = sdk.responses.input_items.list(created.id, limit=2)
    assert page.has_more is True and len(page.data) == 2
    assert page.data[0].content[0].text == "message 4"  # desc by default, as OpenAI's
    assert [i.content[0].text for i in page] == [f"message {n}" for n in (4, 3, 2, 1, 0)]
    asc = sdk.responses.input_items.list(created.id, order="asc", limit=100)
    assert [i.content[0].text for i in asc.data] == [f"message {n}" for n in range(5)]
    assert asc.first_id == asc.data[0].id and asc.last_id == asc.data[-1].id
    assert asc.has_more is False
    headers = {"authorization": "Bearer sk-alice"}
    url = f"{single.v1}/responses/{created.id}/input_items"
    for query, param in (
        ({"limit": "0"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "msg_nope"}, "after"),
    ):
        refused = httpx.get(url, params=query, headers=headers)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_another_key_deleted_or_unknown_is_not_found(single: Server) -> None:
    sdk = client(single)
    created = sdk.responses.create(model="synthetic", input="hello", extra_body=SEED)
    bob = client(single, "sk-bob")
    with pytest.raises(openai.NotFoundError):
        bob.responses.input_items.list(created.id)
    with pytest.raises(openai.NotFoundError) as info:
        bob.responses.create(model="synthetic", input="hi", previous_response_id=created.id)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    for unknown in ("resp_nope", "nope"):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(model="synthetic", input="hi", previous_response_id=unknown)
    sdk.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.input_items.list(created.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model="synthetic", input="hi", previous_response_id=created.id)
    unstored = sdk.responses.create(model="synthetic", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.input_items.list(unstored.id)


def test_a_running_response_cannot_be_continued_yet(single: Server) -> None:
    sdk = client(single)
    slow = {"seed": 3, "synthetic": {"itl_ms": 20, "answer_tokens": 200}}
    running = sdk.responses.create(model="synthetic", input="go", background=True, extra_body=slow)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model="synthetic", input="next", previous_response_id=running.id)
    assert "still" in info.value.message
    sdk.responses.cancel(running.id)


def test_streamed_background_continued_on_another_instance(pair: tuple[Server, Server]) -> None:
    a, b = pair
    started = client(a).responses.create(
        model="synthetic", input="Remember 42.", background=True, extra_body=SEED
    )
    first = poll(a, started.id)
    assert first.status == "completed"
    items = list(client(b).responses.input_items.list(started.id))
    assert [i.content[0].text for i in items] == ["Remember 42."]
    with pytest.raises(openai.NotFoundError):
        client(b, "sk-bob").responses.input_items.list(started.id)
    second = client(b).responses.create(
        model="synthetic",
        input="What did I say?",
        previous_response_id=started.id,
        extra_body=SEED,
        stream=False,
    )
    seen = f"user: Remember 42.\nassistant: {first.output_text}\nuser: What did I say?"
    assert second.output_text == answer_to(seen)
    # And back on the first instance, from the second's record.
    third = client(a).responses.create(
        model="synthetic", input="Again?", previous_response_id=second.id, extra_body=SEED
    )
    assert len(list(client(a).responses.input_items.list(third.id))) == 5


def test_a_key_over_its_stored_responses_cap_is_refused_whole(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    keys = keys_file(tmp_path_factory)
    caps = ("--responses-max-per-key", "2", "--responses-max-bytes-per-key", "4000")
    with run_server("--api-keys", keys, *caps, *ARGS) as server:
        sdk = client(server)
        kept = [sdk.responses.create(model="synthetic", input="q", extra_body=SEED) for _ in "ab"]
        with pytest.raises(openai.RateLimitError) as full:
            sdk.responses.create(model="synthetic", input="q", extra_body=SEED)
        assert full.value.body["param"] == "store"  # type: ignore[index]
        assert "--responses-max-per-key" in full.value.message
        sdk.responses.create(model="synthetic", input="q", store=False)  # nothing to keep
        client(server, "sk-bob").responses.create(model="synthetic", input="q")  # its own
        sdk.responses.delete(kept[0].id)
        sdk.responses.create(model="synthetic", input="q", extra_body=SEED)  # room again
        with pytest.raises(openai.BadRequestError) as large:
            client(server, "sk-bob").responses.create(model="synthetic", input="x" * 5000)
        assert large.value.body["param"] == "input"  # type: ignore[index]


def test_a_relayed_upstream_gets_the_whole_conversation(tmp_path: Path) -> None:
    with run_server(*ARGS) as upstream:
        routes = tmp_path / "routes.toml"
        routes.write_text(
            f'[targets.up]\nkind = "openai"\nurl = "{upstream.v1}"\nmodel = "synthetic"\n\n'
            '[models.relayed]\ntargets = ["up"]\n'
        )
        with run_server("--routes", str(routes)) as gateway:
            sdk = client(gateway)
            first = sdk.responses.create(model="relayed", input="My name is Ada.", extra_body=SEED)
            second = sdk.responses.create(
                model="relayed",
                input="What is my name?",
                previous_response_id=first.id,
                extra_body=SEED,
            )
            direct = client(upstream).chat.completions.create(
                model="synthetic",
                messages=[
                    {"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"},
                ],
                seed=SEED["seed"],
            )
            assert second.output_text == direct.choices[0].message.content
