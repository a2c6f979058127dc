"""The README's examples, run as written against a real server, so they stay true."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ROOT, Server, run_server

README = (ROOT / "README.md").read_text()

# Stands in for jq where it is not installed: `jq -r .FIELD FILE`, all the README uses.
JQ_SHIM = """#!{python}
import json, sys
assert sys.argv[1] == "-r" and sys.argv[2].startswith(".")
print(json.load(open(sys.argv[3]))[sys.argv[2][1:]])
"""


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # Fast timing: the commands are the README's; only the server is quicker than the default.
    with run_server("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1") as s:
        yield s


def local(code: str, server: Server) -> str:
    return code.replace("localhost:8000", f"127.0.0.1:{server.port}").replace(
        "http://127.0.0.1:8000", server.url
    )


def test_quick_tour_shell(server: Server, tmp_path: Path) -> None:
    [script] = blocks(section("Quick tour"), "sh")
    env = dict(os.environ)
    if shutil.which("jq") is None:
        shim = tmp_path / "bin" / "jq"
        shim.parent.mkdir()
        shim.write_text(JQ_SHIM.format(python=sys.executable))
        shim.chmod(0o755)
        env["PATH"] = f"{shim.parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        ["bash", "-eu", "-o", "pipefail", "-c", local(script, server)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # The chat stream and the native stream both ran to [DONE] ...
    assert out.count("data: [DONE]") == 2, out[-2000:]
    assert '"object":"chat.completion.chunk"' in out
    created = json.loads((tmp_path / "stream.json").read_text())
    assert set(created) >= {"id", "resume_token", "events_url", "cancel_url"}
    assert out.count('data: {"token":') == 50
    # ... the one nobody opened in time was stopped, and says so ...
    assert "event: error" in out and '"code":"stream_abandoned"' in out, out[-2000:]
    # ... and the long one was cancelled.
    long = json.loads((tmp_path / "long.json").read_text())
    assert json.loads(out.strip().splitlines()[-1]) == {"id": long["id"], "outcome": "cancelled"}


@pytest.mark.parametrize(
    "where", ["Quick tour", "Resume, the Python client, and several instances"]
)
def test_python_examples(server: Server, where: str) -> None:
    for code in blocks(section(where), "python"):
        proc = subprocess.run(
            [sys.executable, "-c", local(code, server)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert len(proc.stdout) > 20, proc.stdout


def test_readme_stands_alone() -> None:
    # Links stay inside the repository, and the files they name exist.
    assert "../" not in README
    for path in re.findall(r"`((?:docs|bench|deploy|tests)/[\w./-]+)`", README):
        assert (ROOT / path).exists(), path


def test_routes_example_splices_an_answer_whose_engine_dies(tmp_path: Path) -> None:
    # The routes file as written, its two URLs pointed at real (scripted) upstreams: the
    # "vLLM" one drops its connection after two tokens, the "SGLang" one continues.
    import openai

    from tests.upstreams import TOKENS, scripted_upstream

    text = section("Routes: many engines, one answer")
    [routes] = blocks(text, "toml")
    [command] = blocks(text, "sh")
    assert command.strip() == "firsttoken serve --routes routes.toml"
    with (
        scripted_upstream({"Qwen/Qwen3-8B": "cut-chunked"}) as vllm,
        scripted_upstream({"Qwen/Qwen3-8B": "ok"}) as sglang,
    ):
        routes = routes.replace("http://10.0.0.5:8000/v1", vllm.url)
        routes = routes.replace("http://10.0.0.6:30000/v1", sglang.url)
        (tmp_path / "routes.toml").write_text(routes)
        with run_server("--routes", str(tmp_path / "routes.toml")) as server:
            client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
            chunks = list(
                client.chat.completions.create(
                    model="qwen", messages=[{"role": "user", "content": "hi"}], stream=True
                )
            )
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert answer == "".join(TOKENS)  # the same answer, no seam
            assert len({c.id for c in chunks}) == 1
            phase = 'firsttoken_failovers_total{phase="mid_stream",route="qwen"}'
            assert server.metric(phase) == 1
