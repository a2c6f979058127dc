"""`--workers N`: a parent that forks N server processes on one listening socket, replaces the
ones that die, forwards signals and waits for all.

Why our own fork loop and not uvicorn's `Multiprocess` or gunicorn: uvicorn's supervisor
starts workers with multiprocessing's *spawn* (each re-imports everything and must receive a
pickled app and config, so our per-worker class settings and our uvicorn subclass don't travel),
logs a replacement as a plain text line with no count, and forwards one signal only (a second
SIGTERM, which cuts a drain short, doesn't reach the workers); gunicorn would add two
dependencies, its own socket binding and logging. Fork keeps the socket, the settings and
copy-on-write memory; the rest is this module.

Each worker gets a name (`w0`, `w1`, ... never reused) under which it shares its metrics in a
temporary directory (`telemetry.metrics.share_across_workers`); when it dies, its counters are
folded into the directory's retired total, so `/metrics` keeps counting them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from firsttoken.telemetry.log import flush_logs, log_event
from firsttoken.telemetry.metrics import fold_worker, share_across_workers

__all__ = ["Supervisor"]

FORWARDED = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.1  # how often the parent looks for dead workers and due restarts
EARLY_EXIT_S = 5.0  # a worker that lived less than this is restarted after a backoff ...
MAX_EARLY_EXITS = 5  # ... and this many in a row (any worker) is a crash loop: give up
MAX_BACKOFF_S = 5.0


@dataclass(slots=True)
class _Worker:
    name: str
    pid: int
    started: float


class Supervisor:
    """Runs `target` (which serves until told to stop) in `count` forked processes."""

    def __init__(self, count: int, target: Callable[[], None]) -> None:
        self.count = count
        self.target = target
        self.pid = os.getpid()
        self.directory = Path(tempfile.mkdtemp(prefix="firsttoken-workers-"))
        self.workers: dict[int, _Worker] = {}
        self.spawned = 0
        self.stopping = False
        self.early_exits = 0
        self.restarts_due: list[float] = []
        self.exit_code = 0

    def run(self) -> int:
        """Until a forwarded signal stops every worker (or a crash loop); the exit code."""
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        signal.signal(signal.SIGHUP, self._reload)
        fold_worker(self.directory, "", restarted=False)  # the restart counter starts at 0
        try:
            for _ in range(self.count):
                self._spawn()
            while not self.stopping or self.workers:
                self._reap()
                if not self.stopping:
                    now = time.monotonic()
                    for _ in [t for t in self.restarts_due if t <= now]:
                        self._spawn()
                    self.restarts_due = [t for t in self.restarts_due if t > now]
                time.sleep(POLL_S)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
        log_event("workers.stopped", exit_code=self.exit_code)
        return self.exit_code

    def _forward(self, signum: int, _frame: object) -> None:
        """Every SIGTERM/SIGINT goes to every worker (the second one cuts a drain short)."""
        self.stopping = True
        for pid in list(self.workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _reload(self, signum: int, _frame: object) -> None:
        """SIGHUP goes to every worker: each reloads its files (firsttoken/reload.py)."""
        log_event("workers.reload", workers=len(self.workers))
        for pid in list(self.workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)

    def _spawn(self) -> None:
        name = f"w{self.spawned}"
        self.spawned += 1
        # Blocked across the fork: the child must not run the parent's handler, and the parent
        # forwards a signal that came meanwhile to this child too.
        signal.pthread_sigmask(signal.SIG_BLOCK, (*FORWARDED, signal.SIGHUP))
        try:
            pid = os.fork()
            if pid == 0:
                self._child(name)
            self.workers[pid] = _Worker(name, pid, time.monotonic())
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, (*FORWARDED, signal.SIGHUP))
        log_event("worker.start", worker=name, pid=pid)

    def _child(self, name: str) -> NoReturn:
        code = 0
        try:
            # A group of its own: a terminal's Ctrl-C (sent to the foreground group) reaches
            # the worker once, through the parent, not twice (which uvicorn reads as "cut now").
            os.setpgid(0, 0)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            # Until its server listens and takes SIGHUP as a reload (a new worker reads the
            # files as they are anyway): not the default, which would end it.
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, (*FORWARDED, signal.SIGHUP))
            _die_with_parent(self.pid)
            share_across_workers(self.directory, name)
            self.target()
        except KeyboardInterrupt:
            pass
        except SystemExit as exc:  # a startup failure, already logged
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:
            code = 1
            log_event("worker.failed", logging.ERROR, worker=name, error=repr(exc))
        finally:
            flush_logs()  # os._exit skips atexit
            os._exit(code)

    def _reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.workers.clear()
                return
            if pid == 0:
                return
            worker = self.workers.pop(pid, None)
            if worker is not None:
                self._exited(worker, os.waitstatus_to_exitcode(status))

    def _exited(self, worker: _Worker, code: int) -> None:
        lived = time.monotonic() - worker.started
        how: dict[str, object] = (
            {"signal": signal.Signals(-code).name} if code < 0 else {"exit_code": code}
        )
        fields = {"worker": worker.name, "pid": worker.pid, "lived_s": round(lived, 3), **how}
        restart = not self.stopping
        fold_worker(self.directory, worker.name, restarted=restart)
        if not restart:
            log_event("worker.exit", **fields)
            return
        self.early_exits = self.early_exits + 1 if lived < EARLY_EXIT_S else 0
        if self.early_exits >= MAX_EARLY_EXITS:
            log_event("worker.exit", logging.ERROR, restart=False, **fields)
            log_event(
                "workers.crash_loop",
                logging.ERROR,
                early_exits=self.early_exits,
                note=f"workers keep dying within {EARLY_EXIT_S:g} s of starting; stopping",
            )
            self.exit_code = 1
            self._forward(signal.SIGTERM, None)
            return
        delay = min(MAX_BACKOFF_S, 0.5 * 2 ** (self.early_exits - 1)) if self.early_exits else 0
        log_event("worker.exit", logging.WARNING, restart=True, restart_in_s=delay, **fields)
        self.restarts_due.append(time.monotonic() + delay)


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel sends SIGTERM when the parent dies (a kill -9 of the parent leaves no
    orphans holding the port)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
