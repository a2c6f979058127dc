"""A rolling deploy behind the shipped front door, measured from the clients' side.

Three instances on one Redis behind `deploy/nginx-multi.conf`; clients keep creating chat
streams through nginx with the official openai SDK, its own retries off (`max_retries=0`), so
a 503 would reach them. Each instance in turn is SIGTERMed while a whole answer keeps it
draining for a while (as a long stream would), then started again on its port. A draining
instance refuses new streams with 503 `server_draining` before its first byte, having started
nothing: nginx sends each such request to another instance, so no client sees the 503 and none
waits out its `Retry-After` (5 s). A native reader of a stream another instance generates, cut
by the drain of the instance it read through, resumes elsewhere and gets the exact rest: the
draining instance never answers it 204 "all delivered".
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai

from firsttoken.client import Client
from firsttoken.engines.synthetic import synthetic_tokens
from tests.caddy import run_caddy
from tests.events import tokens_of
from tests.nginx import MULTI_CONF, free_port, run_nginx
from tests.redis_server import run_redis
from tests.servers import Server, run_server, wait_for

# No skip when nginx or redis-server is missing: ./scripts/test installs them.

CLIENTS = 6
ITL_MS = 5
GENERATED = "firsttoken_tokens_generated_total"
HOLD_TOKENS = 300  # the whole answer that keeps a draining instance up: ~1.5 s at ITL_MS


def create_streams(url: str, stop: threading.Event, ttfts: list[float], refused: list[str]) -> None:
    """Create short chat streams one after another until `stop`; each one's time to its first
    token goes to `ttfts`, each create that fails to `refused`."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)
    while not stop.is_set():
        started = time.monotonic()
        try:
            stream = client.chat.completions.create(
                model="synthetic",
                messages=[{"role": "user", "content": "deploy"}],
                max_tokens=10,
                stream=True,
            )
            first = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic() - started
            if first is not None:
                ttfts.append(first)
        except openai.APIStatusError as exc:
            refused.append(f"{exc.status_code} {exc.body}")
        except openai.APIError as exc:
            refused.append(repr(exc))


def drain_slowly(server: Server, itl_ms: float | None = None) -> threading.Thread:
    """A whole answer on `server` (never handed over), so its drain lasts until it ends:
    HOLD_TOKENS tokens, `itl_ms` apart (None: the server's)."""
    body: dict[str, object] = {
        "messages": [{"role": "user", "content": "hold"}],
        "max_tokens": HOLD_TOKENS,
    }
    if itl_ms is not None:
        body["synthetic"] = {"itl_ms": itl_ms}
    hold = threading.Thread(
        target=lambda: httpx.post(server.v1 + "/chat/completions", json=body, timeout=30)
    )
    hold.start()
    wait_for(lambda: server.metric("firsttoken_active_streams") >= 1)
    return hold


