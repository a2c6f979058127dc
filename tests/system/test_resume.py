"""Resuming a stream from Last-Event-ID (in-memory event log)."""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx

from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.rawhttp import RawStream
from tests.servers import Server, run_server


def native_tokens(body: bytes) -> tuple[list[str], list[int], bool]:
    tokens, ids, done = [], [], False
    for event in EventDecoder().feed(body):
        if event.data == "[DONE]":
            done = True
        elif event.event is None:
            tokens.append(json.loads(event.data)["token"])
            ids.append(int(event.id or 0))
    return tokens, ids, done


def test_drop_after_ten_tokens_and_resume_token_exact(server: Server) -> None:
    created = httpx.post(
        server.v1 + "/streams",
        json={"prompt": "resume me", "max_tokens": 60, "seed": 11},
        timeout=10,
    ).json()
    s = RawStream(server.port, "GET", created["events_url"])
    while s.body.count(b'{"token":') < 10:
        s.read_chunk()
    s.close()
    first, ids, _ = native_tokens(s.body)
    assert s.body.startswith(b"retry: 1000\n\n")
    r = RawStream(
        server.port, "GET", created["events_url"], headers={"Last-Event-ID": str(ids[-1])}
    )
    rest, rest_ids, done = native_tokens(r.read_all())
    r.close()
    assert done
    assert rest_ids[0] == ids[-1] + 1  # exactly the events after that id
    assert first + rest == synthetic_tokens("resume me", 11, 60)[0]


def test_resume_after_end_replays_then_204(server: Server) -> None:
    created = httpx.post(
        server.v1 + "/streams", json={"prompt": "short", "max_tokens": 5}, timeout=10
    ).json()
    url = server.url + created["events_url"]
    whole = httpx.get(url, timeout=10).content
    tokens, _, done = native_tokens(whole)
    assert done and tokens == synthetic_tokens("short", None, 5)[0]
    last = EventDecoder()
    last.feed(whole)
    # A reconnect after [DONE] (what EventSource does) is told to stop: 204.
    r = httpx.get(url, headers={"Last-Event-ID": last.last_event_id}, timeout=10)
    assert r.status_code == 204
    again = httpx.get(url + "&last_event_id=2", timeout=10).content
    assert native_tokens(again)[0] == tokens[2:]  # ids 1..5 are the five tokens


def test_openai_stream_resumes_by_stream_id() -> None:
    with run_server(
        "--openai-grace-s", "5", "--synthetic-itl-ms", "5", "--synthetic-ttft-ms", "10"
    ) as srv:
        s = RawStream(
            srv.port,
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "q"}], "stream": True, "max_tokens": 40},
        )
        while s.body.count(b'"content":"') < 5:
            s.read_chunk()
        s.close()
        decoder = EventDecoder()
        seen = [e for e in decoder.feed(s.body)]
        stream_id, token = s.headers["x-stream-id"], s.headers["x-resume-token"]
        r = httpx.get(
            f"{srv.v1}/streams/{stream_id}/events",
            headers={"Authorization": f"Bearer {token}", "Last-Event-ID": decoder.last_event_id},
            timeout=10,
        )
        rest = list(EventDecoder().feed(r.content))
        text = ""
        for event in seen + rest:
            if event.data != "[DONE]":
                choices = json.loads(event.data)["choices"]
                if choices:
                    text += choices[0]["delta"].get("content") or ""
        assert rest[-1].data == "[DONE]"
        assert text == "".join(synthetic_tokens("user: q", None, 40)[0])


def test_resume_older_than_the_buffer_is_a_clear_error() -> None:
    with run_server(
        "--resume-max-events", "10", "--synthetic-itl-ms", "1", "--synthetic-ttft-ms", "1"
    ) as srv:
        created = httpx.post(
            srv.v1 + "/streams", json={"prompt": "x", "max_tokens": 40}, timeout=10
        ).json()
        url = srv.url + created["events_url"]
        httpx.get(url, timeout=10)  # read it all, so the log has rolled past event 1
        body = httpx.get(url + "&last_event_id=1", timeout=10).content
        events = EventDecoder().feed(body)
        assert [e.event for e in events] == ["error"]
        assert json.loads(events[0].data)["error"]["code"] == "resume_expired"


def test_a_bad_last_event_id_is_400_not_500(server: Server) -> None:
    created = httpx.post(
        server.v1 + "/streams", json={"prompt": "bad id", "max_tokens": 3}, timeout=10
    ).json()
    url = server.url + created["events_url"]
    # "²" passes str.isdigit(); 5,000 digits pass it too but exceed int()'s limit.
    for bad in ("²", "5" * 5000, "-1", "1.0", "7a"):
        # A header's bytes are read as Latin-1, where "²" is one byte.
        header = {"Last-Event-ID": bad.encode("latin-1")}
        for r in (
            httpx.get(url, headers=header, timeout=10),
            httpx.get(url + "&last_event_id=" + quote(bad), timeout=10),
        ):
            assert r.status_code == 400, (bad[:10], r.url.query[:80], r.text[:200])
            error = r.json()["error"]
            assert error["code"] == "invalid_last_event_id"
            assert error["param"] == "last_event_id"
