"""The API's half of a takeover (`firsttoken/api/takeover.py`): what travels with a stream
(`handover`), and the stream another instance rebuilds from it and the events the store held
(`reopen`), ready to continue from exactly the text those events carry; and the bill of a
stream nobody took over (`bill_orphaned`)."""

from __future__ import annotations

import asyncio

import pytest

from firsttoken.admission import ApiKey, KeyRing
from firsttoken.app import create_app
from firsttoken.config import Settings
from firsttoken.core.mirror import Mirror
from firsttoken.core.stream import Stream, Usage
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.formats.render import ChatRenderer, NativeRenderer
from firsttoken.formats.responses import ResponsesRenderer
from firsttoken.resume import Claim, Orphaned, StreamRecord

MESSAGES = ({"role": "user", "content": "hi"},)


def original(renderer=None, **fields) -> tuple[Stream, GenerationRequest]:
    generation = GenerationRequest(
        request_id="s1",
        prompt="user: hi",
        model="synthetic",
        max_tokens=10,
        seed=3,
        messages=MESSAGES,
        body={"model": "synthetic", "messages": list(MESSAGES), "max_tokens": 10},
        options={"synthetic": {"itl_ms": 5}},
        **fields,
    )
    stream = Stream(
        generation,
        renderer or ChatRenderer("chatcmpl-s1", "synthetic", 1, True),
        format="openai",
        trace_id="t",
        grace_s=5.0,
        prompt_tokens=2,
        max_events=100,
        accepted_at=0.0,
    )
    stream.begin()
    for text in ("Hel", "lo", " you"):
        stream.push(text)
    return stream, generation


def test_a_rebuilt_stream_continues_from_the_text_its_events_carry() -> None:
    takeover = create_app(Settings()).state.gateway.takeover
    first, generation = original()
    handover = takeover.handover(first, generation, first.ticket)
    events = [(e.seq, e.wire, e.tokens) for e in first.log.after(0)]
    claim = Claim(2, "a", handover, events)
    record = StreamRecord("s1", "openai", first.token_digest, "t", "synthetic")
    stream, following, at_token = asyncio.run(
        takeover.reopen(claim, Mirror(record, max_events=100))
    )
    assert at_token == 3 and stream.carried == Usage(2, 3, 0)
    assert [e.wire for e in stream.log.after(0)] == [w for _, w, _ in events]
    assert following is not None and following.max_tokens == 7
    assert following.options["continuation"] == "Hello you"
    assert following.messages[-1] == {"role": "assistant", "content": "Hello you"}
    assert following.body["continue_final_message"] is True
    assert stream.renderer.token("x") == first.renderer.token("x")
    assert stream.check_token(first.resume_token) and stream.ticket is not None


def test_a_rebuilt_stream_bills_beyond_what_its_owners_left_billed() -> None:
    """What the owners before billed comes with the claim: nothing after a SIGKILL (this
    instance then bills the prompt and every token), the sum a hand-over left otherwise."""
    takeover = create_app(Settings()).state.gateway.takeover
    first, generation = original()
    handover = takeover.handover(first, generation, first.ticket)
    events = [(e.seq, e.wire, e.tokens) for e in first.log.after(0)]
    record = StreamRecord("s1", "openai", first.token_digest, "t", "synthetic")
    for billed, before in ((b"", Usage()), (b"2 1 0", Usage(2, 1, 0))):
        claim = Claim(2, "a", handover, events, billed)
        stream, _, _ = asyncio.run(takeover.reopen(claim, Mirror(record, max_events=100)))
        assert stream.carried == Usage(2, 3, 0) and stream.billed_before == before


