"""The web chat page, driven in a real headless Chromium against a real server.

The browser is Debian's Chromium (`apt-get install chromium`), never downloaded at test time.
Connection drops are made by a small TCP proxy between the browser and the server that a test
can cut (live connections reset) or close (new connections refused).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from firsttoken.formats.sse import EventDecoder
from tests.proxy import CuttableProxy
from tests.servers import ROOT, Server, run_server, wait_for

CHROMIUM = Path(os.environ.get("FIRSTTOKEN_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]
ARTIFACTS = ROOT / "test-artifacts"
PROMPT = "Why should a chat page stream its answer?"

# No skip when Chromium is missing: ./scripts/test installs it, and CI must fail without it.

# JS snippets evaluated in the page.
LAST_ANSWER = "document.querySelector('.turn:last-child .answer')"
# The answer's text as the model wrote it (the page renders it as Markdown).
ANSWER_LENGTH = f"() => {LAST_ANSWER}?.rawText?.length ?? 0"
TURN_STATE = "() => document.querySelector('.turn:last-child')?.dataset.state ?? ''"
LOG = "document.getElementById('log')"
AT_BOTTOM = (
    f"() => {{ const l = {LOG}; return l.scrollHeight - l.scrollTop - l.clientHeight < 8; }}"
)
# Record the answer's length every animation frame, and how the answer's DOM changes:
# text appended in place, and blocks (paragraphs…) with text taken out of the answer.
WATCH_ANSWER = f"""() => {{
  window.lengths = [];
  window.replaced = 0;
  window.textEdits = 0;
  const tick = () => {{
    window.lengths.push(({ANSWER_LENGTH})());
    if (!window.stopSampling) requestAnimationFrame(tick);
  }};
  requestAnimationFrame(tick);
  new MutationObserver((records) => {{
    for (const r of records) {{
      const node = r.target.nodeType === Node.TEXT_NODE ? r.target.parentNode : r.target;
      if (!node?.closest('.answer')) continue;
      if (r.type === 'characterData') window.textEdits++;
      else if (node.matches('.answer')) {{
        for (const gone of r.removedNodes) if (gone.textContent.length > 0) window.replaced++;
      }}
    }}
  }}).observe({LOG}, {{ subtree: true, childList: true, characterData: true }});
}}"""


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # launch() gives every run a fresh temporary user-data dir; contexts isolate the tests.
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()


@pytest.fixture
def web_server() -> Iterator[Server]:
    # One server per test: metric deltas and "generation stopped" checks see only this test.
    with run_server("--synthetic-ttft-ms", "100", "--synthetic-itl-ms", "20") as server:
        yield server


@pytest.fixture
def open_page(browser: Browser) -> Iterator[Callable[..., Page]]:
    """Open a URL in a fresh browser context; fail the test on any uncaught page error, and
    on anything the page's Content-Security-Policy refused (Chromium says so on the console)."""
    contexts = []
    errors: list[str] = []

    def _open(url: str, **context_options: Any) -> Page:
        context = browser.new_context(**context_options)
        context.set_default_timeout(20_000)
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on(
            "console",
            lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None,
        )
        page.goto(url)
        return page

    yield _open
    for context in contexts:
        context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture(scope="session", autouse=True)
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


# ---- helpers ----------------------------------------------------------------------------------


def page_url(base: str, **params: int) -> str:
    return f"{base}/?{urlencode({'seed': 7, **params})}"


def reference(server: Server, **params: int) -> tuple[list[str], str | None]:
    """The tokens (and error message, if any) the server streams for PROMPT and these
    page parameters, fetched directly and fast: output does not depend on timing."""
    body: dict[str, Any] = {"prompt": PROMPT, "seed": params.get("seed", 7)}
    if "max_tokens" in params:
        body["max_tokens"] = params["max_tokens"]
    synthetic: dict[str, Any] = {"ttft_ms": 0, "itl_ms": 0}
    if "fail_after" in params:
        synthetic["fail_after"] = params["fail_after"]
    body["synthetic"] = synthetic
    created = httpx.post(server.v1 + "/streams", json=body, timeout=10)
    assert created.status_code == 201, created.text
    tokens: list[str] = []
    error: str | None = None
    decoder = EventDecoder()
    events_url = httpx.URL(server.url).join(created.json()["events_url"])
    with httpx.stream("GET", events_url, timeout=30) as response:
        for chunk in response.iter_bytes():
            for event in decoder.feed(chunk):
                if event.event == "error":
                    error = httpx.Response(200, content=event.data).json()["error"]["message"]
                elif event.event is None and event.data != "[DONE]":
                    tokens.append(httpx.Response(200, content=event.data).json()["token"])
    return tokens, error


