"""bench/redis_flush.py must not rot: a tiny run against a real redis-server, in which Redis
must confirm every run the store wrote (the bench checks the backlog is empty)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_redis_flush_run(tmp_path: Path) -> None:
    command = ["-m", "bench.redis_flush", "--streams", "20", "--rounds", "3"]
    proc = subprocess.run(
        [sys.executable, *command, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "append, store watching ÷ bare append" in proc.stdout
    assert "flush, µs CPU per stream" in proc.stdout
