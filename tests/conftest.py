from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.postgres_server import PostgresServer, postgres_server
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


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One real PostgreSQL for the session; each test takes a database of its own
    (`postgres.new_database()`)."""
    with postgres_server() as pg:
        yield pg