def test_a_rolling_deploy_through_nginx_refuses_no_client_and_keeps_none_waiting(
    tmp_path: Path,
) -> None:
    with run_redis() as redis_url, ExitStack() as stack:
        args = (
            "--redis",
            redis_url,
            "--synthetic-ttft-ms",
            "5",
            "--synthetic-itl-ms",
            str(ITL_MS),
            "--drain-timeout-s",
            "30",
        )
        ports = [free_port() for _ in range(3)]
        servers = [stack.enter_context(run_server(*args, "--port", str(p))) for p in ports]
        ng = stack.enter_context(run_nginx(ports, tmp_path, base=MULTI_CONF))
        stop = threading.Event()
        ttfts: list[float] = []
        refused: list[str] = []
        clients = [
            threading.Thread(target=create_streams, args=(ng.url, stop, ttfts, refused))
            for _ in range(CLIENTS)
        ]
        for c in clients:
            c.start()
        try:
            wait_for(lambda: len(ttfts) >= 20, timeout=20)
            for i, port in enumerate(ports):
                old = servers[i]
                hold = drain_slowly(old)
                old.proc.send_signal(signal.SIGTERM)
                assert old.proc.wait(timeout=30) == 0
                hold.join(timeout=30)
                new = servers[i] = stack.enter_context(run_server(*args, "--port", str(port)))
                # docs/deploy.md's recipe: the next SIGTERM only once nginx sends the new
                # instance work (its predecessor's port is skipped for fail_timeout).
                wait_for(lambda new=new: new.metric(GENERATED) > 0, timeout=20)
                created = len(ttfts)
                wait_for(lambda created=created: len(ttfts) >= created + 10, timeout=20)
        finally:
            stop.set()
            for c in clients:
                c.join(timeout=30)
    ms = sorted(round(t * 1000) for t in ttfts)
    p50, p99 = ms[len(ms) // 2], ms[len(ms) * 99 // 100]
    print(f"{len(ms)} streams, TTFT ms p50 {p50}, p99 {p99}, top {ms[-5:]}")
    assert refused == [], refused[:5]
    assert len(ms) >= 50
    assert ms[-1] < 2500, ms[-5:]  # nobody waited out a Retry-After (5 s)
    # Sent again: the draining instances did refuse creates, and nginx took each elsewhere.
    retried = [line for line in ng.access_log() if "statuses=503, " in line]
    assert retried, "no create reached a draining instance: the test proved nothing"
    assert all(line.split()[2] == "200" for line in retried), retried


def test_a_native_reader_cut_by_a_draining_instance_resumes_elsewhere_exact(
    tmp_path: Path,
) -> None:
    """A stream generated on A, read on B; B is SIGTERMed (and stays draining a while): its
    reader is cut, and coming back to B is told 503 `server_draining`, never 204. Through
    nginx, `firsttoken.client` resumes it on A: the exact rest, then `[DONE]`."""
    with run_redis() as redis_url:
        args = ("--redis", redis_url, "--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "20")
        with (
            run_server(*args) as a,
            run_server(*args, "--drain-timeout-s", "30") as b,
            run_nginx([a.port, b.port], tmp_path, base=MULTI_CONF) as ng,
        ):
            created = httpx.post(
                a.v1 + "/streams", json={"prompt": "handed", "max_tokens": 150}, timeout=10
            ).json()
            token = {"authorization": f"Bearer {created['resume_token']}"}
            on_b = b.url + created["events_url"]
            body = b""
            with httpx.stream("GET", on_b, headers=token, timeout=30) as r:
                assert r.status_code == 200
                for chunk in r.iter_raw():
                    body += chunk
                    if len(tokens_of(body)[0]) == 10:
                        hold = drain_slowly(b)
                        b.proc.send_signal(signal.SIGTERM)
            first, last_id, done, error = tokens_of(body)
            assert not done and error is None and len(first) >= 10  # cut: handed over

            again = httpx.get(on_b, headers={**token, "last-event-id": last_id}, timeout=10)
            assert again.status_code == 503, again.text[:200]
            assert again.json()["error"]["code"] == "server_draining"
            assert again.headers["retry-after"] == "1"

            with Client(ng.url) as client:
                rest = client.resume(created["id"], created["resume_token"], last_id)
                text = "".join(rest)
                assert rest.done and not rest.interrupted
            assert "".join(first) + text == "".join(synthetic_tokens("handed", None, 150)[0])
            hold.join(timeout=30)


def test_caddy_sends_no_new_stream_to_an_instance_whose_readyz_says_draining(
    tmp_path: Path,
) -> None:
    """deploy/Caddyfile with two instances: once one is SIGTERMed, its /readyz answers 503 and
    Caddy's health check (every 0.5 s) leaves it out, so the creates that follow all reach the
    other (Caddy 2.6 cannot send a refused request again: the first half second is nginx's
    job, `deploy/nginx-multi.conf`)."""
    args = ("--synthetic-ttft-ms", "5", "--synthetic-itl-ms", str(ITL_MS))
    with (
        run_server(*args) as a,
        run_server(*args, "--drain-timeout-s", "30") as b,
        run_caddy(f"127.0.0.1:{a.port} 127.0.0.1:{b.port}", tmp_path / "caddy") as caddy,
    ):
        hold = drain_slowly(b, itl_ms=20)  # ~6 s of drain
        b.proc.send_signal(signal.SIGTERM)
        time.sleep(1.2)  # two health checks
        http = httpx.Client(verify=caddy.tls(), timeout=10)
        client = openai.OpenAI(
            base_url=caddy.url + "/v1", api_key="unused", max_retries=0, http_client=http
        )
        refused = []
        for _ in range(20):
            try:
                for _chunk in client.chat.completions.create(
                    model="synthetic",
                    messages=[{"role": "user", "content": "ready"}],
                    max_tokens=5,
                    stream=True,
                ):
                    pass
            except openai.APIStatusError as exc:
                refused.append(f"{exc.status_code} {exc.body}")
        assert b.proc.poll() is None, "b had ended its drain: the test proved nothing"
        assert refused == [], refused[:3]
        hold.join(timeout=30)


def test_a_native_reader_waiting_for_the_first_token_when_its_instance_drains_is_not_done(
    tmp_path: Path,
) -> None:
    """A reader opens a stream of A's on B while A has sent nothing yet (a slow first token),
    and B is SIGTERMed meanwhile: B hands the mirror over with nothing in its log. That was
    answered 204 "all delivered" (the client's answer: empty, done). Now B cuts the reader (or,
    once draining, sends it elsewhere with 503), and the resume on A gets the whole answer."""
    with run_redis() as redis_url:
        slow = ("--redis", redis_url, "--synthetic-ttft-ms", "1500", "--synthetic-itl-ms", "5")
        with run_server(*slow) as a, run_server("--redis", redis_url) as b:
            created = httpx.post(
                a.v1 + "/streams", json={"prompt": "patience", "max_tokens": 20}, timeout=10
            ).json()
            token = {"authorization": f"Bearer {created['resume_token']}"}
            threading.Timer(0.15, b.proc.send_signal, (signal.SIGTERM,)).start()
            r = httpx.get(b.url + created["events_url"], headers=token, timeout=10)
            assert r.status_code in (200, 503), r.status_code  # never 204
            tokens, last_id, done, error = tokens_of(r.content)
            assert not done and error is None and tokens == []
            with Client(a.url) as client:
                answer = client.resume(created["id"], created["resume_token"], last_id)
                text = "".join(answer)
            assert answer.done and text == "".join(synthetic_tokens("patience", None, 20)[0])
