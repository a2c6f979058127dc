"""`--workers N`: a dead worker is replaced (logged, counted) and one scrape of the shared port
counts every worker, including the dead ones."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from firsttoken.telemetry.metrics import Metrics, WorkerShare, fold_worker
from firsttoken.workers import Supervisor
from tests.servers import Server, parse_metrics, run_server, wait_for

FAST = ("--synthetic-ttft-ms", "0", "--synthetic-itl-ms", "1")


def _events(server: Server, event: str) -> list[dict]:
    return [r for r in server.log_records() if r.get("event") == event]


def _listening_pids(server: Server, count: int) -> list[int]:
    return wait_for(
        lambda: (
            (pids := [r["pid"] for r in _events(server, "listening")])
            and len(pids) >= count
            and pids
        )
    )


def _stream(server: Server, max_tokens: int = 5) -> None:
    # A client of its own per request: a new connection, so the kernel picks a worker each time.
    with httpx.stream(
        "POST",
        server.v1 + "/chat/completions",
        json={
            "messages": [{"role": "user", "content": "w"}],
            "stream": True,
            "max_tokens": max_tokens,
        },
        timeout=10,
    ) as r:
        assert r.status_code == 200
        assert "data: [DONE]" in r.read().decode()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_worker_is_replaced_logged_and_counted() -> None:
    with run_server("--workers", "2", *FAST) as server:
        first = _listening_pids(server, 2)
        victim = first[0]
        os.kill(victim, signal.SIGKILL)
        exit_ = wait_for(lambda: [r for r in _events(server, "worker.exit") if r["pid"] == victim])
        assert exit_[0]["signal"] == "SIGKILL" and exit_[0]["restart"] is True
        new = wait_for(lambda: [p for p in _listening_pids(server, 3) if p not in first])[0]
        assert [r["pid"] for r in _events(server, "worker.start")][-1] == new

        def new_pid_answered() -> bool:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda _: _stream(server, 2), range(4)))
            return any(r.get("pid") == new for r in _events(server, "stream.finished"))

        wait_for(new_pid_answered, timeout=20)
        assert server.metric("firsttoken_worker_restarts_total") == 1

        # SIGTERM to the parent reaches every worker; the parent waits for them all.
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=15) == 0
        assert not any(_alive(pid) for pid in (first[1], new))
        wait_for(
            lambda: {r["pid"] for r in _events(server, "worker.exit")} == {victim, first[1], new}
        )


def test_one_scrape_counts_every_worker_and_keeps_the_dead() -> None:
    with run_server("--workers", "2", *FAST) as server:
        pids = set(_listening_pids(server, 2))
        sent = 0
        with ThreadPoolExecutor(8) as pool:
            while sent < 80:
                list(pool.map(lambda _: _stream(server), range(8)))
                sent += 8
                served = {r.get("pid") for r in _events(server, "stream.finished")}
                if served >= pids:
                    break
        assert served >= pids, "the kernel gave every stream to one worker"
        wait_for(lambda: len(_events(server, "stream.finished")) >= sent)

        m = server.metrics()  # one scrape: whichever worker answers, it counts both
        assert m['firsttoken_streams_total{outcome="completed"}'] == sent
        assert m["firsttoken_ttft_seconds_count"] == sent
        assert m["firsttoken_inter_chunk_seconds_count"] == sent * 4
        assert m["firsttoken_tokens_sent_total"] == sent * 5
        assert m["firsttoken_tokens_generated_total"] == sent * 5
        assert m['firsttoken_breaker_state{state="closed"}'] == 2  # a gauge: one per worker

        # A worker that dies takes nothing with it: the same totals from the survivor.
        victim = sorted(pids)[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: [r for r in _events(server, "worker.exit") if r["pid"] == victim])
        for _ in range(3):
            after = server.metrics()
            assert after['firsttoken_streams_total{outcome="completed"}'] == sent
            assert after["firsttoken_ttft_seconds_count"] == sent
            assert after["firsttoken_worker_restarts_total"] == 1


def test_share_merges_live_dead_and_retired_workers(tmp_path: Path) -> None:
    a, b = Metrics(), Metrics()
    share_a = WorkerShare(tmp_path, "w0", a.registry)
    share_b = WorkerShare(tmp_path, "w1", b.registry)
    fold_worker(tmp_path, "", restarted=False)
    a.ttft.observe(0.05)
    a.streams["completed"] += 1
    b.ttft.observe(0.25)
    b.streams["completed"] += 2
    b.active_streams = 3

    m = parse_metrics(share_a.render().decode())
    assert m["firsttoken_ttft_seconds_count"] == 2
    assert m['firsttoken_ttft_seconds_bucket{le="0.06"}'] == 1
    assert m['firsttoken_streams_total{outcome="completed"}'] == 3
    assert m["firsttoken_active_streams"] == 3
    assert m['firsttoken_breaker_state{state="closed"}'] == 2
    assert m["firsttoken_worker_restarts_total"] == 0

    # w1 dies: its counters stay (from its file, as last seen), its gauges go.
    b.streams["completed"] += 5  # never seen by a scrape, so never promised
    share_b.close()
    m = parse_metrics(share_a.render().decode())
    assert m['firsttoken_streams_total{outcome="completed"}'] == 3
    assert m["firsttoken_active_streams"] == 0
    assert m['firsttoken_breaker_state{state="closed"}'] == 1

    # The supervisor folds it into the retired total: the same numbers, plus a restart.
    fold_worker(tmp_path, "w1", restarted=True)
    assert not (tmp_path / "w1.json").exists()
    m = parse_metrics(share_a.render().decode())
    assert m['firsttoken_streams_total{outcome="completed"}'] == 3
    assert m["firsttoken_ttft_seconds_count"] == 2
    assert m["firsttoken_worker_restarts_total"] == 1
    share_a.close()


def test_folded_worker_is_not_counted_twice(tmp_path: Path) -> None:
    """A scrape that read a worker's file just before the supervisor folded it."""
    a, b = Metrics(), Metrics()
    share_a = WorkerShare(tmp_path, "w0", a.registry)
    share_b = WorkerShare(tmp_path, "w1", b.registry)
    b.streams["error"] += 4
    share_b.snapshot()
    share_b.close()
    saved = (tmp_path / "w1.json").read_bytes()
    fold_worker(tmp_path, "w1", restarted=True)
    (tmp_path / "w1.json").write_bytes(saved)  # as if listed before the fold
    m = parse_metrics(share_a.render().decode())
    assert m['firsttoken_streams_total{outcome="error"}'] == 4
    share_a.close()


def test_crash_loop_gives_up() -> None:
    def broken() -> None:
        raise RuntimeError("engine would not load")

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert Supervisor(2, broken).run() == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _no_shared_state() -> None:
    """Metrics made here must not pick up a worker's sharing (set only in forked children)."""
    import firsttoken.telemetry.metrics as obs

    assert obs._share_as is None
