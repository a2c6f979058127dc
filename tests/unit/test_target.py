"""One target's slots on virtual time: a FIFO line under `max_concurrency`, `queue_timeout`
after `queue_timeout_s`, a slot handed to a waiter that leaves is passed on; and how a target
asks its engine."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from firsttoken.generation import Delta, EngineError, GenerationRequest
from firsttoken.routing.config import TargetConfig
from firsttoken.routing.target import Target
from tests.unit import virtual_loop
from tests.unit.scripted import Scripted


def target(engine: Any = None, **config: Any) -> Target:
    cfg = TargetConfig(name="a", kind="synthetic", continuation="native", **config)
    return Target(cfg, engine or Scripted())


def test_without_a_limit_every_stream_gets_a_slot_at_once() -> None:
    async def body() -> None:
        t = target()
        for _ in range(100):
            await t.take_slot()
        assert t.outstanding == 100 and t.queued == 0 and t.has_room()
        for _ in range(100):
            t.give_slot()
        assert t.outstanding == 0

    virtual_loop.run(body())


def test_a_full_target_serves_its_line_first_come_first_served() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        t = target(max_concurrency=1)
        await t.take_slot()
        order: list[str] = []

        async def wait(name: str) -> None:
            await t.take_slot()
            order.append(name)

        waiters = [asyncio.create_task(wait(n)) for n in ("b", "c", "d")]
        await asyncio.sleep(5)
        assert order == [] and t.queued == 3 and t.outstanding == 1
        t.give_slot()
        await asyncio.sleep(0)
        assert order == ["b"] and t.queued == 2 and t.outstanding == 1
        await asyncio.sleep(1)
        t.give_slot()
        await asyncio.sleep(0)
        t.give_slot()
        await asyncio.gather(*waiters)
        assert order == ["b", "c", "d"] and t.outstanding == 1
        assert t.queue_wait.sum == 17.0 and sum(t.queue_wait.counts) == 3
        assert loop.time() == virtual_loop.START + 6

    virtual_loop.run(body())


def test_a_new_stream_does_not_jump_the_line() -> None:
    async def body() -> None:
        t = target(max_concurrency=1)
        await t.take_slot()
        first = asyncio.create_task(t.take_slot())
        await asyncio.sleep(0)
        t.give_slot()  # handed to the waiter, not to whoever asks next
        late = asyncio.create_task(t.take_slot())
        await first
        await asyncio.sleep(1)
        assert not late.done() and t.queued == 1
        t.give_slot()
        await late

    virtual_loop.run(body())


def test_queue_timeout_after_queue_timeout_s() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        t = target(max_concurrency=1, queue_timeout_s=30)
        await t.take_slot()
        with pytest.raises(EngineError) as caught:
            await t.take_slot()
        assert loop.time() == virtual_loop.START + 30
        error = caught.value
        assert (error.code, error.status, error.retryable) == ("queue_timeout", 503, True)
        assert error.retry_after_s == 1.0
        assert "'a' stayed full for 30 s" in error.message
        assert t.queued == 0 and t.outstanding == 1
        t.give_slot()
        assert t.outstanding == 0

    virtual_loop.run(body())


def test_queue_timeout_0_refuses_a_full_target_at_once() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        t = target(max_concurrency=1, queue_timeout_s=0)
        await t.take_slot()
        with pytest.raises(EngineError, match="stayed full"):
            await t.take_slot()
        assert loop.time() == virtual_loop.START

    virtual_loop.run(body())


def test_a_waiter_that_leaves_is_out_of_the_line() -> None:
    async def body() -> None:
        t = target(max_concurrency=1)
        await t.take_slot()
        leaving = asyncio.create_task(t.take_slot())
        staying = asyncio.create_task(t.take_slot())
        await asyncio.sleep(1)
        leaving.cancel()
        await asyncio.sleep(0)
        assert t.queued == 1
        t.give_slot()
        await staying
        assert leaving.cancelled() and t.outstanding == 1 and t.queued == 0

    virtual_loop.run(body())


def test_a_slot_handed_to_a_waiter_as_it_leaves_goes_to_the_next() -> None:
    async def body() -> None:
        t = target(max_concurrency=1)
        await t.take_slot()
        leaving = asyncio.create_task(t.take_slot())
        staying = asyncio.create_task(t.take_slot())
        await asyncio.sleep(1)
        t.give_slot()  # handed to `leaving`...
        leaving.cancel()  # ...which leaves before it could run
        await staying
        assert leaving.cancelled()
        assert t.outstanding == 1 and t.queued == 0  # not leaked: `staying` holds it
        t.give_slot()
        assert t.outstanding == 0

    virtual_loop.run(body())


def test_a_slot_freed_as_the_wait_runs_out_is_not_lost() -> None:
    async def body() -> None:
        t = target(max_concurrency=1, queue_timeout_s=30)
        await t.take_slot()

        async def hold_then_free() -> None:
            await asyncio.sleep(30)  # frees it at the very instant the waiter gives up
            t.give_slot()

        holder = asyncio.create_task(hold_then_free())
        with pytest.raises(EngineError, match="stayed full"):
            await t.take_slot()
        await holder
        assert t.outstanding == 0 and t.queued == 0
        await t.take_slot()  # the slot is there for the next stream

    virtual_loop.run(body())


def test_the_request_goes_under_the_name_the_target_knows() -> None:
    async def body() -> None:
        engine = Scripted([Delta("hi", finish_reason="stop")])
        t = target(engine)
        request = GenerationRequest(request_id="r", prompt="p", model="chat")
        got = [d.text async for d in t.generate(request, "Qwen/Qwen3-8B")]
        assert got == ["hi"]
        assert engine.requests[0].model == "Qwen/Qwen3-8B"
        assert request.model == "chat"

    virtual_loop.run(body())


def test_whether_it_continues_comes_from_its_config() -> None:
    assert target().continues
    relay = TargetConfig(name="b", kind="openai", url="http://h/v1")  # continuation "none"
    assert not Target(relay, Scripted()).continues


def test_active_check() -> None:
    class Remote(Scripted):
        def __init__(self, answer: Any) -> None:
            super().__init__()
            self.answer = answer

        async def fetch_models(self) -> Any:
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    async def body() -> None:
        assert await target(Scripted()).check()  # nothing to ask: taken as up
        assert await target(Remote(["m"])).check()
        assert not await target(Remote(None)).check()
        assert not await target(Remote(OSError("refused"))).check()

    virtual_loop.run(body())


def _request(key: str, max_tokens: int = 100, priority: int = 0, weight: float = 1.0) -> Any:
    return GenerationRequest(
        request_id=key,
        prompt="",
        model="m",
        max_tokens=max_tokens,
        tenant=key,
        priority=priority,
        weight=weight,
    )


def test_a_flood_from_one_key_does_not_hold_back_another() -> None:
    # The flood: one key queues 24 long streams, a second key 4 a moment later, and a
    # priority key 1. The priority key goes first, then the two keys take turns by tokens.
    async def body() -> list[str]:
        t = target(max_concurrency=4)
        for _ in range(4):
            await t.take_slot()
        order: list[str] = []

        async def wait(name: str, key: str, priority: int = 0) -> None:
            await t.take_slot(_request(key, 150, priority))
            order.append(name)

        tasks = [asyncio.create_task(wait(f"flood{i}", "flood")) for i in range(24)]
        await asyncio.sleep(0.3)
        tasks += [asyncio.create_task(wait(f"polite{i}", "polite")) for i in range(4)]
        tasks.append(asyncio.create_task(wait("vip", "vip", priority=5)))
        await asyncio.sleep(0.1)
        for _ in range(11):
            t.give_slot()
            await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        return order

    order = virtual_loop.run(body())
    assert order[0] == "vip"
    # The two keys take turns of QUANTUM tokens (three 150-token streams each): the polite
    # key's four are served within the next ten slots, not 25th to 28th behind the flood.
    assert sorted(n for n in order[1:11] if n.startswith("polite")) == [
        "polite0",
        "polite1",
        "polite2",
        "polite3",
    ]


def test_weights_share_a_full_target_by_tokens() -> None:
    async def body() -> list[str]:
        t = target(max_concurrency=1)
        await t.take_slot()
        order: list[str] = []

        async def wait(key: str, weight: float, max_tokens: int) -> None:
            await t.take_slot(_request(key, max_tokens, weight=weight))
            order.append(key)

        tasks = [asyncio.create_task(wait("heavy", 3.0, 500)) for _ in range(20)]
        tasks += [asyncio.create_task(wait("light", 1.0, 500)) for _ in range(20)]
        await asyncio.sleep(0)
        for _ in range(16):
            t.give_slot()
            await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        return order

    order = virtual_loop.run(body())
    # Three to one in tokens: of 16 equal requests, 12 and 4.
    assert order.count("heavy") == 12 and order.count("light") == 4


def test_a_waiter_that_leaves_leaves_the_line() -> None:
    async def body() -> None:
        t = target(max_concurrency=1)
        await t.take_slot()
        gone = asyncio.create_task(t.take_slot(_request("a")))
        stays = asyncio.create_task(t.take_slot(_request("b")))
        await asyncio.sleep(0)
        assert t.queued == 2
        gone.cancel()
        await asyncio.sleep(0)
        assert t.queued == 1
        t.give_slot()
        await stays
        assert t.outstanding == 1 and t.queued == 0

    virtual_loop.run(body())


def test_the_queue_charges_the_prompt_as_admission_counted_it() -> None:
    # Issue 37.5: a large prompt was counted up to three times per request on the event loop
    # (admission, this charge, short_prompts); the count admission took goes with it.
    async def body() -> None:
        engine = Scripted()
        t = target(engine, max_concurrency=1)
        await t.take_slot(_request("a"))
        big = replace(_request("b"), prompt="a " * 450_000, prompt_tokens=7)
        waiting = asyncio.ensure_future(t.take_slot(big))
        await asyncio.sleep(0)
        [(_, _, waiter)] = t.queue._classes[0].heap
        assert waiter.cost == 7 + 100
        assert engine.counted == []  # not counted again
        t.give_slot()
        await waiting

    virtual_loop.run(body())
