"""Capture → replay → capture: the same events, with the original timing divided by --speed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median
from typing import Any

import pytest

from firsttoken.formats.sse import EventDecoder
from firsttoken.tools import replay
from tests.servers import ROOT, Server, run_server
from tests.system.test_diag import BackgroundLoop, port_of, run_diag, start_batching_proxy

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server("--synthetic-ttft-ms", "80", "--synthetic-itl-ms", "15") as s:
        yield s


@pytest.fixture(scope="module")
def original(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("capture") / "original.jsonl"
    rc, d = run_diag(server.url + CHAT, "--max-tokens", "30", "--capture", str(path))
    assert rc == 0 and d["chunks"] == 30
    return path


@contextmanager
def serve_replay(path: Path, *args: str) -> Iterator[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "firsttoken.tools.replay",
            str(path),
            "--serve",
            "--port",
            "0",
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        yield json.loads(line)["url"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def load(path: Path) -> tuple[float, list[dict[str, Any]]]:
    """(when the SSE request was sent, the events) of stream 0 of a capture."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    base = next(r["sse_request_t"] for r in recs if r["type"] == "response")
    return base, [r for r in recs if r["type"] == "event"]


def assert_same_stream(first: Path, second: Path, speed: float) -> None:
    base1, ev1 = load(first)
    base2, ev2 = load(second)
    key = [(e["data"], e["event"], e["id"]) for e in ev1]
    assert [(e["data"], e["event"], e["id"]) for e in ev2] == key
    # TTFT: the replay counts from the request's arrival.
    ttft1, ttft2 = (ev1[0]["t"] - base1) / speed, ev2[0]["t"] - base2
    assert abs(ttft2 - ttft1) < 0.020, (ttft1, ttft2)
    # Every event against the original timeline, less the common offset (TTFT, checked above).
    # Replays are scheduled from one start, so errors don't accumulate; a scheduling stall on a
    # shared machine delays a run of events until it catches up, the bulk stays on time.
    expected = [(e["t"] - base1) / speed for e in ev1]
    got = [e["t"] - base2 for e in ev2]
    raw = [g - x for g, x in zip(got, expected, strict=True)]
    offset = median(raw)
    errors = [e - offset for e in raw]
    assert median(abs(e) for e in errors) < 0.005, errors
    assert max(abs(e) for e in errors) < 0.300, errors
    span1 = (ev1[-1]["t"] - ev1[0]["t"]) / speed
    span2 = ev2[-1]["t"] - ev2[0]["t"]
    assert abs(span2 - span1) < 0.020 + 0.05 * span1, (span1, span2)


@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_round_trip(original: Path, tmp_path: Path, speed: float) -> None:
    copy = tmp_path / "copy.jsonl"
    with serve_replay(original, "--speed", str(speed)) as url:
        rc, d = run_diag(url + CHAT, "--model", "synthetic", "--capture", str(copy))
    assert rc == 0 and d["done"] is True and d["chunks"] == 30
    assert d["buffered"] is False, d["reason"]
    assert_same_stream(original, copy, speed)
    # And a replay of the replay at speed 1 is the same stream again.
    again = tmp_path / "again.jsonl"
    with serve_replay(copy) as url:
        run_diag(url + "/events", "--capture", str(again))
    assert_same_stream(copy, again, 1.0)


def test_replay_to_stdout_keeps_timing(original: Path) -> None:
    base, events = load(original)
    span = (events[-1]["t"] - base) / 2.0
    proc = subprocess.Popen(
        [sys.executable, "-m", "firsttoken.tools.replay", str(original), "--speed", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    arrivals: list[float] = []
    decoder = EventDecoder()
    got = []
    assert proc.stdout is not None

    def read() -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(65536):  # type: ignore[attr-defined]
            for ev in decoder.feed(chunk):
                arrivals.append(time.perf_counter())
                got.append((ev.data, ev.id))

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=30)
    assert proc.wait(timeout=10) == 0
    assert [(e["data"], e["id"]) for e in events] == got
    first_gap = (events[0]["t"] - base) / 2.0
    measured = arrivals[-1] - arrivals[0]
    assert abs(measured - (span - first_gap)) < 0.05 + 0.1 * span


def test_replay_text_format(original: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "firsttoken",
            "replay",
            str(original),
            "--speed",
            "50",
            "--format",
            "text",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0
    _, events = load(original)
    text = ""
    for e in events:
        if e["data"] != "[DONE]":
            choices = json.loads(e["data"]).get("choices") or [{}]
            text += choices[0].get("delta", {}).get("content") or ""
    assert proc.stdout == text + "\n"


def test_replay_serves_native_flow(original: Path) -> None:
    with serve_replay(original, "--speed", "4") as url:
        rc, d = run_diag(url + "/v1/streams")
    assert rc == 0 and d["kind"] == "native" and d["chunks"] == 30 and d["done"] is True


def test_send_timestamps_measure_the_path(original: Path) -> None:
    """With server send stamps, diag reports the delay the path added per event."""
    with serve_replay(original, "--send-timestamps", "--speed", "2") as url:
        rc, direct = run_diag(url + "/events")
        loop = BackgroundLoop()
        try:
            port = int(url.rsplit(":", 1)[1])
            proxy = loop.run(start_batching_proxy(port, block=2048))
            rc2, proxied = run_diag(f"http://127.0.0.1:{port_of(proxy)}/events")
            proxy.close()
        finally:
            loop.close()
    assert rc == rc2 == 0
    assert direct["server_delay_ms"] is not None and direct["buffered"] is False
    assert direct["server_delay_ms"]["added_p90"] < 25
    assert len(direct["server_delay_ms"]["added_per_chunk"]) == 30
    assert proxied["buffered"] is True, proxied["reason"]
    assert "added delay" in proxied["reason"]
    assert proxied["server_delay_ms"]["added_max"] > 25


def test_bad_input(tmp_path: Path) -> None:
    assert replay.main([str(tmp_path / "missing.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert replay.main([str(bad)]) == 2
    assert replay.main([str(bad), "--speed", "0"]) == 2


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("busy", "cannot listen on 127.0.0.1:{port}: the address is already in use"),
        (("--host", "192.0.2.1", "--port", "0"), "cannot listen on 192.0.2.1:0: "),
        (("--port", "99999"), "invalid --port 99999: must be from 0 to 65535"),
        (("--port", "-1"), "invalid --port -1: must be from 0 to 65535"),
    ],
)
def test_serve_bind_errors_are_one_line_and_exit_2(
    original: Path, where: str | tuple[str, ...], line: str
) -> None:
    """Like `serve`: a busy port (errno 98), an address not on this host (99, TEST-NET-1) and
    a port out of range (OverflowError in the socket layer) are told in one line, exit 2."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ("--port", str(port)) if where == "busy" else where
        proc = subprocess.run(
            [sys.executable, "-m", "firsttoken", "replay", str(original), "--serve", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("firsttoken replay: " + line.format(port=port)), proc.stderr
