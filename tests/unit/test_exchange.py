"""The event stream's transport (`wire/exchange.py`): the body's framing, set-up's held
writes, the ASGI fallback, and the uvicorn release wire/ subclasses."""

from __future__ import annotations

import asyncio
import re
import tomllib
from pathlib import Path
from typing import Any

import uvicorn

from firsttoken.wire.exchange import (
    UVICORN_MINOR,
    AsgiExchange,
    ChunkedBody,
    RawBody,
    open_exchange,
)

ROOT = Path(__file__).resolve().parents[2]


class Transport:
    def __init__(self, unsent: int = 0) -> None:
        self.writes: list[bytes] = []
        self.closing = False
        self.buffered = unsent

    def write(self, data: bytes) -> None:
        if self.closing:
            raise RuntimeError("closed")
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def close(self) -> None:
        self.closing = True


def test_the_installed_uvicorn_is_the_release_whose_classes_are_subclassed() -> None:
    """wire/connection.py and wire/cycle.py subclass uvicorn 0.54's protocol and cycle: another
    minor release may change them under us, so this fails on it (and pyproject pins it)."""
    installed = tuple(int(part) for part in uvicorn.__version__.split(".")[:2])
    assert installed == UVICORN_MINOR
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [p for p in pins if re.match(r"uvicorn\b", p)]
    major, minor = UVICORN_MINOR
    assert f">={major}.{minor}" in pin and f"<{major}.{minor + 1}" in pin


def test_a_chunked_body_frames_each_write_and_ends_itself_with_the_last() -> None:
    transport = Transport()
    body = ChunkedBody(transport)
    body.write(b"data: a\n\n")
    body.write_last(b"data: [DONE]\n\n")
    assert transport.writes == [b"9\r\ndata: a\n\n\r\n", b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"]
    assert body.ends_body


def test_a_raw_body_writes_the_bytes_as_they_are() -> None:
    transport = Transport()
    body = RawBody(transport)
    body.write(b"data: a\n\n")
    assert transport.writes == [b"data: a\n\n"]
    assert not body.ends_body


def test_set_up_writes_are_held_behind_the_head_and_leave_in_one_write() -> None:
    transport = Transport()
    body = ChunkedBody(transport)
    body.hold(b"HEAD")
    body.write(b"x")
    assert transport.writes == [] and body.held() == len(b"HEAD") + len(b"1\r\nx\r\n")
    body.release()
    assert transport.writes == [b"HEAD1\r\nx\r\n"]
    assert body.held() == 0
    body.release()  # once only
    assert len(transport.writes) == 1


def test_held_writes_to_a_closed_connection_are_dropped_and_later_ones_raise() -> None:
    transport = Transport()
    body = ChunkedBody(transport)
    body.hold(b"HEAD")
    body.write(b"x")
    transport.close()
    assert body.is_closing()
    body.release()  # nobody to write to: dropped, no error
    assert transport.writes == []
    try:
        body.write(b"y")
    except RuntimeError:
        pass
    else:
        raise AssertionError("a write to a closed transport must raise")


def test_unsent_is_the_transports_buffer_even_while_held() -> None:
    transport = Transport(unsent=123)
    body = ChunkedBody(transport)
    body.hold(b"")
    assert body.unsent() == 123


def test_without_our_protocol_the_head_goes_through_asgi_and_the_body_by_a_task() -> None:
    sent: list[dict[str, Any]] = []
    disconnect = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    class Listener:
        lost = False

        def pause_writing(self) -> None: ...

        def resume_writing(self) -> None: ...

        def connection_lost(self) -> None:
            self.lost = True

    async def main() -> Listener:
        exchange = await open_exchange({"type": "http"}, receive, send, [(b"a", b"b")])
        assert isinstance(exchange, AsgiExchange)
        listener = Listener()
        async with exchange.attached(listener):
            exchange.body.write(b"one")
            exchange.body.write(b"two")
            await asyncio.sleep(0.01)
            disconnect.set()
            await asyncio.sleep(0.01)
        assert await exchange.end(b"tail", 1.0)
        return listener

    listener = asyncio.run(main())
    assert sent[0] == {"type": "http.response.start", "status": 200, "headers": [(b"a", b"b")]}
    assert sent[1] == {"type": "http.response.body", "body": b"onetwo", "more_body": True}
    assert sent[-1] == {"type": "http.response.body", "body": b"tail", "more_body": False}
    assert listener.lost