def test_a_stream_goes_on_under_the_secret_it_started_with_or_not_at_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FT_TEST_ADMIN", "adm")  # an admin reads the ledger: it keeps records
    takeover = create_app(Settings(admin_key_env="FT_TEST_ADMIN")).state.gateway.takeover
    old, new = ApiKey(name="ops"), ApiKey(name="ops", weight=2.0)
    takeover.admission.keys = KeyRing({"sk-old": old, "sk-new": new})
    first, generation = original(tenant="ops")
    first.ticket = asyncio.run(takeover.admission.admit(takeover.admission.keys.find("sk-old")))
    handover = takeover.handover(first, generation, first.ticket)
    events = [(e.seq, e.wire, e.tokens) for e in first.log.after(0)]
    record = StreamRecord("s1", "openai", first.token_digest, "t", "synthetic")
    claim = Claim(2, "a", handover, events)
    stream, _, _ = asyncio.run(takeover.reopen(claim, Mirror(record, max_events=100)))
    assert stream.ticket is not None and stream.ticket.key == old
    takeover.admission.keys = KeyRing({"sk-new": new})  # the rotation ends: the old secret removed
    queue = takeover.admission.ledger.writer.queue
    queue.clear()
    for billed in (b"2 3 0", b""):  # handed over (its owner billed all), then SIGKILLed
        try:
            claim = Claim(2, "a", handover, events, billed)
            asyncio.run(takeover.reopen(claim, Mirror(record, max_events=100)))
        except EngineError as exc:
            assert exc.code == "key_revoked"
        else:
            raise AssertionError("a stream of a removed secret was taken over")
    # What the SIGKILLed owner made and never billed is billed here all the same: its client
    # got it.
    (refused,) = queue
    assert refused.key == "ops" and refused.outcome == "error"
    tokens = refused.tokens()
    assert (tokens["prompt_tokens"], tokens["completion_tokens"]) == (2, 3)


def test_every_format_travels_but_a_request_past_the_bound() -> None:
    takeover = create_app(Settings()).state.gateway.takeover
    assert takeover.handover(*original(NativeRenderer()), None) is not None
    responses = ResponsesRenderer({"id": "resp_1", "model": "synthetic"}, "k")
    assert takeover.handover(*original(responses), None) is not None  # rebuilt by replay
    small = create_app(
        Settings(redis="redis://127.0.0.1:1/0", takeover_max_bytes=100)
    ).state.gateway.takeover
    assert small.handover(*original(), None) is None  # over --takeover-max-bytes


def test_an_orphaned_stream_is_billed_what_its_clients_received_beyond_its_owners_bill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead instance's stream nobody took over, swept by this one: its prompt and the
    tokens the store holds, less what its owners billed (nothing after a SIGKILL), as one
    `orphaned` record; nothing when they billed it all."""
    monkeypatch.setenv("FT_TEST_ADMIN", "adm")  # an admin reads the ledger: it keeps records
    takeover = create_app(Settings(admin_key_env="FT_TEST_ADMIN")).state.gateway.takeover
    first, generation = original()
    handover = takeover.handover(first, generation, first.ticket)
    queue = takeover.admission.ledger.writer.queue
    queue.clear()
    for billed in (b"", b"2 1 0", b"2 3 0"):
        asyncio.run(takeover.bill_orphaned(Orphaned("s1", "t", handover, billed, 3, True)))
    assert [(r.request_id.split(":")[0], r.outcome) for r in queue] == [("s1", "orphaned")] * 2
    tokens = [(r.tokens()["prompt_tokens"], r.tokens()["completion_tokens"]) for r in queue]
    assert tokens == [(2, 3), (0, 2)]


# `original()`'s handover as the version before this one wrote it (257db56's tree, the
# Gateway's own `_handover`): instances of two versions take over each other's streams in a
# rolling deploy, so this one writes exactly these bytes and reads them back.
HANDOVER_BEFORE = (
    b'{"request":{"prompt":"user: hi","model":"synthetic","max_tokens":10,"seed":3,'
    b'"temperature":null,"stop":[],"messages":[{"role":"user","content":"hi"}],'
    b'"body":{"model":"synthetic","messages":[{"role":"user","content":"hi"}],'
    b'"max_tokens":10},"options":{"synthetic":{"itl_ms":5}},"tenant":""},'
    b'"renderer":{"format":"chat.completion.chunk","head":"{\\"id\\":\\"chatcmpl-s1\\",'
    b'\\"object\\":\\"chat.completion.chunk\\",\\"created\\":1,\\"model\\":\\"synthetic\\"",'
    b'"usage":true},"prompt_tokens":2,"grace_s":5.0,"coalesce":null,"meta_interval_s":null,'
    b'"held":{},"key_sha256":""}'
)


def test_a_handover_is_what_the_version_before_wrote_and_reads_back_the_same() -> None:
    takeover = create_app(Settings()).state.gateway.takeover
    first, generation = original()
    assert takeover.handover(first, generation, None) == HANDOVER_BEFORE
    events = [(e.seq, e.wire, e.tokens) for e in first.log.after(0)]
    record = StreamRecord("s1", "openai", first.token_digest, "t", "synthetic")
    claim = Claim(2, "a", HANDOVER_BEFORE, events)
    stream, following, _ = asyncio.run(takeover.reopen(claim, Mirror(record, max_events=100)))
    assert following is not None and following.options["continuation"] == "Hello you"
    assert (following.max_tokens, following.seed, stream.request.max_tokens) == (7, 3, 10)
