"""Instances on a real Redis Cluster (`--redis-cluster`): three masters started here, each a
redis-server on a loopback port, `--redis` naming one of them.

A stream started on A resumes token-exact on B and is cancelled from B; per-key slots and the
new-stream bucket hold across instances; readers of A's streams on B share one tail of at most
one blocked connection per key group; a slot moved to another master under a live stream
(MOVED, ASK) loses nothing; a master killed under live streams, its replica promoted, leaves
every reader either exact or told (`event: error`), and the owner writes its streams again.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from redis.crc import key_slot

from firsttoken.engines import synthetic_tokens
from firsttoken.redisclient import redis_client
from firsttoken.resume.redis_keys import events_key, group_of, meta_key
from tests.events import tokens_of
from tests.rawhttp import RawStream
from tests.redis_server import RedisClusterServers, redis_cluster, run_redis
from tests.servers import Server, run_server, wait_for
from tests.system.test_startup import one_failure_line, serve

KEYS = (
    '[[keys]]\nname = "alice"\nkey = "sk-alice"\nmax_streams = 50\n'
    '[[keys]]\nname = "bob"\nkey = "sk-bob"\nmax_streams = 1\n'
)
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


def args(url: str, keys: Path, *extra: str) -> tuple[str, ...]:
    return (
        "--redis", url, "--redis-cluster", "--api-keys", str(keys),
        "--synthetic-ttft-ms", "10", "--synthetic-itl-ms", "20", "--resume-grace-s", "10",
        *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def fleet(keys: Path) -> Iterator[tuple[RedisClusterServers, Server, Server]]:
    with redis_cluster(masters=3) as cluster:
        # A and B name different nodes: either one finds the rest.
        b_url = f"redis://127.0.0.1:{cluster.ports[1]}/0"
        with run_server(*args(cluster.url, keys)) as a, run_server(*args(b_url, keys)) as b:
            yield cluster, a, b


def create(
    server: Server, prompt: str, max_tokens: int, headers: dict = ALICE, ttft_ms: int = 10
) -> dict:
    r = httpx.post(
        server.v1 + "/streams",
        json={"prompt": prompt, "max_tokens": max_tokens, "synthetic": {"ttft_ms": ttft_ms}},
        headers=headers,
        timeout=10,
    )
    assert r.status_code == 201, r.text
    return r.json()


def read(server: Server, created: dict, last_id: str = "0") -> tuple[list, bool, dict | None]:
    r = httpx.get(
        server.url + created["events_url"], headers={"Last-Event-ID": last_id}, timeout=40
    )
    assert r.status_code == 200, r.text
    tokens, _, done, error = tokens_of(r.content)
    return tokens, done, error


def partly(server: Server, created: dict, tokens: int) -> RawStream:
    s = RawStream(server.port, "GET", created["events_url"])
    while s.body.count(b'{"token":') < tokens:
        s.read_chunk()
    return s


def test_resume_and_cancel_across_instances(
    fleet: tuple[RedisClusterServers, Server, Server],
) -> None:
    _, a, b = fleet
    # Streams in several groups, so on several masters.
    groups = set()
    for i in range(6):
        prompt = f"cluster {i}"
        created = create(a, prompt, 40)
        groups.add(group_of(created["id"]))
        s = partly(a, created, 5)
        s.close()
        first, last_id, _, _ = tokens_of(s.body)
        rest, done, error = read(b, created, last_id)
        assert (first + rest, done, error) == (synthetic_tokens(prompt, None, 40)[0], True, None)
    assert len(groups) > 1
    running = create(a, "cancel me", 500)
    wait_for(lambda: a.metric("firsttoken_active_streams") >= 1)
    url = f"{b.v1}/streams/{running['id']}/cancel?token={running['resume_token']}"
    r = httpx.post(url, timeout=10)
    assert r.status_code == 200 and r.json()["outcome"] == "cancelled"


def test_per_key_slots_hold_across_instances(
    fleet: tuple[RedisClusterServers, Server, Server],
) -> None:
    _, a, b = fleet
    held = create(a, "bob's one", 500, BOB)
    again = httpx.post(b.v1 + "/streams", json={"prompt": "x"}, headers=BOB, timeout=10)
    assert again.status_code == 429, again.text
    assert again.json()["error"]["code"] == "concurrency_limit_exceeded"
    httpx.post(f"{a.v1}/streams/{held['id']}/cancel?token={held['resume_token']}", timeout=10)
    wait_for(
        lambda: (
            httpx.post(
                b.v1 + "/streams", json={"prompt": "y", "max_tokens": 2}, headers=BOB, timeout=10
            ).status_code
            == 201
        ),
        timeout=10,
    )
    for server in (a, b):
        assert server.metric("firsttoken_redis_limits_fallback_total") == 0


def test_followers_on_b_share_one_tail_per_group(
    fleet: tuple[RedisClusterServers, Server, Server],
) -> None:
    cluster, a, b = fleet
    prompts = [f"follow {i}" for i in range(40)]
    # No token for 3 s: every reader is attached, its lane blocked, before the first.
    created = [create(a, p, 30, ttft_ms=3000) for p in prompts]
    results: list[tuple[list, bool, dict | None]] = [([], False, None)] * len(created)

    def one(i: int) -> None:
        results[i] = read(b, created[i])

    readers = [threading.Thread(target=one, args=(i,)) for i in range(len(created))]
    for t in readers:
        t.start()
    blocked = 0
    probes = [redis.Redis(port=p) for p in cluster.master_ports()]
    while any(t.is_alive() for t in readers):
        blocked = max(blocked, sum(int(p.info("clients")["blocked_clients"]) for p in probes))
        time.sleep(0.02)
    for p in probes:
        p.close()
    for prompt, got in zip(prompts, results, strict=True):
        assert got == (synthetic_tokens(prompt, None, 30)[0], True, None)
    groups = len({group_of(c["id"]) for c in created})
    assert 1 <= blocked <= groups, (blocked, groups)  # a lane per group, not per reader


def test_a_burst_past_the_pool_waits_for_connections(
    fleet: tuple[RedisClusterServers, Server, Server],
) -> None:
    """redis-py's cluster pools refuse a call past `max_connections` at once (a burst of
    admissions taken for an outage); ours wait for a turn: 300 calls and 30 pipelines at
    once on 4 connections all go through, and no node opens more than 4."""
    cluster, _, _ = fleet

    async def main() -> list[int]:
        client = redis_client(cluster.url, max_connections=4, cluster=True)
        try:
            counted = await asyncio.gather(*(client.incr("{burst}:calls") for _ in range(300)))

            async def piped(i: int) -> list[int]:
                async with client.pipeline(transaction=False) as pipe:
                    pipe.incr(f"{{burst-{i % 3}}}:a")
                    pipe.incr(f"{{other-{i % 5}}}:b")
                    return await pipe.execute()

            await asyncio.gather(*(piped(i) for i in range(30)))
            opened = [len(node._connections) for node in client.get_nodes()]
            assert max(opened) <= 4, opened
            return sorted(counted)
        finally:
            await client.aclose()

    assert asyncio.run(main()) == list(range(1, 301))


def test_a_slot_moved_under_a_live_stream_loses_nothing(
    fleet: tuple[RedisClusterServers, Server, Server],
) -> None:
    cluster, a, b = fleet
    created = create(a, "moving", 150)  # ~3 s
    sid = created["id"]
    slot = key_slot(group_of(sid).encode())
    source = cluster.master_of_slot(slot)
    target = next(p for p in cluster.master_ports() if p != source)
    local = partly(a, created, 10)
    remote: list[tuple[list, bool, dict | None]] = []
    follower = threading.Thread(target=lambda: remote.append(read(b, created)))
    follower.start()
    time.sleep(0.5)
    move_slot(cluster, slot, source, target)  # ASK while keys move, then MOVED
    assert cluster.master_of_slot(slot) == target
    expected = synthetic_tokens("moving", None, 150)[0]
    tokens, _, done, error = tokens_of(local.read_all())
    assert (tokens, done, error) == (expected, True, None)
    follower.join(40)
    assert remote == [(expected, True, None)]
    assert read(b, created) == (expected, True, None)
    with redis.Redis(port=target) as r:
        assert r.exists(events_key(sid), meta_key(sid)) == 2


def move_slot(cluster: RedisClusterServers, slot: int, source: int, target: int) -> None:
    """Move one slot with its keys, as `redis-cli --cluster reshard` does, key by key."""
    src, dst = redis.Redis(port=source), redis.Redis(port=target)
    try:
        src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 10):
            for key in keys:
                src.execute_command("MIGRATE", "127.0.0.1", target, key, 0, 5000)
            time.sleep(0.05)  # the owner writes on meanwhile: ASK sends it to the target
        for port in cluster.master_ports():
            with redis.Redis(port=port) as r:
                r.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    finally:
        src.close()
        dst.close()


def test_a_master_killed_under_live_streams(keys: Path) -> None:
    """Its replica takes over (1 s node timeout): the owner's local readers never notice, a
    reader on B ends exact or is told (never a stream with a hole), and once the owner sees
    the new master it writes every kept stream again, so a resume from the start is exact."""
    with redis_cluster(masters=3, replicas=1) as cluster:
        with run_server(*args(cluster.url, keys)) as a, run_server(*args(cluster.url, keys)) as b:
            prompts = [f"failover {i}" for i in range(8)]
            created = [create(a, p, 200) for p in prompts]  # ~4 s each
            slots = {key_slot(group_of(c["id"]).encode()) for c in created}
            victim = cluster.master_of_slot(min(slots))
            hit = [
                c
                for c in created
                if cluster.master_of_slot(key_slot(group_of(c["id"]).encode())) == victim
            ]
            local = [partly(a, c, 5) for c in created]
            remote: dict[str, tuple[list, bool, dict | None]] = {}
            failed: dict[str, str] = {}

            def follow(c: dict) -> None:
                try:
                    remote[c["id"]] = read(b, c)
                except Exception as exc:  # said below, with the stream
                    failed[c["id"]] = repr(exc)

            followers = [threading.Thread(target=follow, args=(c,)) for c in created]
            for t in followers:
                t.start()
            time.sleep(1.0)
            cluster.kill(victim)
            wait_for(lambda: victim not in cluster.master_ports(), timeout=30)
            cluster.wait_ok(timeout=30)  # its replica promoted
            for prompt, s in zip(prompts, local, strict=True):
                tokens, _, done, error = tokens_of(s.read_all())
                assert (tokens, done, error) == (synthetic_tokens(prompt, None, 200)[0], True, None)
            for t in followers:
                t.join(60)
            assert not failed, failed
            told = 0
            for prompt, c in zip(prompts, created, strict=True):
                expected = synthetic_tokens(prompt, None, 200)[0]
                tokens, done, error = remote[c["id"]]
                if error is None:
                    assert (tokens, done) == (expected, True)  # exact, never silently short
                else:
                    told += 1
                    assert tokens == expected[: len(tokens)] and not done
            wait_for(lambda: any(
                r["event"] in ("redis.resync", "redis.masters_changed") for r in a.log_records()
            ), timeout=15)  # fmt: skip
            # Every stream is whole in Redis again: from the start, exact, on B.
            for prompt, c in zip(prompts, created, strict=True):
                assert read(b, c) == (synthetic_tokens(prompt, None, 200)[0], True, None)
            assert hit and told <= len(hit)
            for server in (a, b):
                assert server.proc.poll() is None


def test_the_wrong_kind_of_redis_is_one_startup_line(
    fleet: tuple[RedisClusterServers, Server, Server],
) -> None:
    cluster, _, _ = fleet
    error = one_failure_line(serve("--redis", cluster.url))
    assert (
        error == f"--redis {cluster.url}: this node is part of a Redis Cluster; add --redis-cluster"
    )
    with run_redis() as plain:
        error = one_failure_line(serve("--redis", plain, "--redis-cluster"))
    assert error == f"--redis {plain}: not a Redis Cluster node (--redis-cluster is on)"


def test_the_new_stream_bucket_is_shared_on_a_cluster(
    fleet: tuple[RedisClusterServers, Server, Server], keys: Path
) -> None:
    """One bucket for every instance, in its own slot: a burst of 3 over two instances takes
    it, the next is refused (and its key's slot, taken first on a cluster, given back)."""
    cluster, _, _ = fleet
    rate = ("--rate-limit-per-s", "0.2", "--rate-limit-burst", "3")
    with (
        run_server(*args(cluster.url, keys), *rate) as a,
        run_server(*args(cluster.url, keys), *rate) as b,
    ):
        codes = [
            httpx.post(
                s.v1 + "/streams", json={"prompt": "r", "max_tokens": 1}, headers=ALICE, timeout=10
            ).status_code
            for s in (a, b, a, b)
        ]
        assert codes == [201, 201, 201, 429], codes
        with redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0]) as r:
            # Well within the 5 s lease: the refused one gave its slot back at once.
            wait_for(lambda: r.zcard("ft:slots:{alice}") == 0, timeout=2)
