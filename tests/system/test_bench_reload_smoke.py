"""bench/reload.py must not rot: a quick run (20 streams, 3 reloads) that holds the same
verdict as the full one. Not a performance test beyond that verdict: nothing cut but the
removed keys' streams, each reload swapped within its bound, memory flat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_reload_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.reload", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RELOAD UNDER LOAD" in proc.stdout
    res = json.loads((tmp_path / "reload.json").read_text())
    assert res["ok"] and res["failed_steady"] == res["failed_on_removed_routes"] == 0
    assert res["temp_revoked"] > 0  # removed keys' streams were running, and ended
    assert res["completed_on_removed_routes"] > 0
    assert len(res["swap_s"]) == 3
