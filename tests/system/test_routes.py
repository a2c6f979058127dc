"""Routes against real sockets: a gateway over scripted upstreams that cut, stall, refuse and
continue, and the official SDKs reading what comes out as one stream."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from firsttoken.formats.sse import EventDecoder
from tests.servers import ROOT, Server, run_server, wait_for
from tests.upstreams import TOKENS, ScriptedUpstream, free_port, scripted_upstream

OPEN = ("--breaker-error-rate", "1", "--rate-limit-per-s", "0")
WHOLE = "".join(TOKENS)  # what the scripted upstreams answer uninterrupted


def routes_file(tmp: Path, targets: dict[str, dict], models: dict[str, dict]) -> str:
    lines: list[str] = []
    for table, entries in (("targets", targets), ("models", models)):
        for name, fields in entries.items():
            lines.append(f'[{table}."{name}"]')
            lines.extend(f"{k} = {json.dumps(v)}" for k, v in fields.items())
            lines.append("")
    path = tmp / "routes.toml"
    path.write_text("\n".join(lines))
    return str(path)


def scripted(url: str, model: str, **extra: object) -> dict:
    """A target on a scripted upstream playing scenario `model`."""
    return {
        "kind": "openai",
        "url": url,
        "model": model,
        "continuation": "vllm",
        "first_token_timeout_s": 1,
        "idle_timeout_s": 1,
        **extra,
    }


def stream(server: Server, model: str = "chat", **extra: object) -> dict:
    """One Chat Completions stream; what the client saw."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    body.update(extra)
    seen: dict = {"text": "", "error": None, "done": 0, "roles": 0, "ids": set(), "finish": None}
    decoder = EventDecoder()
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        for chunk in resp.iter_raw():
            for event in decoder.feed(chunk):
                if event.event == "error":
                    seen["error"] = json.loads(event.data or "")["error"]
                elif event.data == "[DONE]":
                    seen["done"] += 1
                elif event.data:
                    obj = json.loads(event.data)
                    seen["ids"].add(obj["id"])
                    for choice in obj["choices"]:
                        delta = choice["delta"]
                        seen["roles"] += "role" in delta
                        seen["text"] += delta.get("content") or ""
                        seen["finish"] = choice["finish_reason"] or seen["finish"]
                    if obj.get("usage"):
                        seen["usage"] = obj["usage"]
    return seen


def failovers(server: Server, phase: str, route: str = "chat") -> float:
    return server.metric(f'firsttoken_failovers_total{{phase="{phase}",route="{route}"}}')


@pytest.fixture(scope="module")
def ups() -> Iterator[tuple[ScriptedUpstream, ScriptedUpstream]]:
    with scripted_upstream() as a, scripted_upstream() as b:
        yield a, b


def gateway(tmp: Path, targets: dict[str, dict], models: dict[str, dict]) -> ExitStack:
    stack = ExitStack()
    server = stack.enter_context(run_server("--routes", routes_file(tmp, targets, models), *OPEN))
    stack.server = server  # type: ignore[attr-defined]
    return stack


@pytest.mark.parametrize(
    ("first", "phase"),
    [
        ("cut", "mid_stream"),  # the body ends after two tokens, no finish
        ("cut-chunked", "mid_stream"),  # the connection drops after two tokens
        ("hang", "mid_stream"),  # silent past the idle deadline after two tokens
    ],
)
def test_a_cut_answer_is_spliced_without_a_seam(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream], first: str, phase: str
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, first), "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        server = gw.server  # type: ignore[attr-defined]
        posts = len(b.posts)
        seen = stream(server, stream_options={"include_usage": True})
        # One stream: one id, one role delta, every character once, one [DONE].
        assert seen["text"] == WHOLE
        assert (seen["error"], seen["done"], seen["roles"]) == (None, 1, 1)
        assert len(seen["ids"]) == 1 and seen["finish"] == "stop"
        # The continuation asked b for the rest of exactly what was sent.
        asked = b.posts[posts]
        assert asked["continue_final_message"] is True
        assert asked["add_generation_prompt"] is False
        assert asked["messages"][-1] == {"role": "assistant", "content": "".join(TOKENS[:2])}
        assert failovers(server, phase) == 1
        splices = [r for r in server.log_records() if r["event"] == "route.splice"]
        assert [(r["from"], r["to"], r["at_token"]) for r in splices] == [("a", "b", 2)]


