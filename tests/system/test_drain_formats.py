"""A deploy no SDK reader notices: real instances on one real redis-server, read through the
official `openai` and `anthropic` SDKs, the instance serving them SIGTERMed (a rolling
deploy), run out of drain time, SIGKILLed, or paused until another instance took their
stream. A stream ends complete, or with an error the SDK raises: never short and clean."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from firsttoken.engines.synthetic import synthetic_tokens
from tests.nginx import MULTI_CONF, run_nginx
from tests.rawhttp import RawStream
from tests.redis_server import run_redis
from tests.servers import Server, run_server, wait_for
from tests.system.test_takeover import native, read_to_end, read_until, resume

SYNTHETIC = {"itl_ms": 20}
COMMON = ("--synthetic-ttft-ms", "30")


@pytest.fixture
def redis_url() -> Iterator[str]:
    with run_redis() as url:
        yield url


def _openai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=30)


def _anthropic(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


class Reading:
    """One SDK stream read by a thread: its text so far, whether its format's last event
    came, and what the SDK raised."""

    def __init__(self, name: str, read: Callable[[Reading], None]) -> None:
        self.name = name
        self.text = ""
        self.parts = 0
        self.complete = False
        self.raised: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(read,), daemon=True)
        self._thread.start()

    def _run(self, read: Callable[[Reading], None]) -> None:
        try:
            read(self)
        except BaseException as exc:  # what the SDK raised is the result
            self.raised = exc

    def add(self, text: str | None) -> None:
        if text:
            self.text += text
            self.parts += 1

    def join(self, timeout: float = 30) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self.name} hung"

    @property
    def ended_clean_short(self) -> bool:
        return self.raised is None and not self.complete


def _chat(server: Server, prompt: str, max_tokens: int) -> Callable[[Reading], None]:
    def read(r: Reading) -> None:
        stream = _openai(server).chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"synthetic": SYNTHETIC},
        )
        for chunk in stream:
            if chunk.choices:
                r.add(chunk.choices[0].delta.content)
                r.complete = r.complete or chunk.choices[0].finish_reason is not None

    return read


def _completion(server: Server, prompt: str, max_tokens: int) -> Callable[[Reading], None]:
    def read(r: Reading) -> None:
        stream = _openai(server).completions.create(
            model="synthetic",
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"synthetic": SYNTHETIC},
        )
        for chunk in stream:
            if chunk.choices:
                r.add(chunk.choices[0].text)
                r.complete = r.complete or chunk.choices[0].finish_reason is not None

    return read


def _responses(server: Server, prompt: str, max_tokens: int) -> Callable[[Reading], None]:
    def read(r: Reading) -> None:
        stream = _openai(server).responses.create(
            model="synthetic",
            input=prompt,
            max_output_tokens=max_tokens,
            stream=True,
            extra_body={"synthetic": SYNTHETIC},
        )
        for event in stream:
            if event.type == "response.output_text.delta":
                r.add(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                r.complete = True

    return read


def _messages(server: Server, prompt: str, max_tokens: int) -> Callable[[Reading], None]:
    def read(r: Reading) -> None:
        stream = _anthropic(server).messages.create(
            model="synthetic",
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": prompt}],
            stream=True,
            extra_body={"synthetic": SYNTHETIC},
        )
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                r.add(event.delta.text)
            elif event.type == "message_stop":
                r.complete = True

    return read


FORMATS = {
    "chat": _chat,
    "completions": _completion,
    "responses": _responses,
    "messages": _messages,
}


def whole(server: Server, name: str, prompt: str, max_tokens: int) -> str:
    """The same answer, asked whole of an undisturbed instance."""
    if name == "chat":
        answer = _openai(server).chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
        )
        return answer.choices[0].message.content or ""
    if name == "completions":
        done = _openai(server).completions.create(
            model="synthetic", prompt=prompt, max_tokens=max_tokens
        )
        return done.choices[0].text
    if name == "responses":
        response = _openai(server).responses.create(
            model="synthetic", input=prompt, max_output_tokens=max_tokens
        )
        return response.output_text
    message = _anthropic(server).messages.create(
        model="synthetic", max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}]
    )
    return "".join(block.text for block in message.content if block.type == "text")


def start_all(server: Server, max_tokens: int, parts: int = 5) -> dict[str, Reading]:
    """One stream of each SDK format on `server`, each past its first `parts` text parts."""
    readings = {
        name: Reading(name, make(server, f"{name} through a deploy", max_tokens))
        for name, make in FORMATS.items()
    }
    wait_for(lambda: all(r.parts >= parts for r in readings.values()), timeout=20)
    return readings


def instances(url: str, *extra: str) -> tuple[ExitStack, Server, Server]:
    stack = ExitStack()
    a = stack.enter_context(run_server("--redis", url, *COMMON, *extra))
    b = stack.enter_context(run_server("--redis", url, *COMMON))
    return stack, a, b


def test_a_deploy_finishes_every_sdk_stream_on_its_connection_and_hands_native_ones_over(
    redis_url: str,
) -> None:
    """SIGTERM with `--redis`: chat, completions, Responses and Messages streams go on to
    their end on their open connection, exact; the native stream beside them moves to the
    instance its reader reaches at once, not when the instance exits; the instance exits as
    soon as the last SDK stream ended."""
    stack, a, b = instances(redis_url, "--drain-timeout-s", "30")
    with stack:
        max_tokens = 150  # 3 s at 20 ms a token
        created = httpx.post(
            a.v1 + "/streams",
            json={"prompt": "native through a deploy", "max_tokens": 200, "synthetic": SYNTHETIC},
            timeout=10,
        ).json()
        raw = RawStream(a.port, "GET", created["events_url"])
        read_until(raw, 5)
        readings = start_all(a, max_tokens)
        started = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(a.url + "/readyz").status_code == 503)
        read_to_end(raw)  # let go at once: its reader comes back elsewhere
        before = native(raw.body)
        assert before["done"] == 0 and before["error"] is None
        body, first_at = resume(b, created, before["last_id"])
        after = native(body)
        expected = synthetic_tokens("native through a deploy", None, 200)[0]
        assert before["tokens"] + after["tokens"] == expected and after["done"] == 1
        for r in readings.values():
            r.join()
        ended = time.monotonic()
        assert a.proc.wait(timeout=10) == 0
        exited = time.monotonic()
        # Taken over while A still finished the SDK streams, not once it was gone.
        assert first_at < ended
        assert exited - ended < 2.5, "the instance exits once its last stream ended"
        assert exited - started < 10  # not the 30 s drain
        for name, r in readings.items():
            assert r.raised is None and r.complete, (name, r.raised)
            assert r.text == whole(b, name, f"{name} through a deploy", max_tokens), name
        assert any('"drain.hand_over"' in line and '"streams":1' in line for line in a.log)


def test_sdk_streams_a_drain_cannot_finish_end_with_an_error_the_sdk_raises(
    redis_url: str,
) -> None:
    stack, a, _ = instances(redis_url, "--drain-timeout-s", "1")
    with stack:
        readings = start_all(a, 1000)
        a.proc.send_signal(signal.SIGTERM)
        for r in readings.values():
            r.join()
        assert a.proc.wait(timeout=10) == 0
        for name, r in readings.items():
            assert isinstance(r.raised, openai.APIError | anthropic.APIError), (name, r.raised)
            assert "server_shutdown" in str(r.raised) or "shutting down" in str(r.raised), name
            assert not r.complete and r.parts >= 5


def test_a_sigkilled_instance_makes_every_sdk_raise_never_end_clean(redis_url: str) -> None:
    stack, a, _ = instances(redis_url)
    with stack:
        readings = start_all(a, 1000)
        a.kill()
        for r in readings.values():
            r.join()
        for name, r in readings.items():
            assert not r.ended_clean_short, name
            # The body ends mid-chunk: a RemoteProtocolError, "incomplete chunked read"
            # (httpx's from the OpenAI SDK; the Anthropic SDK's own copy of httpx, `httpx2`).
            sdk_error = isinstance(r.raised, openai.APIError | anthropic.APIError)
            cut = type(r.raised).__name__ == "RemoteProtocolError"
            assert sdk_error or cut, (name, r.raised)


class Front:
    """nginx, as the SDKs see it: a base URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.v1 = url + "/v1"


