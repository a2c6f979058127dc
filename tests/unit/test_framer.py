"""The framer (`core/framer.py`): a renderer's events as numbered SSE frames in the log; text
through one template per run, or through the coalescer; meta only where the format shows it."""

from __future__ import annotations

import asyncio

import orjson

from firsttoken.core.chunking import CoalescePolicy
from firsttoken.core.framer import Framer
from firsttoken.eventlog import EventLog
from firsttoken.formats.render import NativeRenderer
from firsttoken.formats.sse import event_id_of, ids_from
from firsttoken.generation import Delta
from tests.unit import virtual_loop


def _framer(*, binary: bool = False, shows_meta: bool = True) -> Framer:
    return Framer(NativeRenderer(binary=binary), EventLog(100), shows_meta=shows_meta)


def _data(log: EventLog) -> list[tuple[str | None, object]]:
    out: list[tuple[str | None, object]] = []
    for event in log.after(0):
        lines = event.wire.decode().strip().split("\n")
        name = next((x[7:] for x in lines if x.startswith("event: ")), None)
        data = next(x[6:] for x in lines if x.startswith("data: "))
        out.append((name, orjson.loads(data)))
    return out


def test_a_text_run_hands_the_stream_its_template_when_nothing_else_watches_it() -> None:
    framer = _framer()
    framer.opening(None)
    take = framer.enter_text()
    assert take == framer.text and framer.hot() and framer.template is not None
    take("a")
    log = framer.log
    # The stream's hot path: the template, its seq and the JSON text, nothing else.
    log.append(framer.template % (log.last_seq + 1, b'"b"'), 1)
    assert _data(log) == [(None, {"token": "a"}), (None, {"token": "b"})]


def test_a_takeovers_events_are_numbered_as_their_new_owners() -> None:
    framer = _framer()
    framer.opening(None)
    framer.enter_text()("a")
    framer.number_as(3)  # the template of the run going on is framed again
    framer.text("b")
    framer.append("meta", b"{}")
    ids = [event_id_of(e.wire) for e in framer.log.after(0)]
    assert ids == [1, 2 + ids_from(3), 3 + ids_from(3)]


def test_a_renderer_without_a_template_frames_each_token_itself() -> None:
    framer = _framer(binary=True)
    framer.opening(None)
    framer.enter_text()("a")
    assert framer.template is None  # the stream has no hot path then
    assert framer.log.after(0)[0].wire == b"id: 1\nevent: token\ndata: YQ==\n\n"


def test_coalesced_text_leaves_in_chunks_and_its_end_disarms_the_timer() -> None:
    async def body() -> None:
        framer = _framer()
        framer.opening(CoalescePolicy(max_wait_s=10.0))
        take = framer.enter_text()
        assert take == framer.coalesce and not framer.hot()
        for token in ("a", "b", "c", "d"):
            take(token)
        assert framer.log.last_seq == 1  # the first token alone; the rest under a timer
        framer.flush()  # the stream's end: what is pending leaves, then nothing more
        framer.close()
        assert _data(framer.log) == [(None, {"token": "a"}), (None, {"token": "bcd"})]
        await asyncio.sleep(20)  # the timer that was armed fires no more
        assert framer.log.last_seq == 2

    virtual_loop.run(body())


def test_a_pending_chunk_leaves_at_its_deadline() -> None:
    async def body() -> None:  # on a real loop: the coalescer reads the real clock
        framer = _framer()
        framer.opening(CoalescePolicy(max_wait_s=0.05))
        take = framer.enter_text()
        take("a")
        take("b")
        await asyncio.sleep(0.2)
        assert _data(framer.log) == [(None, {"token": "a"}), (None, {"token": "b"})]

    asyncio.run(body())


def test_a_structured_part_flushes_the_text_before_it_and_counts_one_token() -> None:
    async def body() -> None:
        framer = _framer()
        framer.opening(CoalescePolicy(max_wait_s=10.0))
        take = framer.enter_text()
        take("a")
        take("b")
        framer.part(Delta(reasoning="thinking"))
        got = _data(framer.log)
        assert got[1] == (None, {"token": "b"}) and got[2][1] == {"reasoning": "thinking"}
        assert [e.tokens for e in framer.log.after(0)] == [1, 1, 1]
        framer.close()

    virtual_loop.run(body())


def test_meta_is_framed_only_for_a_format_that_shows_it() -> None:
    hidden = _framer(shows_meta=False)
    assert not hidden.meta({"splice": {"at_token": 3}}) and hidden.log.last_seq == 0
    shown = _framer(shows_meta=True)
    assert shown.meta({"splice": {"at_token": 3}})
    assert _data(shown.log) == [("meta", {"splice": {"at_token": 3}})]
