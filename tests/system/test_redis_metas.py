"""New streams' metas reach a real Redis in one Lua call per turn of the loop: every field,
the owner and fence only where missing, the live TTL, and the script loaded again after
Redis lost it."""

from __future__ import annotations

import anyio
import redis

from firsttoken.eventlog import EventLog
from firsttoken.resume.redis import RedisStore
from firsttoken.resume.redis_keys import meta_key
from firsttoken.resume.store import StreamRecord
from tests.redis_server import run_redis

TTL_S = 60.0


def records(n: int, prefix: str) -> list[StreamRecord]:
    return [
        StreamRecord(
            f"{prefix}{i}",
            "openai" if i % 2 else "native",
            f"digest{i}",
            f"trace{i}",
            "model-é",  # not ASCII: lengths are bytes
            b'{"request": %d}' % i if i % 2 else None,
        )
        for i in range(n)
    ]


async def open_all(store: RedisStore, recs: list[StreamRecord]) -> None:
    for rec in recs:  # in one turn of the loop: one batch
        store.open(rec, TTL_S, EventLog(16))
    with anyio.fail_after(5):  # nothing waits for the write: the test does
        while True:
            if all(store._replicas[rec.id].meta_done for rec in recs):
                return
            await anyio.sleep(0.01)


def test_a_turns_new_streams_are_written_in_one_call() -> None:
    with run_redis() as url:
        probe = redis.Redis.from_url(url)
        # Another instance took s1 over while this one's meta write was on its way.
        probe.hset(meta_key("s1"), mapping={"owner": "elsewhere", "fence": 2})

        async def body() -> None:
            store = RedisStore(url, max_events=16, max_connections=2)
            async with anyio.create_task_group() as tg:
                await tg.start(store.run, lambda _sid: None)
                before = probe.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
                await open_all(store, records(5, "s"))
                after = probe.info("commandstats")["cmdstat_evalsha"]["calls"]
                assert after - before == 1  # five streams, one call
                assert store.up
                assert all(store._replicas[f"s{i}"].meta_done for i in range(5))
                probe.script_flush()  # as after a Redis restart: the script must come back
                await open_all(store, records(3, "t"))
                assert store.up and all(store._replicas[f"t{i}"].meta_done for i in range(3))
                tg.cancel_scope.cancel()

        anyio.run(body)
        for i in range(5):
            meta = {k.decode(): v for k, v in probe.hgetall(meta_key(f"s{i}")).items()}
            assert meta["kind"] == (b"openai" if i % 2 else b"native")
            assert meta["digest"] == b"digest%d" % i and meta["trace"] == b"trace%d" % i
            assert meta["model"] == "model-é".encode()
            assert meta["takeover"] == (b"1" if i % 2 else b"0")
            assert meta.get("req") == (b'{"request": %d}' % i if i % 2 else None)
            assert "outcome" not in meta
            if i == 1:  # set only where missing: the takeover stands
                assert meta["owner"] == b"elsewhere" and meta["fence"] == b"2"
            else:
                assert meta["owner"] != b"elsewhere" and meta["fence"] == b"1"
            assert TTL_S < probe.ttl(meta_key(f"s{i}")) <= TTL_S + 3600
        assert probe.exists(*(meta_key(f"t{i}") for i in range(3))) == 3


def test_large_requests_go_in_calls_of_a_mebibyte_so_redis_serves_others_between() -> None:
    """A Lua call holds Redis for its whole length: 50 metas of 1 MB each in one call kept
    every other client waiting 243 ms."""
    with run_redis() as url:
        probe = redis.Redis.from_url(url)

        async def body() -> None:
            store = RedisStore(url, max_events=16, max_connections=2)
            async with anyio.create_task_group() as tg:
                await tg.start(store.run, lambda _sid: None)
                before = probe.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
                big = [
                    StreamRecord(f"big{i}", "native", "d", "t", "m", b"x" * 400_000)
                    for i in range(6)
                ]
                await open_all(store, big)
                after = probe.info("commandstats")["cmdstat_evalsha"]["calls"]
                assert after - before == 3  # 2.4 MB: two of 0.8 MB a call
                assert all(probe.hexists(meta_key(r.id), "req") for r in big)
                tg.cancel_scope.cancel()

        anyio.run(body)
