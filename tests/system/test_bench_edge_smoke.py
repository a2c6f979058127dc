"""bench/edge.py must not rot: a quick run of four of its cases (the real small model at the
edge, llama.cpp behind the delay line as the slow center, the synthetic center).

Not a performance test: no time is held to a target, only that each case really happens (every
stream handed off at its token, the seam as late as the delay line makes it, a greeting canned,
the synthetic center continuing the small model's text exactly, with no pause once prefilled
and paced).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_edge_run(tmp_path: Path) -> None:
    cases = "slow-tokens,mix-handoff,synth-tokens,synth-seam"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.edge", "--quick", "--cases", cases, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "EDGE AND CENTER" in proc.stdout
    res = json.loads((tmp_path / "edge.json").read_text())
    rows = {r["case"]: r for r in res["runs"]}
    sizes = res["meta"]["sizes"]
    tokens = rows["slow-tokens"]
    assert tokens["completed"] == tokens["requests"] == sizes["requests"], tokens
    # Greedy answers longer than after_tokens: every stream hands off, at that token.
    assert tokens["handoffs"] == tokens["requests"] and tokens["handoffs_unmatched"] == 0
    assert tokens["gap_ms_p50"] >= sizes["center_delay_ms"]  # the delay line is in the seam
    mix = rows["mix-handoff"]
    assert mix["completed"] == mix["requests"] and mix["canned"] >= 1, mix
    assert mix["by_kind"]["greeting"]["center_asked"] == 0
    synth = rows["synth-tokens"]
    # The synthetic center continues the small model's text (`continue_any`): after the
    # seam, exactly its own continuation of the text before it.
    n = synth["requests"]
    assert synth["completed"] == synth["handoffs"] == n and synth["fallbacks"] == 0, synth
    assert synth["seam_text_exact"] == f"{n}/{n}"
    assert synth["gap_ms_p50"] >= sizes["center_ttft_ms"]  # by count: its whole TTFT
    seam = rows["synth-seam"]
    assert seam["completed"] == seam["handoffs"] == n, seam
    assert seam["seam_text_exact"] == f"{n}/{n}"
    # Prefilled at the start and paced: no pause of the center's TTFT's size anywhere.
    assert seam["longest_pause_ms_max"] < sizes["center_ttft_ms"], seam
