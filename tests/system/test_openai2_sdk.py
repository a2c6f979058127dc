"""The official openai SDK's 2.x line, unchanged, against a real server: the calls teams
make (tests/openai_sdk_calls.py) run by the interpreter of .venv/openai2, which ./scripts/test
makes with tests/requirements-openai2.txt's pin, and by the project's own (3.x), to the same
answers. The 2.x venv missing is a failure that says how to make it, never a skip."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from firsttoken.engines import synthetic_tokens
from tests.servers import ROOT, Server

SCRIPT = ROOT / "tests" / "openai_sdk_calls.py"
PIN = ROOT / "tests" / "requirements-openai2.txt"
SDK2 = ROOT / ".venv" / "openai2" / "bin" / "python"
PROMPT = "user: Why does streaming matter?"
QUESTION = "user: What outlives its connection?"


def pinned() -> str:
    (line,) = (ln for ln in PIN.read_text().splitlines() if ln.startswith("openai=="))
    return line.removeprefix("openai==")


def calls(python: Path | str, server: Server) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), str(SCRIPT), server.v1], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def sdk2(server: Server) -> Iterator[dict[str, Any]]:
    if not SDK2.exists():
        pytest.fail(
            f"{SDK2.relative_to(ROOT)} is missing: ./scripts/test makes it (openai=={pinned()}, "
            "tests/requirements-openai2.txt)",
            pytrace=False,
        )
    yield calls(SDK2, server)


def test_it_is_the_pinned_2x_release(sdk2: dict[str, Any]) -> None:
    assert sdk2["sdk"] == pinned() and sdk2["sdk"].startswith("2.")


def test_chat_completions_whole_streamed_and_async(sdk2: dict[str, Any]) -> None:
    chat = sdk2["chat"]
    assert chat["whole"] == "".join(synthetic_tokens(PROMPT, 1, 25)[0])
    assert (chat["whole_finish"], chat["whole_tokens"]) == ("length", 25)
    assert chat["parts"] == synthetic_tokens(PROMPT, 7, 40)[0]  # one chunk per token
    assert (chat["finishes"], chat["tokens"]) == (["length"], 40)
    assert sdk2["helpers"]["async_parts"] == synthetic_tokens(PROMPT, 9, 20)[0]  # AsyncOpenAI
    expected = synthetic_tokens("Once upon a time", 2, 12)[0]
    assert sdk2["completions"]["parts"] == expected


def test_responses_whole_streamed_helper_resumed_and_cancelled(sdk2: dict[str, Any]) -> None:
    expected = "".join(synthetic_tokens(QUESTION, 7, None, 40)[0])
    responses = sdk2["responses"]
    assert responses["whole"] == responses["deltas"] == responses["final"] == expected
    assert (responses["whole_status"], responses["whole_tokens"]) == ("completed", 40)
    assert responses["types"] == ["response.created", "response.completed"]
    assert sdk2["helpers"]["stream_final"] == expected  # responses.stream()
    resumed = sdk2["resumed"]
    # Dropped after sequence number 5, read on with starting_after=5: every later event.
    assert resumed["first_sequence"] == list(range(6))
    later = resumed["later_sequence"]
    assert later == list(range(6, 6 + len(later))) and resumed["last"] == "response.completed"
    assert resumed["text"] == resumed["final"] == expected
    assert resumed["created_status"] in ("queued", "in_progress")
    assert (resumed["polled_status"], resumed["polled_text"]) == ("completed", expected)
    assert sdk2["cancelled"] == {"same_id": True, "status": "cancelled", "retrieved": "cancelled"}


def test_embeddings_base64_and_floats(sdk2: dict[str, Any]) -> None:
    embeddings = sdk2["embeddings"]
    assert embeddings["same"] and embeddings["indexes"] == [0, 1]  # base64 decoded by the SDK
    assert embeddings["dims"] == [256, 256] and embeddings["short"] == 8
    assert embeddings["prompt_tokens"] == 3 + 2 and embeddings["model"] == "synthetic"
    assert embeddings["base64_bytes"] == 256 * 4  # float32 little-endian, as OpenAI packs it


def test_errors_after_the_200_raise_in_the_sdk(sdk2: dict[str, Any]) -> None:
    errors = sdk2["errors"]
    chat = errors["chat"]
    assert chat["code"] == "engine_overloaded" and "after 8 tokens" in chat["message"]
    assert chat["parts"] == synthetic_tokens(PROMPT, 5, 50)[0][:8]
    responses = {"code": "engine_overloaded", "deltas": 8, "failed": "failed"}
    assert errors["responses"] == responses
    assert errors["unknown_model"] == {"status": 404, "code": "model_not_found"}


def test_the_2x_and_3x_sdks_get_the_same_answers(sdk2: dict[str, Any], server: Server) -> None:
    sdk3 = calls(sys.executable, server)
    assert sdk3["sdk"].startswith("3.")

    def stable(results: dict[str, Any]) -> dict[str, Any]:
        resumed = {k: v for k, v in results["resumed"].items() if k != "created_status"}
        return {**results, "sdk": None, "resumed": resumed}  # queued or running by then

    assert stable(sdk2) == stable(sdk3)
