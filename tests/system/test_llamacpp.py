"""A real model (SmolLM2-135M on CPU, llama-cpp-python) through a real firsttoken server."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from openai import OpenAI

from tests.rawhttp import RawStream
from tests.servers import Server, run_server, wait_for

# No skip when the extra is missing: ./scripts/test installs llama-cpp-python and the model,
# and CI must fail without them.

MODEL = "smollm2-135m-instruct"
GENERATED = "firsttoken_tokens_generated_total"
TOKEN_CHUNK = b'"delta":{"content":'


@pytest.fixture(scope="module")
def llama() -> Iterator[Server]:
    with run_server(
        "--engine", "llamacpp", "--rate-limit-per-s", "0", "--ttft-slo-ms", "0", timeout=120
    ) as s:
        yield s


def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key="unused", timeout=60, max_retries=0)


def chat(server: Server, content: str, **params: object) -> str:
    stream = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], stream=True, **params
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_models_lists_the_gguf(llama: Server) -> None:
    assert [m.id for m in client(llama).models.list()] == [MODEL]
    assert httpx.get(llama.url + "/readyz", timeout=10).status_code == 200


def test_streams_through_the_openai_sdk(llama: Server) -> None:
    generated = llama.metric(GENERATED)
    stream = client(llama).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        stream=True,
        max_tokens=40,
        temperature=0,
        stream_options={"include_usage": True},
    )
    chunks: list[str] = []
    finish = usage = None
    for c in stream:
        if c.usage is not None:
            usage = c.usage
        for choice in c.choices:
            if choice.delta.content:
                chunks.append(choice.delta.content)
            finish = choice.finish_reason or finish
    text = "".join(chunks)
    assert text.strip(), "the model said nothing"
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens == len(chunks)
    assert usage.prompt_tokens > 0
    made = llama.metric(GENERATED) - generated
    assert len(chunks) <= made <= 40  # a split character is one chunk from several tokens


def test_plain_completion_respects_max_tokens_and_stop(llama: Server) -> None:
    body = {"prompt": "One, two, three, four,", "max_tokens": 5, "temperature": 0}
    r = httpx.post(llama.v1 + "/completions", json=body, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] <= 5
    full = r["choices"][0]["text"]
    word = full.split()[1] if len(full.split()) > 1 else full.strip()
    cut = httpx.post(llama.v1 + "/completions", json={**body, "stop": [word]}, timeout=60).json()
    assert cut["choices"][0]["text"] == full[: full.find(word)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_deterministic_with_seed_and_temperature_zero(llama: Server) -> None:
    ask = "Name three colors."
    greedy = [chat(llama, ask, max_tokens=30, temperature=0, seed=42) for _ in range(2)]
    assert greedy[0] == greedy[1] and greedy[0]
    sampled = [chat(llama, ask, max_tokens=30, temperature=0.9, seed=7) for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_multibyte_text_is_never_split(llama: Server) -> None:
    """Korean, Chinese and emoji take several tokens per character; chunks stay valid UTF-8."""
    prompts = [
        "Repeat exactly: 안녕하세요 세계 🎉🚀✨",
        "Translate to Chinese: good morning, friend",
        "🎉🎉🎉🎉🎉🚀🚀🚀🚀✨✨✨✨",
    ]
    multibyte = 0
    for prompt in prompts:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "max_tokens": 40,
            "temperature": 0,
        }
        raw = b""
        with httpx.stream("POST", llama.v1 + "/chat/completions", json=body, timeout=60) as r:
            for data in r.iter_bytes():
                raw += data
        pieces: list[str] = []
        for line in raw.split(b"\n"):
            if line.startswith(b"data: {") and TOKEN_CHUNK in line:
                event = json.loads(line[6:].decode("utf-8"))  # strict: raises on broken bytes
                pieces.append(event["choices"][0]["delta"]["content"])
        text = "".join(pieces)
        assert "\ufffd" not in text, text
        text.encode("utf-8").decode("utf-8")
        multibyte += sum(1 for ch in text if len(ch.encode()) > 1)
    assert multibyte > 0, "the model wrote no multi-byte characters: the test proved nothing"


def test_client_leaving_stops_generation_within_a_token(llama: Server) -> None:
    disconnected = llama.metric('firsttoken_streams_total{outcome="disconnected"}')
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "stream": True,
        "max_tokens": 500,
        "temperature": 0,
    }
    s = RawStream(llama.port, "POST", "/v1/chat/completions", body)
    while s.body.count(TOKEN_CHUNK) < 10:
        assert s.read_chunk(), "stream ended early"
    before = llama.metric(GENERATED)
    s.close()
    wait_for(
        lambda: (
            llama.metric('firsttoken_streams_total{outcome="disconnected"}') == disconnected + 1
        ),
        timeout=10,
    )
    after = llama.metric(GENERATED)
    time.sleep(0.3)  # ~40 tokens' time at this model's pace
    assert llama.metric(GENERATED) == after, "tokens generated after the abort"
    # From the metrics scrape to the close, and while the server notices the closed socket,
    # the model goes on (~10 ms a token); the engine-level test below pins the abort itself.
    assert after - before <= 10, after - before


def test_abort_stops_the_thread_within_one_token() -> None:
    """In process, no sockets: abort() costs at most the token being computed."""
    from firsttoken.config import Settings
    from firsttoken.engines import GenerationRequest
    from firsttoken.engines.llamacpp import LlamaCppEngine

    async def main() -> tuple[int, int, int]:
        engine = LlamaCppEngine(Settings(engine="llamacpp"))
        await engine.start()
        try:
            ask = "Write a very long story about a dragon."
            request = GenerationRequest(
                request_id="abort-me", prompt=ask, model=MODEL, max_tokens=500, temperature=0,
                messages=({"role": "user", "content": ask},),
            )  # fmt: skip
            seen = 0
            async for delta in engine.generate(request):
                seen += bool(delta.text)
                if seen == 10:
                    at_abort = engine.tokens_generated
                    await engine.abort("abort-me")
                    stopped = engine.tokens_generated
                    await anyio.sleep(0.2)
                    return at_abort, stopped, engine.tokens_generated
            raise AssertionError("the answer ended before 10 pieces")
        finally:
            await engine.close()

    at_abort, stopped, later = anyio.run(main)
    assert stopped - at_abort <= 1, (at_abort, stopped)
    assert later == stopped


def test_temperature_zero_is_the_same_on_every_request() -> None:
    """The first request after start answers exactly like the later identical ones: the
    engine evaluates every prompt from an empty cache (no reuse of a previous prompt's state,
    whose different batch shapes change the numerics), whatever ran before it."""
    ask = "Write one sentence about the sea."
    with run_server(
        "--engine", "llamacpp", "--rate-limit-per-s", "0", "--ttft-slo-ms", "0", timeout=120
    ) as fresh:
        first = chat(fresh, ask, max_tokens=40, temperature=0)
        again = chat(fresh, ask, max_tokens=40, temperature=0)
        chat(fresh, "Something else entirely, please.", max_tokens=10, temperature=0)
        after_another = chat(fresh, ask, max_tokens=40, temperature=0)
    assert first and first == again == after_another


def test_continues_the_final_assistant_message(llama: Server) -> None:
    # vLLM's continue_final_message: the model writes on from the assistant's text (what a
    # routes splice asks of a `llamacpp` target), it does not start a new answer.
    messages = [{"role": "user", "content": "Write about the sea."}]
    whole = chat(llama, messages[0]["content"], max_tokens=40, temperature=0)
    prefix = whole[: whole.index(" ", 30)]
    stream = client(llama).chat.completions.create(
        model=MODEL,
        messages=[*messages, {"role": "assistant", "content": prefix}],
        stream=True,
        max_tokens=10,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    rest = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # Greedy from the same context: the next word is the uninterrupted answer's next word.
    following = whole[len(prefix) :].split()[0]
    assert rest.split()[0] == following, (prefix, rest, whole)


def test_continues_a_completion_whose_prompt_ends_with_its_answers_start(llama: Server) -> None:
    # `continue_final_text`, what a routes splice or a takeover sends for a native stream or a
    # completion: the engine reads the prompt grown by that text and writes on from it.
    body = {"prompt": "Write about the sea.\n", "max_tokens": 40, "temperature": 0}
    r = httpx.post(llama.v1 + "/completions", json=body, timeout=60).json()
    whole = r["choices"][0]["text"]
    prefix = whole[: whole.index(" ", 30)]
    grown = {"prompt": body["prompt"] + prefix, "continue_final_text": prefix}
    r = httpx.post(
        llama.v1 + "/completions", json={**body, **grown, "max_tokens": 10}, timeout=60
    ).json()
    rest = r["choices"][0]["text"]
    # Greedy from the same context: the next word is the uninterrupted answer's next word.
    assert rest.split()[0] == whole[len(prefix) :].split()[0], (prefix, rest, whole)


def test_a_large_prompt_is_counted_from_samples_off_the_whole(llama: Server) -> None:
    # Issue 37.5: llama.cpp's tokenizer ran over all of a prompt on the event loop (admission,
    # short_prompts, count_tokens). Past 32 KiB it tokenizes 8 slices and scales.
    text = "The quick brown fox jumps over the lazy dog. " * 20_000  # 880 KiB

    def count(content: str) -> int:
        r = httpx.post(
            llama.v1 + "/messages/count_tokens",
            json={"model": MODEL, "messages": [{"role": "user", "content": content}]},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    exact = count(text[:30_000]) * len(text) / 30_000  # this much is tokenized whole
    before = cpu_s(llama)
    estimate = count(text)
    spent = cpu_s(llama) - before
    assert abs(estimate - exact) / exact < 0.02
    assert spent < 0.05, f"{spent * 1000:.0f} ms of CPU to count 880 KiB"


def cpu_s(server: Server) -> float:
    """The server process's CPU time so far (user + system), from /proc."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
