"""What every handler needs (`firsttoken/api/gateway.py`): what a refused whole answer says
about retrying; and the gateway's half of a takeover: what travels with a stream
(`_handover`), and the stream another instance rebuilds from it and the events the store held
(`reopen`), ready to continue from exactly the text those events carry."""

from __future__ import annotations

import asyncio

import pytest

from firsttoken.admission import ApiKey, KeyRing
from firsttoken.api.bodies import APIError
from firsttoken.api.gateway import retry_headers
from firsttoken.app import create_app
from firsttoken.config import Settings
from firsttoken.core.mirror import Mirror
from firsttoken.core.stream import Stream, Usage
from firsttoken.engines import EngineError, GenerationRequest
from firsttoken.resume import Claim, Orphaned, StreamRecord
from firsttoken.wire.render import ChatRenderer, NativeRenderer
from firsttoken.wire.responses import ResponsesRenderer

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
        kind="openai",
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
    gw = create_app(Settings()).state.gateway
    first, generation = original()
    handover = gw._handover(first, generation)
    events = [(e.seq, e.wire, e.tokens) for e in first.log.after(0)]
    claim = Claim(2, "a", handover, events)
    record = StreamRecord("s1", "openai", first.token_digest, "t", "synthetic")
    stream, following, at_token = asyncio.run(gw.reopen(claim, Mirror(record, max_events=100)))
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
    gw = create_app(Settings()).state.gateway
    first, generation = original()
    handover = gw._handover(first, generation)
    events = [(e.seq, e.wire, e.tokens) for e in first.log.after(0)]
    record = StreamRecord("s1", "openai", first.token_digest, "t", "synthetic")
    for billed, before in ((b"", Usage()), (b"2 1 0", Usage(2, 1, 0))):
        claim = Claim(2, "a", handover, events, billed)
        stream, _, _ = asyncio.run(gw.reopen(claim, Mirror(record, max_events=100)))
        assert stream.carried == Usage(2, 3, 0) and stream.billed_before == before


def test_a_stream_goes_on_under_the_secret_it_started_with_or_not_at_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FT_TEST_ADMIN", "adm")  # an admin reads the ledger: it keeps records
    gw = create_app(Settings(admin_key_env="FT_TEST_ADMIN")).state.gateway
    old, new = ApiKey(name="ops"), ApiKey(name="ops", weight=2.0)
    gw.admission.keys = KeyRing({"sk-old": old, "sk-new": new})
    first, generation = original(tenant="ops")
    first.ticket = asyncio.run(gw.admission.admit(gw.admission.keys.find("sk-old")))
    handover = gw._handover(first, generation)
    events = [(e.seq, e.wire, e.tokens) for e in first.log.after(0)]
    record = StreamRecord("s1", "openai", first.token_digest, "t", "synthetic")
    claim = Claim(2, "a", handover, events)
    stream, _, _ = asyncio.run(gw.reopen(claim, Mirror(record, max_events=100)))
    assert stream.ticket is not None and stream.ticket.key == old
    gw.admission.keys = KeyRing({"sk-new": new})  # the rotation ends: the old secret removed
    queue = gw.admission.ledger.writer.queue
    queue.clear()
    for billed in (b"2 3 0", b""):  # handed over (its owner billed all), then SIGKILLed
        try:
            claim = Claim(2, "a", handover, events, billed)
            asyncio.run(gw.reopen(claim, Mirror(record, max_events=100)))
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
    gw = create_app(Settings()).state.gateway
    assert gw._handover(*original(NativeRenderer())) is not None
    responses = ResponsesRenderer({"id": "resp_1", "model": "synthetic"}, "k")
    assert gw._handover(*original(responses)) is not None  # rebuilt by replay
    small = create_app(
        Settings(redis="redis://127.0.0.1:1/0", takeover_max_bytes=100)
    ).state.gateway
    assert small._handover(*original()) is None  # over --takeover-max-bytes


def test_a_503_or_429_says_when_to_retry_and_nothing_else_does() -> None:
    # The route's own wait, rounded up to whole seconds, never below 1.
    held = EngineError("upstream_unavailable", "x", status=503, retry_after_s=2.2)
    assert retry_headers(held) == {"retry-after": "3"}
    soon = EngineError("upstream_unavailable", "x", status=503, retry_after_s=0.1)
    assert retry_headers(soon) == {"retry-after": "1"}
    # Rebuilt from the stream's error event, the status is all that is left: 1 s.
    assert retry_headers(EngineError("queue_timeout", "x", status=503)) == {"retry-after": "1"}
    assert retry_headers(EngineError("upstream_429", "x", status=429)) == {"retry-after": "1"}
    assert retry_headers(EngineError("upstream_rejected", "x", status=400)) == {}
    assert retry_headers(EngineError("internal_error", "x")) == {}


def test_a_model_is_found_by_name_as_the_engines_own_string_and_follows_a_new_list() -> None:
    gw = create_app(Settings()).state.gateway
    asked = "".join(["synth", "etic"])  # equal, not the same object
    found = gw.model(asked)
    assert found == "synthetic" and found is gw.engine.models[0] and found is not asked
    assert gw.model(None) is gw.engine.models[0]
    gw.engine.models = ("a", "b")  # a reload swaps the engine's list
    assert gw.model("b") == "b"
    try:
        gw.model("synthetic")
    except APIError as exc:
        assert exc.status == 404 and exc.code == "model_not_found"
    else:
        raise AssertionError("a model no longer served was found")


def test_an_orphaned_stream_is_billed_what_its_clients_received_beyond_its_owners_bill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead instance's stream nobody took over, swept by this one: its prompt and the
    tokens the store holds, less what its owners billed (nothing after a SIGKILL), as one
    `orphaned` record; nothing when they billed it all."""
    monkeypatch.setenv("FT_TEST_ADMIN", "adm")  # an admin reads the ledger: it keeps records
    gw = create_app(Settings(admin_key_env="FT_TEST_ADMIN")).state.gateway
    first, generation = original()
    handover = gw._handover(first, generation)
    queue = gw.admission.ledger.writer.queue
    queue.clear()
    for billed in (b"", b"2 1 0", b"2 3 0"):
        asyncio.run(gw.bill_orphaned(Orphaned("s1", "t", handover, billed, 3, True)))
    assert [(r.request_id.split(":")[0], r.outcome) for r in queue] == [("s1", "orphaned")] * 2
    tokens = [(r.tokens()["prompt_tokens"], r.tokens()["completion_tokens"]) for r in queue]
    assert tokens == [(2, 3), (0, 2)]
