"""LineSink: a turn of the event loop's lines in one write; off the loop, at once."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator

import pytest

from firsttoken.telemetry.logsink import LineSink


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read, write = os.pipe()
    os.set_blocking(read, False)
    yield read, write
    os.close(read)
    os.close(write)


def _available(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""


def test_off_the_loop_a_line_is_written_at_once(pipe: tuple[int, int]) -> None:
    read, write = pipe
    sink = LineSink(write)
    sink(b"one\n")
    assert _available(read) == b"one\n"


def test_a_turns_lines_wait_for_its_end_then_go_out_together(pipe: tuple[int, int]) -> None:
    read, write = pipe
    sink = LineSink(write)

    async def main() -> tuple[bytes, bytes]:
        for line in (b"a\n", b"b\n", b"c\n"):
            sink(line)
        during = _available(read)
        await asyncio.sleep(0)  # the turn ends; the flush runs
        return during, _available(read)

    during, after = asyncio.run(main())
    assert during == b""
    assert after == b"a\nb\nc\n"


def test_another_threads_line_is_not_held_by_the_loops_turn(pipe: tuple[int, int]) -> None:
    read, write = pipe
    sink = LineSink(write)

    async def main() -> bytes:
        sink(b"loop\n")
        thread = threading.Thread(target=sink, args=(b"thread\n",))
        thread.start()
        thread.join()
        seen = _available(read)
        await asyncio.sleep(0)
        return seen + _available(read)

    assert asyncio.run(main()) == b"thread\nloop\n"


def test_flush_writes_what_waits_once(pipe: tuple[int, int]) -> None:
    read, write = pipe
    sink = LineSink(write)

    async def main() -> tuple[bytes, bytes]:
        sink(b"last\n")
        sink.flush()  # what the server does before its loop ends
        flushed = _available(read)
        await asyncio.sleep(0)  # the turn's own flush finds nothing left
        return flushed, _available(read)

    assert asyncio.run(main()) == (b"last\n", b"")
    sink(b"after\n")  # no loop runs any more: at once
    assert _available(read) == b"after\n"
