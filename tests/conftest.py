from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import Server, run_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """One shared server with fast synthetic timing (TTFT 20 ms, ITL 2 ms).

    Its tests inject engine errors and open 200 streams at once on purpose, so the breaker and
    the new-stream rate limit are off here; their own tests turn them on.
    """
    with run_server(
        "--synthetic-ttft-ms",
        "20",
        "--synthetic-itl-ms",
        "2",
        "--breaker-error-rate",
        "1",
        "--rate-limit-per-s",
        "0",
    ) as s:
        yield s
