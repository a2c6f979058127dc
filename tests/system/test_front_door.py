"""The front door: HTTPS straight to the gateway, and deploy/Caddyfile with a real Caddy serving
HTTP/2 and HTTP/3 to real clients (httpx, an aioquic HTTP/3 client, Chromium).

Every path checks the same four things: the answer arrives token-exact, heartbeats pass (a
short --heartbeat-s and a slow token), nothing buffers (diag's verdict where diag speaks the
protocol, HTTP/1.1 and HTTP/2; elsewhere tokens that arrive a token interval apart, not in a
lump), and a client that leaves still stops the engine. One gateway and one Caddy serve the
module; each stream is short.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ipaddress
import json
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from playwright.sync_api import Browser, Page, sync_playwright

from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.caddy import Caddy, run_caddy, self_signed
from tests.h3client import h3_connect
from tests.servers import ROOT, Server, run_server, wait_for
from tests.system.test_diag import run_diag
from tests.system.test_web import CHROMIUM, CHROMIUM_ARGS

PROMPT = "Tell me how a lighthouse keeper spends the night."
TOKENS = 8
SLOW_ITL_MS = 60  # a slow token: heartbeats (every 20 ms of silence) come between tokens
GENERATED = "firsttoken_tokens_generated_total"
CHAT = "/v1/chat/completions"


def chat_body(max_tokens: int = TOKENS, itl_ms: float = SLOW_ITL_MS) -> dict[str, Any]:
    return {
        "model": "synthetic",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": max_tokens,
        "synthetic": {"itl_ms": itl_ms},
    }


def expected_tokens(max_tokens: int = TOKENS) -> list[str]:
    return synthetic_tokens("user: " + PROMPT, max_tokens=max_tokens)[0]  # the chat as text


class Arrivals:
    """A chat stream's bytes as they came: content tokens with their arrival times, pings."""

    def __init__(self) -> None:
        self.decoder = EventDecoder()
        self.tokens: list[str] = []
        self.times: list[float] = []
        self.done = False

    def feed(self, data: bytes, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        for event in self.decoder.feed(data):
            if event.data == "[DONE]":
                self.done = True
                continue
            choices = json.loads(event.data).get("choices") or [{}]
            text = choices[0].get("delta", {}).get("content")
            if text:
                self.tokens.append(text)
                self.times.append(now)

    @property
    def pings(self) -> int:
        return sum(1 for c in self.decoder.comments if c.strip() == "ping")

    def check(self, max_tokens: int = TOKENS) -> None:
        assert self.tokens == expected_tokens(max_tokens)
        assert self.done
        # 20 ms heartbeats and 60 ms tokens: at least one ping in most gaps, none dropped.
        assert self.pings >= max_tokens - 2, self.pings
        # Nothing held back: tokens came spread over the stream, not in one lump at its end.
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        assert sorted(gaps)[len(gaps) // 2] > SLOW_ITL_MS / 2000, gaps


def outcome(server: Server, name: str) -> float:
    return server.metric(f'firsttoken_streams_total{{outcome="{name}"}}')


def assert_engine_stops(gateway: Server, disconnected: float) -> None:
    """The gateway counted the leaving reader and generates nothing more for it."""
    wait_for(lambda: outcome(gateway, "disconnected") >= disconnected + 1, timeout=10)
    after = gateway.metric(GENERATED)
    time.sleep(0.3)  # 15 token intervals of the cancelled stream
    assert gateway.metric(GENERATED) == after


@pytest.fixture(scope="module")
def gateway() -> Iterator[Server]:
    with run_server(
        "--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "20", "--heartbeat-s", "0.02"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def caddy(gateway: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Caddy]:
    with run_caddy(f"127.0.0.1:{gateway.port}", tmp_path_factory.mktemp("caddy")) as c:
        yield c


# ---- HTTPS straight to the gateway ------------------------------------------------------------


def test_https_straight_to_the_gateway_with_workers(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    tls = ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    with run_server(*tls, "--workers", "2", "--heartbeat-s", "0.02") as server:
        assert server.url.startswith("https://127.0.0.1:")
        with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=10) as client:
            for _ in range(2):  # one per worker, most likely; each must speak TLS
                arrivals = Arrivals()
                with client.stream("POST", server.url + CHAT, json=chat_body()) as resp:
                    assert resp.status_code == 200 and resp.http_version == "HTTP/1.1"
                    for data in resp.iter_raw():
                        arrivals.feed(data)
                arrivals.check()
            with pytest.raises(httpx.RemoteProtocolError):  # TLS only: plain HTTP gets no answer
                httpx.get(server.url.replace("https://", "http://") + "/healthz", timeout=2)
        rc, d = run_diag(server.url + CHAT, "--insecure", "--max-tokens", "10")
        listening = [r for r in server.log_records() if r.get("event") == "listening"]
    assert rc == 0 and d["buffered"] is False and d["http_version"] == "HTTP/1.1"
    assert len(listening) == 2 and all(r["url"] == server.url for r in listening)


def test_a_tls_pair_that_does_not_load_is_one_line(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path / "a")
    _, other_key = self_signed(tmp_path / "b")
    serve = [sys.executable, "-m", "firsttoken", "serve", "--port", "0"]
    proc = subprocess.run(
        [*serve, "--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1 and proc.stderr == ""
    assert len(lines) == 1 and json.loads(lines[0])["event"] == "startup.failed"
    assert "KEY_VALUES_MISMATCH" in lines[0] and "--ssl-keyfile" in lines[0]


# ---- through Caddy: HTTP/2 ---------------------------------------------------------------------


def test_http2_through_caddy(gateway: Server, caddy: Caddy) -> None:
    arrivals = Arrivals()
    with httpx.Client(http2=True, verify=caddy.tls(), timeout=10) as client:
        with client.stream("POST", caddy.url + CHAT, json=chat_body()) as resp:
            assert resp.status_code == 200 and resp.http_version == "HTTP/2"
            # The anti-buffering headers reach the client, and nothing compressed the stream.
            assert resp.headers["x-accel-buffering"] == "no"
            assert "no-transform" in resp.headers["cache-control"]
            assert "content-encoding" not in resp.headers
            # One entry per address Caddy binds (both loopbacks), the same each time.
            offers = set(resp.headers["alt-svc"].split(","))
            assert offers == {f'h3=":{caddy.port}"; ma=2592000'}
            for data in resp.iter_raw():
                arrivals.feed(data)
    arrivals.check()
    rc, d = run_diag(caddy.url + CHAT, "--insecure", "--max-tokens", "20")
    assert rc == 0 and d["http_version"] == "HTTP/2" and d["chunks"] == 20
    assert d["buffered"] is False, d["reason"]


def listeners(port: int) -> set[tuple[str, str]]:
    """(protocol, address) of each socket on this machine bound to local `port`, listening
    (TCP) or bound (UDP), from /proc/net."""
    found: set[tuple[str, str]] = set()
    for name in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path("/proc/net", name).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) != port or (name.startswith("tcp") and state != "0A"):
                continue
            raw = bytes.fromhex(address)
            # The kernel writes each 32-bit word in host (little-endian) order.
            ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((name.rstrip("6"), str(ipaddress.ip_address(ordered))))
    return found


def test_caddy_listens_on_loopback_only(gateway: Server, caddy: Caddy) -> None:
    # deploy/Caddyfile binds the site to FIRSTTOKEN_BIND, both loopbacks unless set: TCP for
    # HTTP/1.1 and HTTP/2, UDP for HTTP/3. Without `bind` Caddy took every interface.
    loopbacks = {"127.0.0.1", "::1"}
    assert listeners(caddy.port) == {(p, a) for p in ("tcp", "udp") for a in loopbacks}
    # A client on this machine, through Caddy, to a gateway without keys: nothing to warn of.
    resp = httpx.post(caddy.url + CHAT, json=chat_body(2, 1), verify=caddy.tls(), timeout=10)
    assert resp.status_code == 200
    assert [r for r in gateway.log_records() if r["event"] == "open_to_the_network"] == []


def test_diag_trusts_caddys_root_as_the_docs_say(
    caddy: Caddy, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/deploy.md: diag fails on Caddy's own CA unless told; SSL_CERT_FILE at its root
    # ($XDG_DATA_HOME/caddy/pki/authorities/local/root.crt) or --insecure.
    rc, d = run_diag(caddy.url + CHAT, "--max-tokens", "5")
    assert rc != 0 and "certificate" in d["problem"].lower(), d["problem"]
    xdg_data = caddy.home / "data"  # what tests/caddy.py gives Caddy as XDG_DATA_HOME
    root = xdg_data / "caddy/pki/authorities/local/root.crt"
    monkeypatch.setenv("SSL_CERT_FILE", str(root))
    rc, d = run_diag(caddy.url + CHAT, "--max-tokens", "5")
    assert rc == 0 and d["chunks"] == 5, d


def test_http2_reader_that_leaves_stops_the_engine(gateway: Server, caddy: Caddy) -> None:
    disconnected = outcome(gateway, "disconnected")
    with httpx.Client(http2=True, verify=caddy.tls(), timeout=10) as client:
        with client.stream("POST", caddy.url + CHAT, json=chat_body(300, 20)) as resp:
            arrivals = Arrivals()
            for data in resp.iter_raw():
                arrivals.feed(data)
                if len(arrivals.tokens) >= 3:
                    break
    # httpx leaves: its connection closes. (Closing only the response would not do: httpcore
    # sends no RST_STREAM for a response closed early, encode/httpcore#943; browsers do.)
    assert_engine_stops(gateway, disconnected)


# ---- through Caddy: HTTP/3 (aioquic) -----------------------------------------------------------


async def h3_chat(
    caddy: Caddy,
    body: dict[str, Any],
    leave_after: int | None = None,
    gateway: Server | None = None,
) -> Arrivals:
    """One chat stream over HTTP/3; with `leave_after`, the stream is cancelled after that many
    tokens and the gateway must stop its engine while the QUIC connection stays open."""
    arrivals = Arrivals()
    disconnected = outcome(gateway, "disconnected") if gateway else 0.0
    async with h3_connect(caddy.port, str(caddy.root_ca)) as client:
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        resp = await client.request(
            "POST", f"localhost:{caddy.port}", CHAT, headers, json.dumps(body).encode()
        )
        assert resp.status == 200, resp.headers
        assert resp.headers["x-accel-buffering"] == "no"
        assert "content-encoding" not in resp.headers
        async for data in resp.chunks():
            arrivals.feed(data)
            if leave_after is not None and len(arrivals.tokens) >= leave_after:
                resp.cancel()  # RESET_STREAM + STOP_SENDING; the connection stays open
                assert gateway is not None
                await asyncio.to_thread(assert_engine_stops, gateway, disconnected)
                break
    return arrivals


def test_http3_through_caddy(gateway: Server, caddy: Caddy) -> None:
    asyncio.run(h3_chat(caddy, chat_body())).check()


def test_http3_reader_that_cancels_its_stream_stops_the_engine(
    gateway: Server, caddy: Caddy
) -> None:
    arrivals = asyncio.run(h3_chat(caddy, chat_body(300, 20), leave_after=3, gateway=gateway))
    assert arrivals.tokens == expected_tokens(300)[: len(arrivals.tokens)]


# ---- through Caddy: Chromium over HTTP/3 -------------------------------------------------------

# A chat stream read with fetch() (comments and all), each chunk with its arrival time; with
# `leave`, the request is aborted after that many tokens (the page stays, and so does QUIC).
FETCH_STREAM = """async ([body, leave]) => {
  const abort = new AbortController();
  const resp = await fetch('/v1/chat/completions', {method: 'POST', signal: abort.signal,
      headers: {'content-type': 'application/json'}, body: JSON.stringify(body)});
  const reader = resp.body.getReader(), text = new TextDecoder(), chunks = [];
  let tokens = 0;
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    const piece = text.decode(value, {stream: true});
    chunks.push([performance.now() / 1000, piece]);
    tokens += (piece.match(/"content":"[^"]/g) || []).length;
    if (leave && tokens >= leave) { abort.abort(); break; }
  }
  return chunks;
}"""
# A native stream read by EventSource: its tokens, opens and errors (a reconnect shows as an
# error and a second open).
EVENT_SOURCE = """async (body) => {
  const made = await (await fetch('/v1/streams', {method: 'POST',
      headers: {'content-type': 'application/json'}, body: JSON.stringify(body)})).json();
  return await new Promise((resolve) => {
    const got = {opens: 0, errors: 0, tokens: []};
    const source = new EventSource(made.events_url);
    const end = () => { source.close(); resolve(got); };
    source.onopen = () => got.opens++;
    source.onerror = () => got.errors++;
    source.onmessage = (e) => {
      if (e.data === '[DONE]') return end();
      const data = JSON.parse(e.data);
      if (data.token !== undefined) got.tokens.push(data.token);
    };
    setTimeout(end, 15000);
  });
}"""
PROTOCOLS = """() => [...performance.getEntriesByType('navigation'),
    ...performance.getEntriesByType('resource')].map(e => e.nextHopProtocol)"""


def spki_hash(pem: Path) -> str:
    """What --ignore-certificate-errors-spki-list takes: base64 SHA-256 of the public key."""
    key = x509.load_pem_x509_certificate(pem.read_bytes()).public_key()
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


@pytest.fixture(scope="module")
def quic_page(caddy: Caddy) -> Iterator[Page]:
    """Chromium speaking HTTP/3 to Caddy from its first request: the origin forced onto QUIC,
    the site certificate's key allowed by hash. Without the force Chromium stays on HTTP/2
    here: it reads Caddy's Alt-Svc and tries QUIC, but rejects a certificate from a CA no
    public root signed (even one trusted in its NSS store) and marks HTTP/3 broken for the
    origin (docs/deploy.md, "Behind Caddy with HTTP/3")."""
    args = [a for a in CHROMIUM_ARGS if a != "--disable-quic"] + [
        "--enable-quic",
        f"--origin-to-force-quic-on=localhost:{caddy.port}",
        f"--ignore-certificate-errors-spki-list={spki_hash(caddy.leaf)}",
    ]
    with sync_playwright() as playwright:
        browser: Browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=args
        )
        page = browser.new_page()
        page.set_default_timeout(20_000)
        page.goto(caddy.url + "/healthz")
        yield page
        browser.close()


def test_chromium_fetch_stream_over_http3(gateway: Server, quic_page: Page) -> None:
    arrivals = Arrivals()
    for t, piece in quic_page.evaluate(FETCH_STREAM, [chat_body(), 0]):
        arrivals.feed(piece.encode(), t)
    arrivals.check()
    assert set(quic_page.evaluate(PROTOCOLS)) == {"h3"}


def test_chromium_event_source_over_http3(gateway: Server, quic_page: Page) -> None:
    body = {"prompt": PROMPT, "max_tokens": 20, "synthetic": {"itl_ms": 30}}
    got = quic_page.evaluate(EVENT_SOURCE, body)
    assert got["tokens"] == synthetic_tokens(PROMPT, max_tokens=20)[0]
    assert (got["opens"], got["errors"]) == (1, 0)  # no reconnect
    assert set(quic_page.evaluate(PROTOCOLS)) == {"h3"}


def test_chromium_abort_over_http3_stops_the_engine(gateway: Server, quic_page: Page) -> None:
    disconnected = outcome(gateway, "disconnected")
    chunks = quic_page.evaluate(FETCH_STREAM, [chat_body(300, 20), 3])
    assert 3 <= sum(piece.count('"content":"') for _, piece in chunks) < 300
    assert_engine_stops(gateway, disconnected)
