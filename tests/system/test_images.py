"""`POST /v1/images/generations` with the official openai SDK: the synthetic engine's
deterministic images; a route's target that declares `serves = ["images"]`, its answer equal
to the upstream's own (a second firsttoken server), the prompt billed in the ledger; one that
does not declare it refuses; edits (multipart) answer 404 saying why."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.servers import Server, run_server, wait_for

ADMIN = "images-admin"
ROUTES = """
[targets.painter]
kind = "openai"
url = "{upstream}"
model = "synthetic"
serves = ["images"]
price = {{ prompt = 2, completion = 1 }}

[targets.chat_only]
kind = "openai"
url = "{upstream}"
model = "synthetic"

[models.gpt-image-1]
targets = ["painter"]

[models.chat]
targets = ["chat_only"]
"""
PROMPT = "a lighthouse at dawn"


def client(server: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def test_the_synthetic_engine_draws_the_same_prompt_the_same_way(server: Server) -> None:
    one = client(server).images.generate(prompt=PROMPT, n=2)
    again = client(server).images.generate(prompt=PROMPT, n=2)
    assert [d.b64_json for d in one.data] == [d.b64_json for d in again.data]
    assert one.data[0].b64_json and one.data[0].b64_json != one.data[1].b64_json
    assert base64.b64decode(one.data[0].b64_json).startswith(b"\x89PNG")


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp: Path = tmp_path_factory.mktemp("images")
    with run_server() as upstream:
        routes = tmp / "routes.toml"
        routes.write_text(ROUTES.format(upstream=upstream.v1))
        args = ("--routes", str(routes), "--admin-key-env", "IMG_ADMIN")
        with run_server(*args, env={"IMG_ADMIN": ADMIN}) as gateway:
            yield gateway, upstream


def test_a_routes_images_equal_its_upstreams_and_the_prompt_is_billed(
    routed: tuple[Server, Server],
) -> None:
    gateway, upstream = routed
    through = client(gateway).images.generate(model="gpt-image-1", prompt=PROMPT)
    direct = client(upstream).images.generate(model="synthetic", prompt=PROMPT)
    assert [d.b64_json for d in through.data] == [d.b64_json for d in direct.data]
    admin = {"authorization": f"Bearer {ADMIN}"}

    def rows() -> list[dict]:
        answer = httpx.get(gateway.v1 + "/usage", params={"by": "target"}, headers=admin)
        return answer.json()["rows"]  # type: ignore[no-any-return]

    wait_for(lambda: bool(rows()))
    (row,) = rows()
    assert row["target"] == "painter" and row["prompt_tokens"] == 4  # "a lighthouse at dawn"
    with pytest.raises(openai.NotFoundError) as info:
        client(gateway).images.generate(model="chat", prompt=PROMPT)
    assert info.value.code == "images_not_served"


def test_image_edits_are_refused_saying_why(server: Server) -> None:
    answer = httpx.post(server.v1 + "/images/edits", files={"image": ("a.png", b"x")})
    assert answer.status_code == 404
    assert "multipart" in answer.json()["error"]["message"]
