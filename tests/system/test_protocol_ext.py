"""Coalescing, meta, binary mode, compression and send timestamps, on real sockets."""

from __future__ import annotations

import base64
import json
import time
import zlib
from collections.abc import Iterator

import httpx
import openai
import pytest
import zstandard

from firsttoken.core.chunking import BOUNDARIES
from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.rawhttp import RawStream
from tests.servers import Server, run_server

MSG = [{"role": "user", "content": "extensions"}]
PROMPT = "user: extensions"


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    with run_server(
        "--synthetic-ttft-ms",
        "20",
        "--synthetic-itl-ms",
        "3",
        "--stream-compression",
        "on",
        "--meta-interval-ms",
        "40",
        "--rate-limit-per-s",
        "0",
    ) as s:
        yield s


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)


def test_boundary_coalescing_through_the_openai_sdk(srv: Server) -> None:
    expected, _ = synthetic_tokens(PROMPT, 4, 120)
    contents, usage = [], None
    for chunk in sdk(srv).chat.completions.create(
        model="synthetic",
        messages=MSG,
        stream=True,
        max_tokens=120,
        seed=4,
        stream_options={"include_usage": True, "coalesce": "boundary"},  # type: ignore[typeddict-unknown-key]
    ):
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            contents.append(chunk.choices[0].delta.content)
    assert "".join(contents) == "".join(expected)
    assert contents[0] == expected[0]  # the first token is never held back
    assert len(contents) < len(expected) / 2  # merged
    # Most chunks end at a boundary; the rest left on the 50 ms deadline.
    at_boundary = sum(1 for c in contents if c[-1] in BOUNDARIES)
    assert at_boundary >= len(contents) // 2
    assert usage is not None and usage.completion_tokens == 120  # still exact


def test_coalescing_size_limit_on_native(srv: Server) -> None:
    created = httpx.post(
        srv.v1 + "/streams",
        json={
            "prompt": "native",
            "max_tokens": 150,
            "meta": False,
            "coalesce": {"mode": "boundary", "max_bytes": 16, "max_wait_ms": 1000},
        },
        timeout=10,
    )
    body = httpx.get(srv.url + created.json()["events_url"], timeout=10).content
    tokens = [
        json.loads(e.data)["token"]
        for e in EventDecoder().feed(body)
        if e.event is None and e.data != "[DONE]"
    ]
    assert "".join(tokens) == "".join(synthetic_tokens("native", None, 150)[0])
    assert all(len(t.encode()) <= 16 for t in tokens)


def test_meta_events_on_native_at_most_every_interval(srv: Server) -> None:
    created = httpx.post(
        srv.v1 + "/streams", json={"prompt": "meta", "max_tokens": 100}, timeout=10
    ).json()
    t0 = time.monotonic()
    body = httpx.get(srv.url + created["events_url"], timeout=10).content
    duration = time.monotonic() - t0
    metas = [json.loads(e.data) for e in EventDecoder().feed(body) if e.event == "meta"]
    progress, final = metas[:-1], metas[-1]
    assert progress, "no progress events"
    assert set(progress[0]) == {"tokens", "remaining", "speed", "elapsed_ms"}
    assert all(m["tokens"] + m["remaining"] == 100 for m in progress)
    assert [m["tokens"] for m in progress] == sorted(m["tokens"] for m in progress)
    assert len(progress) <= duration / 0.040 + 2
    assert final["finish_reason"] == "length" and final["tokens"] == 100


def test_meta_is_opt_in_on_the_openai_path(srv: Server) -> None:
    base = {"messages": MSG, "stream": True, "max_tokens": 60}
    plain = httpx.post(srv.v1 + "/chat/completions", json=base, timeout=10).content
    assert b"event: meta" not in plain
    with_meta = httpx.post(
        srv.v1 + "/chat/completions", timeout=10, json={**base, "stream_options": {"meta": True}}
    ).content
    assert b"event: meta" in with_meta


def test_binary_mode_exact_bytes(srv: Server) -> None:
    created = httpx.post(
        srv.v1 + "/streams", json={"prompt": "binary", "max_tokens": 80, "binary": True}, timeout=10
    ).json()
    body = httpx.get(srv.url + created["events_url"], timeout=10).content
    events = EventDecoder().feed(body)
    raw = b"".join(base64.b64decode(e.data) for e in events if e.event == "token")
    assert raw == "".join(synthetic_tokens("binary", None, 80)[0]).encode()
    assert not any(e.event is None and e.data.startswith("{") for e in events)


class Decompressor:
    def __init__(self, encoding: str) -> None:
        if encoding == "zstd":
            self._d = zstandard.ZstdDecompressor().decompressobj()
        else:
            self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def feed(self, data: bytes) -> bytes:
        return self._d.decompress(data)


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_compressed_streams_flush_every_event(srv: Server, encoding: str) -> None:
    created = httpx.post(
        srv.v1 + "/streams",
        json={"prompt": "compress", "max_tokens": 60, "synthetic": {"ttft_ms": 300, "itl_ms": 30}},
        timeout=10,
    ).json()
    s = RawStream(
        srv.port,
        "GET",
        created["events_url"] + "&timestamps=1",
        headers={"Accept-Encoding": f"{encoding}, identity;q=0.5"},
    )
    assert s.headers["content-encoding"] == encoding
    decompressor, plain, lags = Decompressor(encoding), b"", []
    while not s.finished:
        chunk = s.read_chunk()
        arrived = time.time()
        if not chunk:
            break
        part = decompressor.feed(chunk)
        plain += part
        for line in part.split(b"\n"):
            if line.startswith(b": t="):
                lags.append(arrived - float(line[4:]))
    s.close()
    assert plain.endswith(b"data: [DONE]\n\n")
    # Every event decodes the moment it arrives: it left the server seconds before the end.
    assert len(lags) >= 60 and sorted(lags)[len(lags) // 2] < 0.02
    assert max(lags) < 0.25
    # The decompressed stream is byte-identical to the same events sent uncompressed.
    again = httpx.get(
        srv.url + created["events_url"], headers={"Accept-Encoding": "identity"}, timeout=10
    )
    assert "content-encoding" not in again.headers
    without_stamps = b"".join(
        line + b"\n" for line in plain.split(b"\n")[:-1] if not line.startswith(b": t=")
    )
    assert without_stamps == again.content


def test_openai_sdk_works_with_compression_and_timestamps(srv: Server) -> None:
    expected, _ = synthetic_tokens(PROMPT, 8, 30)
    got = [
        c.choices[0].delta.content
        for c in sdk(srv).chat.completions.create(
            model="synthetic",
            messages=MSG,
            stream=True,
            max_tokens=30,
            seed=8,
            stream_options={"timestamps": True},  # type: ignore[typeddict-unknown-key]
        )
        if c.choices and c.choices[0].delta.content
    ]
    assert got == expected
    raw = httpx.post(
        srv.v1 + "/chat/completions",
        json={
            "messages": MSG,
            "stream": True,
            "max_tokens": 5,
            "stream_options": {"timestamps": True},
        },
        headers={"Accept-Encoding": "gzip"},
        timeout=10,
    )
    assert raw.headers["content-encoding"] == "gzip"
    assert raw.text.count(": t=") >= 5
