"""`POST /v1/moderations` with the official openai SDK: the synthetic engine's deterministic
moderations; a route's targets that declare `serves = ["moderations"]`, in order (the first
one down, the next answers), the answer equal to the upstream's own (a second firsttoken
server); a target that does not declare it refuses, naming the endpoint; behind the keys,
budgets and the ledger like any request."""

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

ADMIN = "moderations-admin"
ROUTES = """
[targets.down]
kind = "openai"
url = "http://127.0.0.1:{dead}/v1"
model = "synthetic"
serves = ["moderations"]

[targets.up]
kind = "openai"
url = "{upstream}"
model = "synthetic"
serves = ["embeddings", "moderations"]
price = {{ prompt = 0.5, completion = 1 }}

[targets.chat_only]
kind = "openai"
url = "{upstream}"
model = "synthetic"

[models.omni-moderation-latest]
targets = ["down", "up"]

[models.chat]
targets = ["chat_only"]
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
TEXTS = ["a calm afternoon by the river", "a story of violence"]


def client(server: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def test_the_synthetic_engine_moderates_deterministically(server: Server) -> None:
    first = client(server).moderations.create(input=TEXTS)
    again = client(server).moderations.create(model="synthetic", input=TEXTS)
    assert [r.model_dump() for r in first.results] == [r.model_dump() for r in again.results]
    calm, violent = first.results
    assert calm.flagged is False and violent.flagged is True
    assert violent.categories.violence is True and violent.category_scores.violence == 0.9
    assert first.model == "synthetic" and first.id.startswith("modr-")
    parts = client(server).moderations.create(
        input=[
            {"type": "text", "text": "hate"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        ]
    )
    assert len(parts.results) == 1 and parts.results[0].categories.hate is True


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp: Path = tmp_path_factory.mktemp("moderations")
    with run_server() as upstream:
        routes, keys = tmp / "routes.toml", tmp / "keys.toml"
        routes.write_text(ROUTES.format(dead=free_port(), upstream=upstream.v1))
        keys.write_text(KEYS)
        args = ("--routes", str(routes), "--api-keys", str(keys), "--admin-key-env", "MOD_ADMIN")
        db = f"sqlite:///{tmp / 'usage.db'}"
        with run_server(*args, "--usage-db", db, env={"MOD_ADMIN": ADMIN}) as gateway:
            yield gateway, upstream


def usage(server: Server, **params: str) -> dict[str, Any]:
    r = httpx.get(server.v1 + "/usage", params=params, headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_routes_moderations_equal_its_upstreams_and_the_ledger_counts_them(
    routed: tuple[Server, Server],
) -> None:
    gateway, upstream = routed
    through = client(gateway, "sk-alice").moderations.create(
        model="omni-moderation-latest", input=TEXTS
    )
    direct = client(upstream).moderations.create(model="synthetic", input=TEXTS)
    assert [r.model_dump() for r in through.results] == [r.model_dump() for r in direct.results]
    assert through.model == "omni-moderation-latest"
    # The first target is down: the second answered. OpenAI's moderations carry no usage:
    # the gateway's own count of the texts is billed, at the target's prompt price.
    wait_for(lambda: usage(gateway)["total"]["requests"] >= 1)
    (row,) = usage(gateway, by="target")["rows"]
    assert row["target"] == "up" and row["prompt_tokens"] == 6 + 4
    assert Decimal(row["cost"]) == Decimal(row["prompt_tokens"]) * Decimal("0.5") / 10**6


def test_a_target_that_does_not_declare_moderations_refuses_them(
    routed: tuple[Server, Server],
) -> None:
    gateway, _ = routed
    with pytest.raises(openai.NotFoundError) as info:
        client(gateway, "sk-alice").moderations.create(model="chat", input="hello")
    assert info.value.code == "moderations_not_served"
    assert "moderations" in info.value.message


def test_moderations_are_behind_the_keys_and_their_budgets(routed: tuple[Server, Server]) -> None:
    gateway, _ = routed
    with pytest.raises(openai.AuthenticationError):
        client(gateway, "sk-nobody").moderations.create(input="x")
    with pytest.raises(openai.RateLimitError) as refused:
        client(gateway, "sk-broke").moderations.create(model="omni-moderation-latest", input="x")
    assert "budget" in str(refused.value)
    bad = httpx.post(
        gateway.v1 + "/moderations",
        json={"model": "omni-moderation-latest", "input": []},
        headers={"authorization": "Bearer sk-alice"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
