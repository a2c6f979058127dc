"""bench/embeddings.py must not rot: direct and the relay at the smallest size.

Not a performance test: no figure is judged, only that the upstream and the relay start,
answer the upstream's own vector to every request, and land in the table and the JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reaches_the_upstream_and_the_relay(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.embeddings", "--quick", "--no-litellm"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "firsttoken relay" in proc.stdout and "relay ÷ direct at c=4" in proc.stdout
    res = json.loads((tmp_path / "embeddings.json").read_text())
    assert res["meta"]["litellm"]["status"].startswith("skipped")
    assert set(res["targets"]) == {"direct", "relay"}
    for name, fig in res["targets"].items():
        assert fig["c1"]["requests"] == 5 and fig["c1"]["failed"] == 0, name
        assert fig["many"]["requests"] == 4 * 2 and fig["many"]["failed"] == 0, name
        assert fig["c1"]["p50_ms"] is not None and fig["many"]["p99_ms"] is not None
    assert res["targets"]["relay"]["c1"]["added_p50_ms"] is not None