def send(page: Page, prompt: str = PROMPT) -> None:
    page.fill("#prompt", prompt)
    page.click("#send")


def answer(page: Page) -> str:
    """The last answer's text as the model wrote it (before Markdown rendering)."""
    return page.evaluate(f"() => {LAST_ANSWER}?.rawText ?? ''")


def wait_for_length(page: Page, chars: int) -> None:
    page.wait_for_function(f"n => ({ANSWER_LENGTH})() >= n", arg=chars)


def wait_for_state(page: Page, state: str, timeout_ms: float = 20_000) -> None:
    page.wait_for_function(f"s => ({TURN_STATE})() === s", arg=state, timeout=timeout_ms)


def counter(server: Server, name: str, label: str = "") -> float:
    """Sum of a counter's series whose labels contain `label` (extra labels allowed)."""
    return sum(
        value
        for key, value in server.metrics().items()
        if key.split("{")[0] == name and label in key
    )


# ---- tests ------------------------------------------------------------------------------------


def test_answer_streams_progressively_without_replacing_blocks(
    web_server: Server, open_page: Callable[..., Page]
) -> None:
    params = {"max_tokens": 120, "ttft_ms": 100, "itl_ms": 25}
    expected, _ = reference(web_server, **params)
    page = open_page(page_url(web_server.url, **params))
    page.evaluate(WATCH_ANSWER)
    send(page)
    wait_for_length(page, 250)
    assert page.evaluate(TURN_STATE) == "streaming"
    page.screenshot(path=ARTIFACTS / "web-streaming.png")
    wait_for_state(page, "done")
    page.evaluate("() => { window.stopSampling = true; }")

    assert answer(page) == "".join(expected)
    lengths: list[int] = page.evaluate("() => window.lengths")
    steps = sorted({n for n in lengths if n > 0})
    assert len(steps) >= 10, f"answer grew in only {len(steps)} visible steps: {steps}"
    assert steps[0] < len(answer(page)) / 2
    # Text appended in place (character edits); no paragraph replaced once it is shown.
    assert page.evaluate("() => window.replaced") == 0
    assert page.evaluate("() => window.textEdits") >= 10
    paragraphs = page.locator(".turn:last-child .answer > p")
    assert paragraphs.count() == len([p for p in "".join(expected).split("\n\n") if p.strip()])
    stats = page.inner_text("#stats")
    assert "TTFT" in stats and "tok/s" in stats and f"{len(expected)} tokens" in stats


def test_the_page_runs_under_a_policy_of_self_with_security_headers(
    web_server: Server, browser: Browser, open_page: Callable[..., Page]
) -> None:
    for path in ("/", "/index.html", "/app.js", "/markdown.js", "/style.css"):
        r = httpx.get(web_server.url + path, timeout=10)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, path
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["referrer-policy"] == "no-referrer"
    # Under that policy the page still loads its module scripts and styles and streams an
    # answer; the fixture fails the test if the browser refused anything on the way.
    page = open_page(page_url(web_server.url, max_tokens=60))
    send(page)
    wait_for_state(page, "done")
    assert answer(page)
    # And the browser enforces it: an inline script (what an injection would add) is refused.
    context = browser.new_context()
    try:
        probe = context.new_page()
        probe.goto(web_server.url + "/")
        refused = probe.evaluate(
            """() => new Promise((resolve) => {
                document.addEventListener('securitypolicyviolation', () => resolve(true));
                const s = document.createElement('script');
                s.textContent = 'window.inlineRan = true';
                document.body.append(s);
                setTimeout(() => resolve(false), 1000);
            })"""
        )
        assert refused and not probe.evaluate("() => window.inlineRan === true")
    finally:
        context.close()