def test_native_stream_gets_a_failover_meta_event_and_resumes_across_the_splice(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, "cut"), "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        server = gw.server  # type: ignore[attr-defined]
        created = httpx.post(server.v1 + "/streams", json={"prompt": "hi", "model": "chat"})
        assert created.status_code == 201, created.text
        info = created.json()
        url = server.url + info["events_url"]
        params = {"token": info["resume_token"]}
        events = _native_events(url, params)
        metas = [json.loads(d) for name, _, d in events if name == "meta"]
        failover = [m["failover"] for m in metas if "failover" in m]
        assert failover == [{"from": "a", "to": "b", "at_token": 2}]
        tokens = [
            (i, json.loads(d)["token"]) for name, i, d in events if name is None and d != "[DONE]"
        ]
        assert "".join(t for _, t in tokens) == WHOLE
        assert events[-1][2] == "[DONE]"
        # Resuming after the first token replays the rest, the splice included.
        after = tokens[0][0]
        again = _native_events(url, {**params, "last_event_id": str(after)})
        text = "".join(
            json.loads(d)["token"] for name, _, d in again if name is None and d != "[DONE]"
        )
        assert text == WHOLE[len(tokens[0][1]) :]


def _native_events(url: str, params: dict) -> list[tuple[str | None, str | None, str]]:
    out: list[tuple[str | None, str | None, str]] = []
    decoder = EventDecoder()
    with httpx.stream("GET", url, params=params, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        for chunk in resp.iter_raw():
            for event in decoder.feed(chunk):
                if event.data is not None:
                    out.append((event.event, event.id, event.data))
    return out


def test_openai_sdk_sees_one_clean_stream(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, "cut-chunked"), "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        client = openai.OpenAI(base_url=gw.server.v1, api_key="x", max_retries=0)  # type: ignore[attr-defined]
        chunks = list(
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == WHOLE
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert len({c.id for c in chunks}) == 1


def test_first_token_deadline_fails_over_and_cancels_the_slow_request(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, "hang-before"), "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        server = gw.server  # type: ignore[attr-defined]
        closed = a.closed_early
        started = time.monotonic()
        seen = stream(server)
        assert (seen["text"], seen["done"], seen["error"]) == (WHOLE, 1, None)
        assert time.monotonic() - started < 10
        assert failovers(server, "first_token") == 1
        wait_for(lambda: a.closed_early > closed, timeout=5)  # the slow request was cancelled


def test_429_with_retry_after_holds_the_target_back(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, "http-429-retry"), "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        server = gw.server  # type: ignore[attr-defined]
        posts = len(a.posts)
        for _ in range(3):
            seen = stream(server)
            assert (seen["text"], seen["done"]) == (WHOLE, 1)
        # The 429 said "come back in 2 s": the next requests went straight to b.
        assert len(a.posts) == posts + 1
        assert failovers(server, "connect") == 1
        assert server.metric('firsttoken_target_up{target="a"}') == 1  # held, not ejected


def test_whole_answers_refused_with_503_say_when_to_retry(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, _ = ups
    targets = {
        # one slot, held below by a slow stream: the next request waits 0.2 s in the queue
        "one": {"kind": "synthetic", "max_concurrency": 1, "queue_timeout_s": 0.2, "itl_ms": 50},
        "held": scripted(a.url, "http-429-retry"),  # 429, Retry-After: 2
    }
    models = {"chat": {"targets": ["one"]}, "held": {"targets": ["held"]}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    with gateway(tmp_path, targets, models) as gw:
        server = gw.server  # type: ignore[attr-defined]
        slow = {**chat, "model": "chat", "stream": True, "max_tokens": 200}
        with httpx.stream("POST", server.v1 + "/chat/completions", json=slow, timeout=30) as s:
            assert s.status_code == 200
            raw = s.iter_raw()  # kept: a dropped generator would close the stream
            next(raw)  # the slow stream has its slot
            queued = httpx.post(server.v1 + "/chat/completions", json={**chat, "model": "chat"})
        assert queued.status_code == 503, queued.text
        assert queued.json()["error"]["code"] == "queue_timeout"
        assert queued.headers["retry-after"] == "1"

        # The only target answered 429 "come back in 2 s": until then, no target can take it.
        first = httpx.post(server.v1 + "/chat/completions", json={**chat, "model": "held"})
        assert first.status_code == 429 and int(first.headers["retry-after"]) >= 1
        none = httpx.post(server.v1 + "/chat/completions", json={**chat, "model": "held"})
        assert none.status_code == 503, none.text
        assert none.json()["error"]["code"] == "upstream_unavailable"
        assert int(none.headers["retry-after"]) >= 1
        # The Anthropic and Responses shapes of the same refusal say it too.
        message = {"model": "held", "max_tokens": 5, "messages": chat["messages"]}
        anthropic_none = httpx.post(server.url + "/v1/messages", json=message)
        assert anthropic_none.status_code == 503, anthropic_none.text
        assert int(anthropic_none.headers["retry-after"]) >= 1
        responses_none = httpx.post(server.v1 + "/responses", json={"model": "held", "input": "hi"})
        assert responses_none.status_code == 503, responses_none.text
        assert int(responses_none.headers["retry-after"]) >= 1


def test_a_target_that_rejects_prefill_is_passed_over(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, b = ups
    with scripted_upstream() as c:
        targets = {
            "a": scripted(a.url, "cut"),
            "b": scripted(b.url, "rejects-prefill"),
            "c": scripted(c.url, "ok"),
        }
        models = {"chat": {"targets": ["a", "b", "c"]}}
        with gateway(tmp_path, targets, models) as gw:
            seen = stream(gw.server)  # type: ignore[attr-defined]
            assert (seen["text"], seen["done"], seen["error"]) == (WHOLE, 1, None)
            assert len(c.posts) == 1 and c.posts[0]["continue_final_message"] is True
            # One seam, from the target that cut to the one that took over.
            server = gw.server  # type: ignore[attr-defined]
            assert failovers(server, "mid_stream") == 1
            splices = [r for r in server.log_records() if r["event"] == "route.splice"]
            assert [(r["from"], r["to"]) for r in splices] == [("a", "c")]


def test_no_target_can_continue_ends_as_a_cut(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, "cut"), "b": scripted(b.url, "rejects-prefill")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        seen = stream(gw.server)  # type: ignore[attr-defined]
        # The partial text, an error, no [DONE]: never passed off as finished.
        assert seen["text"] == "".join(TOKENS[:2])
        assert seen["error"]["code"] == "upstream_truncated"
        assert seen["done"] == 0


@pytest.mark.parametrize("first", ["cut-in-tool", "cut-in-reasoning"])
def test_never_spliced_inside_a_tool_call_or_reasoning(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream], first: str
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, first), "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        posts = len(b.posts)
        seen = stream(gw.server)  # type: ignore[attr-defined]
        assert seen["error"]["code"] == "upstream_truncated"
        assert seen["done"] == 0
        assert len(b.posts) == posts  # nobody was asked to finish half a tool call


def test_max_splices_zero_keeps_the_cut(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, "cut"), "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"], "max_splices": 0}}) as gw:
        seen = stream(gw.server)  # type: ignore[attr-defined]
        assert (seen["text"], seen["done"]) == ("".join(TOKENS[:2]), 0)
        assert seen["error"]["code"] == "upstream_truncated"


