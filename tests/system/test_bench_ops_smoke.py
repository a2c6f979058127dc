"""bench/ops.py must not rot: a tiny run (50 streams, one round of each arm) with the page open
in three headless Chromium contexts, its figures printed and written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_ops_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ops", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens per server CPU-second: none" in proc.stdout
    result = json.loads((tmp_path / "ops.json").read_text())
    assert sorted(p["arm"] for p in result["phases"]) == ["none", "none", "pages", "pages"]
    assert all(p["tokens"] > 0 and p["cpu_s"] > 0 for p in result["phases"])
    assert result["build_ms"] > 0
