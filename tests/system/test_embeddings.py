"""`POST /v1/embeddings` with the official openai SDK: the synthetic engine's vectors; a
route's targets in order (the first one down, the next answers), the answer equal to the
upstream's own; behind the keys, budgets and the ledger like any request."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.nginx import free_port
from tests.servers import Server, run_server, wait_for

ADMIN = "embeddings-admin"
ROUTES = """
[targets.down]
kind = "openai"
url = "http://127.0.0.1:{dead}/v1"
model = "synthetic"
price = {{ prompt = 0.1, completion = 1 }}

[targets.up]
kind = "openai"
url = "{upstream}"
model = "synthetic"
price = {{ prompt = 0.02, completion = 1 }}

[models.embed]
targets = ["down", "up"]
"""
KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"

[[keys]]
name = "broke"
key = "sk-broke"
budget = { amount = 0, per = "day" }
"""
TEXTS = ["the first token", "arrives soon", "streams are resumable"]


def client(server: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def test_the_synthetic_engine_embeds_the_same_inputs_the_same_way(server: Server) -> None:
    # The SDK asks for base64 unless told otherwise, and decodes it.
    packed = client(server).embeddings.create(model="synthetic", input=TEXTS)
    floats = client(server).embeddings.create(
        model="synthetic", input=TEXTS, encoding_format="float"
    )
    assert [d.embedding for d in packed.data] == [d.embedding for d in floats.data]
    assert [d.index for d in floats.data] == [0, 1, 2] and len(floats.data[0].embedding) == 256
    assert floats.data[0].embedding != floats.data[1].embedding
    assert floats.usage.prompt_tokens == 3 + 2 + 3 and floats.model == "synthetic"
    short = client(server).embeddings.create(model="synthetic", input="x", dimensions=8)
    assert len(short.data[0].embedding) == 8


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp: Path = tmp_path_factory.mktemp("embeddings")
    with run_server() as upstream:
        routes, keys = tmp / "routes.toml", tmp / "keys.toml"
        routes.write_text(ROUTES.format(dead=free_port(), upstream=upstream.v1))
        keys.write_text(KEYS)
        args = ("--routes", str(routes), "--api-keys", str(keys), "--admin-key-env", "EMB_ADMIN")
        db = f"sqlite:///{tmp / 'usage.db'}"
        with run_server(*args, "--usage-db", db, env={"EMB_ADMIN": ADMIN}) as gateway:
            yield gateway, upstream


def usage(server: Server, **params: str) -> dict[str, Any]:
    r = httpx.get(
        server.v1 + "/usage", params=params, headers={"authorization": f"Bearer {ADMIN}"}
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_routes_embeddings_equal_its_upstreams_and_the_ledger_bills_their_tokens(
    routed: tuple[Server, Server],
) -> None:
    gateway, upstream = routed
    through = client(gateway, "sk-alice").embeddings.create(model="embed", input=TEXTS)
    direct = client(upstream).embeddings.create(model="synthetic", input=TEXTS)
    assert [d.embedding for d in through.data] == [d.embedding for d in direct.data]
    assert through.model == "embed" and through.usage.prompt_tokens == direct.usage.prompt_tokens
    # The first target is down: the second answered, and its price is the one paid.
    wait_for(lambda: usage(gateway)["total"]["requests"] >= 1)
    (row,) = usage(gateway, by="target")["rows"]
    assert row["target"] == "up" and row["prompt_tokens"] == direct.usage.prompt_tokens
    assert row["completion_tokens"] == 0
    assert Decimal(row["cost"]) == Decimal(direct.usage.prompt_tokens) * Decimal("0.02") / 10**6


def test_embeddings_are_behind_the_keys_and_their_budgets(routed: tuple[Server, Server]) -> None:
    gateway, _ = routed
    with pytest.raises(openai.AuthenticationError):
        client(gateway, "sk-nobody").embeddings.create(model="embed", input="x")
    with pytest.raises(openai.RateLimitError) as refused:
        client(gateway, "sk-broke").embeddings.create(model="embed", input="x")
    assert "budget" in str(refused.value)
    with pytest.raises(openai.NotFoundError):
        client(gateway, "sk-alice").embeddings.create(model="no-such-model", input="x")
    bad = httpx.post(
        gateway.v1 + "/embeddings",
        json={"model": "embed", "input": []},
        headers={"authorization": "Bearer sk-alice"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
