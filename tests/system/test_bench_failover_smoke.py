"""bench/failover.py must not rot: a quick run through the routes gateway (LiteLLM not needed).

Not a performance test: no gap or rate is held to a target here, only that the scenario really
happens (a kill, cut answers spliced) and that the gateway passes no answer off as finished
unless it is the uninterrupted one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.failover import Ask, Capture, parse

ROOT = Path(__file__).resolve().parents[2]


def test_quick_failover_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.failover", "--quick", "--no-litellm", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "completion rate" in proc.stdout and "TARGETS" in proc.stdout
    res = json.loads((tmp_path / "failover.json").read_text())
    reference = res["meta"]["reference"]
    assert reference["identical"] == reference["requests"] > 0  # the references are the engine's
    (row,) = res["runs"]
    assert row["front"] == "firsttoken" and row["streams"] == 100
    assert row["schedule"]["kills_at_s"], row["schedule"]  # the killer ran during the streams
    assert row["splices_logged"] > 0 and row["failovers"]["mid_stream"] > 0, row
    assert row["identical"] == row["completed"] >= 95, row  # no cut answer passed off as whole
    assert row["splices_unmatched"] == 0, row  # every logged splice found in a client's stream


def test_parse_sees_a_seam() -> None:
    """Two ids, two role deltas and two [DONE]s are all counted, not folded into one."""
    ask = Ask(0, 2)
    text, _, _ = ask.answer()
    events = [
        {"id": "chatcmpl-a", "choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"id": "chatcmpl-a", "choices": [{"delta": {"content": text[:3]}}]},
        {"id": "chatcmpl-b", "choices": [{"delta": {"role": "assistant", "content": text[3:]}}]},
        {"id": "chatcmpl-b", "choices": [{"delta": {}, "finish_reason": "length"}]},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    body += b"data: [DONE]\n\ndata: [DONE]\n\n"
    cap = Capture(ask, t_sent=1.0, reads=[(1.0, b"HTTP/1.1 200 OK\r\n\r\n" + body)])
    seen = parse(cap)
    assert seen.completed and seen.text == text
    assert (len(seen.ids), seen.roles, seen.dones) == (2, 2, 2)
    assert seen.stream_id is None
