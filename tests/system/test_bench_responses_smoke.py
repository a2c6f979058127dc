"""bench/responses.py must not rot: a tiny run of both modes (one server; two on a real
redis-server), in which no event may be lost, duplicated or differ from the whole log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_responses_run(tmp_path: Path) -> None:
    command = ["-m", "bench.responses", "--streams", "4", "--tokens", "30"]
    proc = subprocess.run(
        [sys.executable, *command, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "responses.json").read_text())
    for mode in ("memory", "redis"):
        result = report[mode]
        assert result["completed"] == 4 and result["lost_events"] == 0
        assert result["duplicated_events"] == result["not_byte_exact"] == 0
        assert result["resume_ttfe_ms"]["p50"] is not None
    assert report["redis"]["bytes_per_response_redis"] > 0