def test_through_nginx_a_sigkilled_instance_makes_every_sdk_raise(
    redis_url: str, tmp_path: Path
) -> None:
    """nginx (deploy/nginx-multi.conf) does not end a body its upstream left mid-way: the
    client's connection ends mid-chunk too, and the SDKs raise."""
    stack, a, _ = instances(redis_url)
    with stack, run_nginx([a.port], tmp_path, base=MULTI_CONF) as nginx:
        readings = start_all(Front(nginx.url), 1000)  # type: ignore[arg-type]
        a.kill()
        for r in readings.values():
            r.join()
        for name, r in readings.items():
            assert not r.ended_clean_short, name
            sdk_error = isinstance(r.raised, openai.APIError | anthropic.APIError)
            assert sdk_error or type(r.raised).__name__ == "RemoteProtocolError", (name, r.raised)


@pytest.mark.parametrize("durable", [False, True], ids=["not_durable", "durable"])
def test_an_sdk_reader_of_a_stream_another_instance_took_is_told_not_cut_short(
    redis_url: str, durable: bool
) -> None:
    """The owner paused (SIGSTOP) while a reader on another instance followed the stream:
    that instance took it over. The owner, back, finds itself fenced and lets the stream go:
    its own SDK reader gets the format's error (`stream_moved`), never a clean end."""
    stack, a, b = instances(redis_url, f"--durable={durable}", "--openai-grace-s", "5")
    with stack:
        client = _openai(a)
        reading: dict[str, Any] = {"text": "", "raised": None, "complete": False}
        opened = threading.Event()

        def read() -> None:
            raw = client.chat.completions.with_raw_response.create(
                model="synthetic",
                messages=[{"role": "user", "content": "a paused owner"}],
                max_tokens=300,
                stream=True,
                extra_body={"synthetic": SYNTHETIC},
            )
            reading["id"] = raw.headers["x-stream-id"]
            reading["token"] = raw.headers["x-resume-token"]
            opened.set()
            try:
                for chunk in raw.parse():
                    if chunk.choices:
                        reading["text"] += chunk.choices[0].delta.content or ""
                        reading["complete"] |= chunk.choices[0].finish_reason is not None
            except BaseException as exc:
                reading["raised"] = exc

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        assert opened.wait(10)
        follower = RawStream(
            b.port, "GET", f"/v1/streams/{reading['id']}/events?token={reading['token']}"
        )
        read_until(follower, 10, b'"content":"')
        a.proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: b.metric('firsttoken_takeovers_total{outcome="continued"}') == 1)
        finally:
            a.proc.send_signal(signal.SIGCONT)
        thread.join(timeout=20)
        assert not thread.is_alive()
        assert not reading["complete"]
        assert isinstance(reading["raised"], openai.APIError), reading["raised"]
        assert "stream_moved" in str(reading["raised"].body)
        read_to_end(follower)
        assert follower.body.count(b"[DONE]") == 1  # the follower got the whole answer
