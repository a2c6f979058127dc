"""firsttoken.client: invisible resume, truncation detection, partial text kept."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from firsttoken.client import AsyncClient, Client, StreamError, StreamInterrupted
from firsttoken.engines import synthetic_tokens
from tests.proxy import CuttableProxy
from tests.servers import Server, run_server

MSG = [{"role": "user", "content": "client"}]


def test_chat_and_native_complete(server: Server) -> None:
    with Client(server.url) as c:
        answer = c.chat(MSG, max_tokens=30, seed=2)
        assert list(answer) == synthetic_tokens("user: client", 2, 30)[0]
        assert answer.done and answer.finish_reason == "length" and not answer.interrupted
        native = c.stream("native prompt", max_tokens=12)
        assert "".join(native) == "".join(synthetic_tokens("native prompt", None, 12)[0])
        assert native.usage == {"prompt_tokens": 2, "completion_tokens": 12, "total_tokens": 14}


def test_async_client(server: Server) -> None:
    async def run() -> str:
        async with AsyncClient(server.url) as c:
            answer = await c.stream("async prompt", max_tokens=15)
            return "".join([d async for d in answer])

    assert asyncio.run(run()) == "".join(synthetic_tokens("async prompt", None, 15)[0])


def test_async_client_every_call_is_awaited(server: Server) -> None:
    """One shape for every call, the openai SDK's: `answer = await client.X(...)`, then
    `async for`. (`await client.chat(...)` raised TypeError; issue 26.)"""

    async def run() -> tuple[list[str], str, str, list[str]]:
        async with AsyncClient(server.url) as c:
            chat = await c.chat(MSG, max_tokens=30, seed=2)
            deltas = [d async for d in chat]
            assert chat.done and chat.finish_reason == "length"
            native = await c.stream("native prompt", max_tokens=12)
            first = ""
            async for delta in native:
                first = delta
                break  # read one token, then resume the stream from where it was left
            again = await c.resume(native.stream_id, native.resume_token)
            whole = "".join([d async for d in again])
            # The older form, without await, still iterates.
            old_form = [d async for d in c.chat(MSG, max_tokens=30, seed=2)]
            return deltas, first, whole, old_form

    deltas, first, whole, old_form = asyncio.run(run())
    assert deltas == synthetic_tokens("user: client", 2, 30)[0] == old_form
    native = "".join(synthetic_tokens("native prompt", None, 12)[0])
    assert first and whole == native


def test_error_event_raises_with_partial_text(server: Server) -> None:
    with Client(server.url) as c:
        answer = c.chat(MSG, max_tokens=40, synthetic={"fail_after": 6, "error_code": "boom"})
        with pytest.raises(StreamError) as info:
            for _ in answer:
                pass
    assert info.value.code == "boom"
    assert info.value.text == "".join(synthetic_tokens("user: client", None, 40)[0][:6])


def test_cut_connection_resumes_invisibly() -> None:
    with run_server(
        "--synthetic-ttft-ms", "10", "--synthetic-itl-ms", "10", "--openai-grace-s", "5"
    ) as srv:
        proxy = CuttableProxy(srv.port)
        try:
            with Client(f"http://127.0.0.1:{proxy.port}", backoff_s=0.05) as c:
                cases = [
                    (lambda: c.chat(MSG, max_tokens=80, seed=1), "user: client", 1),
                    (lambda: c.stream("cut me", max_tokens=80), "cut me", None),
                ]
                for start, prompt, seed in cases:
                    answer = start()
                    got = []
                    for i, delta in enumerate(answer):
                        got.append(delta)
                        if i in (9, 40):
                            proxy.cut()
                    assert answer.reconnects >= 2 and answer.done
                    assert got == synthetic_tokens(prompt, seed, 80)[0]
        finally:
            proxy.close()


def test_killed_server_reports_interrupted_and_keeps_partial() -> None:
    with run_server("--synthetic-ttft-ms", "10", "--synthetic-itl-ms", "20") as srv:
        expected = synthetic_tokens("kill", None, 200)[0]
        got: list[str] = []
        with Client(srv.url, max_retries=2, backoff_s=0.05) as c:
            answer = c.stream("kill", max_tokens=200)
            with pytest.raises(StreamInterrupted) as info:
                for delta in answer:
                    got.append(delta)
                    if len(got) == 10:
                        threading.Thread(target=srv.kill, args=(signal.SIGKILL,)).start()
        assert answer.interrupted
        assert 10 <= len(got) < 200
        assert info.value.text == "".join(got) == "".join(expected[: len(got)])
        assert int(info.value.last_event_id) >= len(got)  # ids also count meta events


def test_resume_after_ttl_is_a_clear_error() -> None:
    with (
        run_server(
            "--resume-ttl-s", "0.2", "--synthetic-ttft-ms", "1", "--synthetic-itl-ms", "1"
        ) as srv,
        Client(srv.url, max_retries=0) as c,
    ):
        answer = c.stream("ttl", max_tokens=5)
        assert len(list(answer)) == 5
        time.sleep(1.5)
        late = c.resume(answer.stream_id, answer.resume_token, last_event_id="2")
        with pytest.raises(StreamInterrupted) as info:
            list(late)
        assert "no such stream" in info.value.reason