def test_the_page_has_an_icon_where_browsers_look(web_server: Server) -> None:
    """The page names its icon, and `/favicon.ico` (where a browser looks without one)
    answers it: no 404 in the console or the server's log (issue 26)."""
    page = httpx.get(web_server.url + "/", timeout=10).text
    assert '<link rel="icon" href="favicon.svg" type="image/svg+xml">' in page
    for path in ("/favicon.svg", "/favicon.ico"):
        r = httpx.get(web_server.url + path, timeout=10)
        assert r.status_code == 200, path
        assert r.headers["content-type"].startswith("image/svg+xml"), path
        assert r.content.startswith(b"<svg") and len(r.content) < 1024


def test_stop_cancels_generation_on_the_server(
    web_server: Server, open_page: Callable[..., Page]
) -> None:
    cancelled = 'outcome="cancelled"'
    before = counter(web_server, "firsttoken_streams_total", cancelled)
    page = open_page(page_url(web_server.url, itl_ms=40))  # ~300 tokens: about 12 s
    send(page)
    wait_for_length(page, 40)
    page.click("#stop")

    wait_for(lambda: counter(web_server, "firsttoken_streams_total", cancelled) > before)
    assert page.evaluate(TURN_STATE) == "stopped"
    time.sleep(0.5)  # let a token already in flight land before the baseline
    generated = counter(web_server, "firsttoken_tokens_generated_total")
    shown = answer(page)
    time.sleep(1.5)  # ~37 more tokens if generation had gone on
    assert counter(web_server, "firsttoken_tokens_generated_total") == generated
    assert generated < 250, "generation ran to the end despite Stop"
    assert answer(page) == shown
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def test_dropped_connection_resumes_without_gaps_or_duplicates(
    web_server: Server, open_page: Callable[..., Page]
) -> None:
    params = {"max_tokens": 150, "itl_ms": 30}
    expected, _ = reference(web_server, **params)
    proxy = CuttableProxy(web_server.port)
    page = open_page(page_url(proxy.url, **params))
    send(page)
    wait_for_length(page, 60)
    proxy.cut()
    at_cut = len(answer(page))

    wait_for_state(page, "reconnecting", timeout_ms=5_000)
    wait_for_state(page, "done", timeout_ms=30_000)
    text = answer(page)
    assert at_cut < len(text), "the answer had ended before the cut"
    assert text == "".join(expected)
    assert page.locator(".turn:last-child .notice").is_hidden()


def test_lost_server_keeps_partial_answer_and_offers_retry(
    web_server: Server, open_page: Callable[..., Page]
) -> None:
    params = {"max_tokens": 200, "itl_ms": 40}
    expected, _ = reference(web_server, **params)
    full = "".join(expected)
    proxy = CuttableProxy(web_server.port)
    page = open_page(page_url(proxy.url, **params))
    send(page)
    wait_for_length(page, 40)
    proxy.close()  # connection reset, and every reconnect refused

    wait_for_state(page, "interrupted", timeout_ms=20_000)
    partial = answer(page)
    assert 40 <= len(partial) < len(full)
    assert full.startswith(partial), "the kept text is not the answer's beginning"
    notice = page.locator(".turn:last-child .notice")
    assert "Response interrupted" in notice.inner_text()
    page.screenshot(path=ARTIFACTS / "web-interrupted.png")

    proxy.reopen()
    notice.get_by_role("button", name="Retry").click()
    wait_for_state(page, "done", timeout_ms=30_000)
    assert answer(page) == full
    # The server still had the stream: Retry went on from the last event seen.
    assert page.evaluate("() => document.querySelector('.turn:last-child').dataset.retry") == (
        "resumed"
    )


