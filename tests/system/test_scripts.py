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
