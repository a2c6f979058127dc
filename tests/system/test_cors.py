"""Browsers on other origins (`--cors-allow-origins`): a page served from another port calls the
gateway from real Chromium — a stream, a resume with `Last-Event-ID`, a cancel — and a page
from an origin not on the list is refused by the browser."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, sync_playwright

from tests.servers import Server, run_server
from tests.system.test_web import CHROMIUM, CHROMIUM_ARGS

PAGE = "<!doctype html><title>other origin</title><p>an app on another origin</p>"

# Each snippet runs in the page on the other origin; API is the gateway's /v1 URL.
STREAM = """async (api) => {
  const r = await fetch(api + "/chat/completions", {
    method: "POST",
    headers: {"content-type": "application/json", "authorization": "Bearer unused"},
    body: JSON.stringify({messages: [{role: "user", content: "cors"}], stream: true,
                          max_tokens: 12, seed: 3}),
  });
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let text = "";
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    text += decoder.decode(value, {stream: true});
  }
  return {status: r.status, streamId: r.headers.get("x-stream-id"),
          resumeToken: r.headers.get("x-resume-token"), body: text};
}"""

RESUME = """async ([api, id, token, last]) => {
  const r = await fetch(`${api}/streams/${id}/events`, {
    headers: {"authorization": "Bearer " + token, "last-event-id": String(last)},
  });
  return {status: r.status, body: await r.text()};
}"""

CANCEL = """async (api) => {
  const created = await (await fetch(api + "/streams", {
    method: "POST", headers: {"content-type": "application/json"},
    body: JSON.stringify({prompt: "cancel me", max_tokens: 500}),
  })).json();
  const source = new EventSource(new URL(created.events_url, api));
  await new Promise((resolve) => source.addEventListener("message", resolve, {once: true}));
  const r = await fetch(`${api}/streams/${created.id}/cancel`, {
    method: "POST", headers: {"authorization": "Bearer " + created.resume_token},
  });
  source.close();
  return {status: r.status, body: await r.json()};
}"""


def static_site(root: Path) -> Iterator[str]:
    """A static page on its own loopback port: an origin."""
    (root / "index.html").write_text(PAGE)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def other_origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from static_site(tmp_path_factory.mktemp("listed"))


@pytest.fixture(scope="module")
def unlisted_origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from static_site(tmp_path_factory.mktemp("unlisted"))


@pytest.fixture(scope="module")
def gateway(other_origin: str) -> Iterator[Server]:
    with run_server(
        "--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "5",
        "--cors-allow-origins", other_origin,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()


def run_in_page(browser: Browser, origin: str, script: str, arg: Any) -> Any:
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(origin + "/index.html")
        return page.evaluate(script, arg)
    finally:
        context.close()


def test_stream_resume_and_cancel_from_another_origin(
    browser: Browser, other_origin: str, gateway: Server
) -> None:
    first = run_in_page(browser, other_origin, STREAM, gateway.v1)
    assert first["status"] == 200
    assert first["streamId"] and first["resumeToken"]  # exposed to the page's script
    assert first["body"].rstrip().endswith("data: [DONE]")

    # The same answer again from event 5 on, as a page resumes after a drop.
    resumed = run_in_page(
        browser, other_origin, RESUME, [gateway.v1, first["streamId"], first["resumeToken"], 5]
    )
    assert resumed["status"] == 200
    tail = first["body"][first["body"].index("id: 6\n") :]
    assert resumed["body"].endswith(tail)
    assert "id: 5\n" not in resumed["body"]

    cancelled = run_in_page(browser, other_origin, CANCEL, gateway.v1)
    assert cancelled["status"] == 200 and cancelled["body"]["outcome"] == "cancelled"


def test_preflight_answers_and_unlisted_origin_is_refused(
    browser: Browser, other_origin: str, unlisted_origin: str, gateway: Server
) -> None:
    preflight = httpx.request(
        "OPTIONS",
        gateway.v1 + "/chat/completions",
        headers={
            "origin": other_origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type, last-event-id",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == other_origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "last-event-id" in preflight.headers["access-control-allow-headers"]

    # A page from an origin not on the list: the browser refuses to hand it the answer.
    refused = run_in_page(
        browser,
        unlisted_origin,
        "async (api) => { try { await fetch(api + '/models', "
        "{headers: {authorization: 'Bearer x'}}); return 'read'; } "
        "catch (e) { return 'refused'; } }",
        gateway.v1,
    )
    assert refused == "refused"


def test_off_by_default() -> None:
    with run_server() as server:
        r = httpx.get(server.v1 + "/models", headers={"origin": "http://127.0.0.1:1"})
    assert "access-control-allow-origin" not in r.headers