def test_error_event_is_shown_next_to_partial_answer(
    web_server: Server, open_page: Callable[..., Page]
) -> None:
    params = {"fail_after": 12, "itl_ms": 20}
    expected, message = reference(web_server, **params)
    assert message, "the server sent no error event for fail_after"
    page = open_page(page_url(web_server.url, **params))
    send(page)

    wait_for_state(page, "error")
    assert answer(page) == "".join(expected)
    assert len(expected) == 12
    notice = page.locator(".turn:last-child .notice")
    assert message in notice.inner_text()
    assert notice.get_attribute("role") == "alert"
    page.screenshot(path=ARTIFACTS / "web-error.png")


def test_phone_screen_keyboard_only_and_scroll_following(
    web_server: Server, open_page: Callable[..., Page]
) -> None:
    page = open_page(
        page_url(web_server.url, itl_ms=25),
        viewport={"width": 360, "height": 640},
        is_mobile=True,
        has_touch=True,
    )
    # The prompt has focus on load; Enter sends.
    page.keyboard.type(PROMPT)
    page.keyboard.press("Enter")
    page.wait_for_function(f"() => {LOG}.scrollHeight > {LOG}.clientHeight + 200")
    assert page.evaluate(AT_BOTTOM), "the view did not follow the text"
    # The reader scrolls up: the view stays where it is while text keeps coming.
    page.evaluate(f"() => {{ {LOG}.scrollTop = 0; }}")
    length = len(answer(page))
    wait_for_length(page, length + 40)
    assert page.evaluate(f"() => {LOG}.scrollTop") == 0
    # Back at the bottom: following resumes.
    page.evaluate(f"() => {{ {LOG}.scrollTop = {LOG}.scrollHeight; }}")
    wait_for_length(page, len(answer(page)) + 40)
    assert page.evaluate(AT_BOTTOM)
    # No sideways scrolling on a phone.
    assert page.evaluate("() => document.documentElement.scrollWidth <= innerWidth")
    page.screenshot(path=ARTIFACTS / "web-phone.png")
    # Tab from the prompt reaches Stop (Send is disabled while streaming); Enter presses it.
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.id") == "stop"
    page.keyboard.press("Enter")
    wait_for_state(page, "stopped")
    assert page.evaluate("() => document.activeElement.id") == "prompt"


def test_asks_for_an_api_key_and_keeps_it_for_the_tab(
    open_page: Callable[..., Page], tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "web"\nkey = "sk-web"\n')
    args = ("--api-keys", str(keys), "--synthetic-ttft-ms", "20", "--synthetic-itl-ms", "2")
    stored = "() => sessionStorage.getItem('firsttoken.apiKey')"
    with run_server(*args) as server:
        page = open_page(page_url(server.url, max_tokens=20))
        send(page)
        wait_for_state(page, "needs-key")
        notice = page.locator(".turn:last-child .notice")
        assert "This server needs an API key." in notice.inner_text()
        assert notice.get_attribute("role") == "alert"
        box = notice.get_by_label("API key")
        assert box.get_attribute("type") == "password"
        assert page.evaluate("() => document.activeElement.getAttribute('aria-label')") == (
            "API key"
        )
        page.screenshot(path=ARTIFACTS / "web-api-key.png")

        box.fill("sk-wrong")
        box.press("Enter")
        page.wait_for_function(
            "() => document.querySelector('.turn:last-child .notice')"
            ".textContent.includes('not accepted')"
        )
        assert page.evaluate(stored) is None  # a refused key is not kept

        notice.get_by_label("API key").fill("sk-web")
        notice.get_by_role("button", name="Use key").click()
        wait_for_state(page, "done")
        assert len(answer(page)) > 0 and notice.is_hidden()
        assert page.evaluate(stored) == "sk-web"
        assert page.evaluate("() => localStorage.length") == 0

        send(page, "and again")  # the tab remembers the key: no second prompt
        wait_for_state(page, "done")
        assert page.locator(".turn").count() == 2

        refused = [
            r
            for r in server.log_records()
            if r["event"] == "request.refused" and r["code"] == "invalid_api_key"
        ]
        assert len(refused) == 2  # the first try without a key, and the wrong key

        other_tab = open_page(page_url(server.url, max_tokens=5))
        assert other_tab.evaluate(stored) is None  # another tab (context) asks again
