"""bench/proxies.py must not rot: a tiny relay-vs-direct run (LiteLLM is never needed here).

Not a performance test: no figure is checked against a target, only that the script starts
the upstream and the relay, drives both, verifies the text, and writes its table and JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.expected import RequestSpec
from bench.load import Capture
from bench.proxies import decode

ROOT = Path(__file__).resolve().parents[2]


def test_quick_relay_vs_direct(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.proxies", "--quick", "--no-litellm", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "added TTFT p50" in proc.stdout and "relay/dir" in proc.stdout
    res = json.loads((tmp_path / "proxies.json").read_text())
    assert res["meta"]["litellm"]["status"].startswith("skipped")
    rows = res["runs"]
    assert {r["target"] for r in rows} == {"direct", "relay"}
    for r in rows:
        assert r["text_exact"] == r["chunk_exact"] == r["streams"] > 0, r
        assert r["ttft_ms_p50"] is not None and r["gap_ms_p99"] is not None
    assert [c["concurrency"] for c in res["comparison"]] == res["meta"]["sizes"]["levels"]
    assert all(c["relay_added_ttft_ms_p50"] is not None for c in res["comparison"])


def test_decode_tolerates_reshaped_chunks() -> None:
    """LiteLLM-style stream: role chunk, tokens merged, a usage chunk with no choices."""
    spec = RequestSpec(0, 4, 0.0, 0.0)
    tokens = spec.tokens()
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": tokens[0] + tokens[1]}}]},
        {"choices": [{"index": 0, "delta": {"content": "".join(tokens[2:])}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"completion_tokens": 4}},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    body += b"data: [DONE]\n\n"
    wire = b"HTTP/1.1 200 OK\r\nx-litellm-overhead-duration-ms: 3.5\r\n\r\n" + body
    cap = Capture(spec, t_sent=1.0)
    cap.reads = [(1.0 + i / 100, wire[i : i + 9]) for i in range(0, len(wire), 9)]
    d = decode(cap)
    assert d.problem is None and d.done
    assert "".join(d.contents) == "".join(tokens) and len(d.contents) == 2
    assert d.headers["x-litellm-overhead-duration-ms"] == "3.5"
