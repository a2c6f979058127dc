"""bench/gateways.py must not rot: every gateway but LiteLLM at the smallest size.

Not a performance test: no figure is judged, only that the mock upstream, the byte pipe, the
relay and both routes start, stream every token, and land in the table and the JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reaches_every_gateway(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gateways", "--quick", "--no-litellm", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "c=1 added TTFT p50 / p99" in proc.stdout and "byte pipe (floor)" in proc.stdout
    res = json.loads((tmp_path / "gateways.json").read_text())
    assert res["meta"]["litellm"]["status"].startswith("skipped")
    names = {"direct", "pipe", "relay", "route1", "route3"}
    assert {r["target"] for r in res["c1"]} == names
    for r in res["c1"]:
        assert r["complete"] == r["rounds"] == 2, r
        assert r["added_ttft_ms_p50"] is not None
    levels = [r for r in res["levels"] if r["at_once"] == 8]
    assert {r["target"] for r in levels} == names
    for r in levels:
        assert r["complete"] == r["streams"] == 8, r
        assert r["tokens"] == 8 * 8 and r["gap_ms_p99"] is not None
        # one upstream request a stream, all on the first port: hedging asked nobody else
        assert r["upstream_requests"] == [8, 0, 0], r
        if r["target"] != "direct":
            assert r["cpu_s"] > 0
    assert set(res["holds"]) == names
