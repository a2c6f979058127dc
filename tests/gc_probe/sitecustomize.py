"""A probe of reference cycles, for a server a test starts with this folder on PYTHONPATH and
FIRSTTOKEN_TEST_GC_OUT naming a file (tests/system/test_cycles.py).

The first SIGUSR2 collects, forgets what was found, and from then on keeps every object the
cyclic collector finds (`gc.DEBUG_SAVEALL`) instead of freeing it; each later SIGUSR2
collects and writes what was found since, counted by type, as one JSON line."""

from __future__ import annotations

import gc
import json
import os
import signal
from collections import Counter
from typing import Any

_OUT = os.environ.get("FIRSTTOKEN_TEST_GC_OUT")


def _write(record: dict[str, Any]) -> None:
    assert _OUT is not None
    with open(_OUT, "a") as f:
        f.write(json.dumps(record) + "\n")


def _arm(signum: int, frame: Any) -> None:
    gc.collect()
    gc.garbage.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)
    signal.signal(signal.SIGUSR2, _report)
    _write({"armed": True})


def _report(signum: int, frame: Any) -> None:
    gc.collect()
    found = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    gc.garbage.clear()
    _write({"garbage": dict(found.most_common(30))})


if _OUT:
    signal.signal(signal.SIGUSR2, _arm)
