"""Stored responses' records (`firsttoken/api/responses/records.py`) on a fake clock: their
retention, each key's caps in count and bytes, and that a refusal stores nothing; the Redis
path against a real redis-server."""

from __future__ import annotations

import anyio
import pytest

from firsttoken.api.responses.records import Kept, ResponseRecords
from firsttoken.formats.errors import APIError
from firsttoken.redisclient import redis_client
from tests.redis_server import run_redis
from tests.unit.clock import FakeClock


def kept(tenant: str = "alice", text: str = "hi") -> Kept:
    return Kept(tenant, [{"id": "msg_1", "type": "message", "role": "user", "content": text}])


def records(count: int = 3, size: int = 10_000, clock: FakeClock | None = None) -> ResponseRecords:
    return ResponseRecords(count, size, clock=clock or FakeClock())


def test_a_record_is_found_until_its_ttl_then_gone_and_uncounted() -> None:
    clock = FakeClock()
    kept_ = records(clock=clock)

    async def main() -> None:
        await kept_.keep("resp_a", kept(), 10.0)
        assert (await kept_.find("resp_a")) == kept()
        assert kept_.held("alice")[0] == 1
        clock.advance(9.9)
        assert await kept_.find("resp_a") is not None
        clock.advance(0.1)
        assert await kept_.find("resp_a") is None
        assert kept_.held("alice") == (0, 0)

    anyio.run(main)


def test_kept_again_it_lives_from_then_and_counts_once() -> None:
    clock = FakeClock()
    kept_ = records(clock=clock)

    async def main() -> None:
        await kept_.keep("resp_a", kept(), 10.0)
        clock.advance(5)
        answered = kept()
        answered.response = {"id": "resp_a", "status": "completed", "output": []}
        await kept_.keep("resp_a", answered, 10.0)  # a whole answer's Response, added
        assert kept_.held("alice") == (1, len(answered.encode()))
        clock.advance(6)  # past the first keep's expiry: the second holds
        assert (await kept_.find("resp_a")) == answered
        clock.advance(4)
        assert await kept_.find("resp_a") is None

    anyio.run(main)


def test_a_key_over_its_count_is_refused_429_and_others_are_not() -> None:
    clock = FakeClock()
    kept_ = records(count=2, clock=clock)

    async def main() -> None:
        kept_.admit("alice", 10)
        await kept_.keep("resp_a", kept(), 10.0)
        await kept_.keep("resp_b", kept(), 20.0)
        with pytest.raises(APIError) as info:
            kept_.admit("alice", 10)
        assert info.value.status == 429 and info.value.param == "store"
        assert "--responses-max-per-key" in info.value.message
        kept_.admit("bob", 10)  # each key its own
        clock.advance(10)  # one expired: room again
        kept_.admit("alice", 10)
        await kept_.forget("resp_b")  # a delete frees its place at once
        assert kept_.held("alice") == (0, 0)

    anyio.run(main)


def test_bytes_are_capped_per_key_and_one_too_large_alone_is_a_400() -> None:
    kept_ = records(count=100, size=200)

    async def main() -> None:
        with pytest.raises(APIError) as alone:
            kept_.admit("alice", 201)
        assert alone.value.status == 400 and alone.value.param == "input"
        one = kept(text="x" * 100)
        await kept_.keep("resp_a", one, 10.0)
        with pytest.raises(APIError) as full:
            kept_.admit("alice", 200 - len(one.encode()) + 1)
        assert full.value.status == 429 and "bytes" in full.value.message
        kept_.admit("alice", 200 - len(one.encode()))

    anyio.run(main)


def test_a_refused_record_is_not_stored() -> None:
    kept_ = records(count=1)

    async def main() -> None:
        await kept_.keep("resp_a", kept(), 10.0)
        with pytest.raises(APIError):
            kept_.admit("alice", 10)
        assert kept_.held("alice")[0] == 1
        assert await kept_.find("resp_b") is None

    anyio.run(main)


def test_in_redis_any_client_reads_it_and_it_expires_there() -> None:
    with run_redis() as url:

        async def main() -> None:
            client = redis_client(url, max_connections=2)
            one = ResponseRecords(3, 10_000, redis=client)
            other = ResponseRecords(3, 10_000, redis=redis_client(url, max_connections=2))
            await one.keep("resp_a", kept(), 0.3)
            assert (await other.find("resp_a")) == kept()  # another instance's
            assert 0 < await client.pttl("ft:resp:resp_a") <= 300
            await other.forget("resp_a")  # deleted through the other
            assert await one.find("resp_a") is None
            await one.keep("resp_b", kept(), 0.05)
            await anyio.sleep(0.2)
            assert await other.find("resp_b") is None

        anyio.run(main)


def test_redis_down_is_a_503_store_unavailable() -> None:
    async def main() -> None:
        kept_ = ResponseRecords(
            3, 10_000, redis=redis_client("redis://127.0.0.1:1/0", max_connections=1)
        )
        with pytest.raises(APIError) as info:
            await kept_.keep("resp_a", kept(), 1.0)
        assert info.value.status == 503
        assert kept_.held("alice") == (0, 0)  # nothing counted for what was not stored

    anyio.run(main)
