from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import Server, run_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """One shared server with fast synthetic timing (TTFT 20 ms, ITL 2 ms)."""
    with run_server("--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "2") as s:
        yield s