def test_upstream_4xx_passes_through(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, "http-400"), "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        server = gw.server  # type: ignore[attr-defined]
        posts = len(b.posts)
        seen = stream(server)
        assert seen["error"]["code"] == "upstream_rejected"
        assert "400" in seen["error"]["message"]
        # A whole answer gets the upstream's status, not a 500.
        whole = httpx.post(
            server.v1 + "/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert whole.status_code == 400, whole.text
        assert whole.json()["error"]["code"] == "upstream_rejected"
        assert len(b.posts) == posts  # the request's own fault: not tried elsewhere
        assert server.metric('firsttoken_target_up{target="a"}') == 1


def test_models_lists_the_routes(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    a, b = ups
    targets = {"a": scripted(a.url, "ok"), "b": scripted(b.url, "ok")}
    models = {"chat": {"targets": ["a", "b"]}, "fast": {"targets": ["b"]}}
    with gateway(tmp_path, targets, models) as gw:
        server = gw.server  # type: ignore[attr-defined]
        listed = httpx.get(server.v1 + "/models").json()["data"]
        assert [m["id"] for m in listed] == ["chat", "fast"]
        assert stream(server, "fast")["text"] == WHOLE
        assert b.posts[-1]["model"] == "ok"  # the target's own name for it


def test_ejected_target_is_skipped_and_reported_down(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    _, b = ups
    dead = f"http://127.0.0.1:{free_port()}"
    targets = {"a": {**scripted(dead, "ok"), "eject_after": 2}, "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        server = gw.server  # type: ignore[attr-defined]
        for _ in range(4):
            assert stream(server)["text"] == WHOLE
        assert server.metric('firsttoken_target_up{target="a"}') == 0
        assert failovers(server, "connect") == 2  # then a was ejected and not tried
        # When the next request will probe it: within its 10 s cool-down; b is not ejected.
        assert 0 < server.metric('firsttoken_target_probe_in_seconds{target="a"}') <= 10
        assert server.metric('firsttoken_target_probe_in_seconds{target="b"}') == 0


def test_one_keys_failures_do_not_eject_a_target_for_every_key(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    # Issue 37.8: three requests with a field the upstream answers 500 to set
    # target_up{primary} to 0, and another key's next requests went to the costly fallback.
    a, b = ups
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[keys]]\nname = "mallory"\nkey = "sk-mallory"\n\n'
        '[[keys]]\nname = "alice"\nkey = "sk-alice"\n'
    )
    targets = {
        "primary": {**scripted(a.url, "fails-on-extra"), "eject_s": 60},
        "fallback": scripted(b.url, "ok"),
    }
    path = routes_file(tmp_path, targets, {"chat": {"targets": ["primary", "fallback"]}})
    with run_server("--routes", path, "--api-keys", str(keys), *OPEN) as server:

        def ask(key: str, **extra: object) -> httpx.Response:
            body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], **extra}
            headers = {"authorization": f"Bearer {key}"}
            return httpx.post(server.v1 + "/chat/completions", json=body, headers=headers)

        a_posts = len(a.posts)
        for _ in range(3):  # each fails over to the fallback
            assert ask("sk-mallory", guided_grammar="root ::= x").status_code == 200
        assert len(a.posts) == a_posts + 3
        assert server.metric('firsttoken_target_up{target="primary"}') == 1
        b_posts = len(b.posts)
        for _ in range(5):
            assert ask("sk-alice").json()["choices"][0]["message"]["content"] == WHOLE
        assert len(b.posts) == b_posts  # alice never went to the fallback
        # mallory's next such request skips the primary for the target's eject_s.
        assert ask("sk-mallory", guided_grammar="root ::= x").status_code == 200
        assert len(a.posts) == a_posts + 3 + 5 and len(b.posts) == b_posts + 1


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"targets": {"a": {"kind": "openai"}}}, "[targets.a] url: is required"),
        ({"targets": {"a": {"kind": "gpu"}}}, "[targets.a] kind: must be one of"),
        (
            {"targets": {"a": {"kind": "synthetic", "idle_timeout_s": -1}}},
            "[targets.a] idle_timeout_s: must be > 0",
        ),
        (
            {"targets": {"a": {"kind": "synthetic"}}, "models": {"m": {"targets": ["b"]}}},
            "[models.m] targets: no target named 'b'",
        ),
    ],
)
def test_a_bad_routes_file_is_refused_in_one_line(
    tmp_path: Path, fields: dict, complaint: str
) -> None:
    targets = fields.get("targets", {})
    models = fields.get("models", {"m": {"targets": list(targets)}})
    path = routes_file(tmp_path, targets, models)
    proc = subprocess.run(
        [sys.executable, "-m", "firsttoken", "serve", "--port", "0", "--routes", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = [json.loads(x) for x in proc.stdout.splitlines() if '"startup.failed"' in x]
    assert len(failed) == 1, proc.stdout
    assert failed[0]["error"].startswith(f"--routes {path}: ")
    assert complaint in failed[0]["error"]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_missing_routes_file_is_a_bad_setting_status_2_as_documented(tmp_path: Path) -> None:
    # docs/engines.md: a bad file is status 1 (startup.failed), a missing one status 2.
    docs = " ".join((ROOT / "docs" / "engines.md").read_text().split())
    assert "exit status 1" in docs and "exit status 2" in docs
    missing = tmp_path / "routes.toml"
    proc = serve_routes(str(missing))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"firsttoken serve: invalid --routes '{missing}': no such file"
    ]
    said = "`firsttoken serve: invalid --routes 'routes.toml': no such file`"
    assert said in docs


def test_routes_with_upstream_is_refused(tmp_path: Path) -> None:
    path = routes_file(tmp_path, {"a": {"kind": "synthetic"}}, {"m": {"targets": ["a"]}})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "firsttoken",
            "serve",
            "--routes",
            path,
            "--engine",
            "openai",
            "--upstream",
            "http://127.0.0.1:9",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--routes" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def keyed_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real upstream that wants a key and serves one model: another firsttoken."""
    keys = tmp_path_factory.mktemp("upstream") / "keys.toml"
    keys.write_text('[[keys]]\nname = "gw"\nkey = "sk-good"\n')
    fast = ("--synthetic-ttft-ms", "1", "--synthetic-itl-ms", "1")
    with run_server("--api-keys", str(keys), *fast, *OPEN) as server:
        yield server


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_misconfigured_target_is_its_own_fault_not_the_clients(
    tmp_path: Path, keyed_upstream: Server, kind: str
) -> None:
    base = {"kind": kind, "url": keyed_upstream.v1, "eject_after": 2}
    targets = {
        "typo": {**base, "model": "synthetc", "api_key_env": "FT_GOOD_KEY"},  # not listed: 404
        "wrong-key": {**base, "model": "synthetic", "api_key_env": "FT_WRONG_KEY"},  # 401
        "good": {**base, "model": "synthetic", "api_key_env": "FT_GOOD_KEY"},
    }
    models = {"chat": {"targets": ["typo", "wrong-key", "good"]}, "bad": {"targets": ["typo"]}}
    env = {"FT_GOOD_KEY": "sk-good", "FT_WRONG_KEY": "sk-wrong"}
    with run_server("--routes", routes_file(tmp_path, targets, models), *OPEN, env=env) as gw:
        # Said at start: the upstream's model list lacks the typo (not the others).
        unlisted = [r for r in gw.log_records() if r["event"] == "route.model_unlisted"]
        assert [(r["target"], r["model"], r["level"]) for r in unlisted] == [
            ("typo", "synthetc", "warning")
        ]
        assert unlisted[0]["listed"] == ["synthetic"]
        # Each request fails over past both to the target that answers.
        for _ in range(2):
            assert stream(gw, max_tokens=5)["text"], "the good target answered"
        assert failovers(gw, "connect") == 4
        # Counted as the targets' failures: two in a row ejected each.
        assert gw.metric('firsttoken_target_up{target="typo"}') == 0
        assert gw.metric('firsttoken_target_up{target="wrong-key"}') == 0
        failed = [r for r in gw.log_records() if r["event"] == "route.target_failed"]
        assert {r["target"] for r in failed} == {"typo", "wrong-key"}
        assert any("answered 401" in r["error"] for r in failed)
        assert any("answered 404" in r["error"] for r in failed)
        # With no target left it is the gateway's 502, not the client's 404 or 401.
        whole = httpx.post(
            gw.v1 + "/chat/completions",
            json={"model": "bad", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert whole.status_code == 502, whole.text
        error = whole.json()["error"]
        assert error["code"] == "upstream_rejected" and error["type"] == "server_error"
        assert "the upstream answered 404" in error["message"]


def test_a_target_whose_key_variable_is_unset_is_refused_at_start(tmp_path: Path) -> None:
    target = {"kind": "openai", "url": "http://127.0.0.1:9/v1", "api_key_env": "FT_NO_SUCH_KEY"}
    path = routes_file(tmp_path, {"a": target}, {"m": {"targets": ["a"]}})
    proc = serve_routes(path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    [line] = proc.stdout.splitlines()
    assert json.loads(line)["error"] == (
        f"--routes {path}: [targets.a] api_key_env: FT_NO_SUCH_KEY is not set (or empty) "
        "in the environment"
    )


def serve_routes(path: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "firsttoken", "serve", "--port", "0", "--routes", path, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("--engine", "openai"),
            "firsttoken serve: --routes: cannot go with --engine openai or --upstream",
        ),
        (
            ("--batch-max", "4"),
            "firsttoken serve: --batch-max: takes effect only with a single engine (not --routes)",
        ),
    ],
)
def test_engine_flags_beside_routes_are_refused_for_the_real_reason(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    path = routes_file(
        tmp_path, {"a": scripted("http://127.0.0.1:9", "ok")}, {"m": {"targets": ["a"]}}
    )
    proc = serve_routes(path, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(said), line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("--synthetic-itl-ms", "5"),
            "--synthetic-itl-ms: takes effect only on a synthetic "
            "target without its own itl_ms of --routes; {path} has none",
        ),
        (
            ("--synthetic-style", "hostile"),
            "--synthetic-style: takes effect only on a synthetic "
            "target of --routes; {path} has none",
        ),
    ],
)
def test_synthetic_settings_no_target_reads_are_refused(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    # A synthetic target with a pace of its own; the style it would read from the server.
    targets = {"a": scripted("http://127.0.0.1:9", "ok")}
    if args[0] != "--synthetic-style":
        targets["s"] = {"kind": "synthetic", "itl_ms": 1}
    path = routes_file(tmp_path, targets, {"m": {"targets": list(targets)}})
    proc = serve_routes(path, *args)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    [line] = proc.stdout.splitlines()
    assert json.loads(line)["error"] == said.format(path=path)


def test_anthropic_and_responses_clients_see_one_stream_through_a_splice(
    tmp_path: Path, ups: tuple[ScriptedUpstream, ScriptedUpstream]
) -> None:
    import anthropic

    a, b = ups
    targets = {"a": scripted(a.url, "cut-chunked"), "b": scripted(b.url, "ok")}
    with gateway(tmp_path, targets, {"chat": {"targets": ["a", "b"]}}) as gw:
        server = gw.server  # type: ignore[attr-defined]
        client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        with client.messages.stream(
            model="chat", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
        ) as s:
            events = list(s)
            message = s.get_final_message()
        assert [e.type for e in events].count("message_start") == 1
        starts = [e for e in events if e.type == "content_block_start"]
        assert [e.index for e in starts] == [0]  # one text block, carried on over the seam
        assert message.content[0].text == WHOLE and message.stop_reason == "end_turn"
        oa = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
        with oa.responses.stream(model="chat", input="hi") as rs:
            kinds = [e.type for e in rs]
            final = rs.get_final_response()
        assert kinds.count("response.created") == 1 and kinds.count("response.completed") == 1
        assert final.output_text == WHOLE
        assert failovers(server, "mid_stream") == 2
