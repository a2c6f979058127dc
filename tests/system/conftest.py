from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

_COLLECT_EVERY = 100  # tests between full collections
_tests = 0


@pytest.fixture(autouse=True)
def _no_full_collection_inside_a_test() -> Iterator[None]:
    """Late in a run this process holds ~1M objects, and a full collection of them (0.3-0.5 s)
    pauses every thread: a timing test saw all of its readers, on two servers, stall at once
    for as long (a CI failure). What a test inherits is frozen (never scanned again); it is
    collected between tests instead, every `_COLLECT_EVERY`."""
    global _tests
    _tests += 1
    if _tests % _COLLECT_EVERY == 0:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    yield
