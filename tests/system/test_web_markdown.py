"""The chat page's Markdown, reasoning, tool calls and Retry, in a real headless Chromium
against a real server (helpers and fixtures from test_web.py).

The synthetic engine writes Markdown or hostile text on request (`synthetic.style`), so these
tests know the exact text the page must have received and can check what it made of it.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page

from firsttoken.formats.sse import EventDecoder
from tests.proxy import CuttableProxy
from tests.servers import Server, run_server
from tests.system import test_web
from tests.system.test_web import (
    ARTIFACTS,
    PROMPT,
    answer,
    page_url,
    send,
    wait_for_length,
    wait_for_state,
)

# test_web's fixtures: a browser per module, a page opener that fails on page errors.
browser = test_web.browser
open_page = test_web.open_page
artifacts_dir = test_web.artifacts_dir

LAST_TURN = "document.querySelector('.turn:last-child')"
ANSWER = f"{LAST_TURN}.querySelector('.answer')"
WEATHER = {"city": "Paris", "unit": "celsius", "days": 3, "include": ["wind", "rain"]}


@pytest.fixture
def server() -> Iterator[Server]:
    with run_server("--log-level", "debug") as s:  # `stream.accepted` counts the posts
        yield s


# ---- helpers ----------------------------------------------------------------------------------


@dataclass
class Reference:
    """What the server streams for a request, read directly and fast."""

    tokens: list[str] = field(default_factory=list)
    reasoning: str = ""
    tool_args: dict[int, str] = field(default_factory=dict)
    tool_names: dict[int, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def reference(server: Server, **params: Any) -> Reference:
    """The events for PROMPT with these page parameters (as the page turns them into a
    request body), fetched at full speed: output does not depend on timing."""
    synthetic: dict[str, Any] = {"ttft_ms": 0, "itl_ms": 0}
    for name in ("style", "answer_tokens", "reasoning_tokens"):
        if name in params:
            synthetic[name] = params[name]
    if "tool" in params:
        synthetic["tool_call"] = {
            "name": params["tool"],
            "arguments": json.loads(params["tool_args"]),
        }
    body: dict[str, Any] = {"prompt": PROMPT, "seed": params.get("seed", 7), "synthetic": synthetic}
    if "max_tokens" in params:
        body["max_tokens"] = params["max_tokens"]
    created = httpx.post(server.v1 + "/streams", json=body, timeout=10)
    assert created.status_code == 201, created.text
    out = Reference()
    decoder = EventDecoder()
    events_url = httpx.URL(server.url).join(created.json()["events_url"])
    with httpx.stream("GET", events_url, timeout=30) as response:
        for chunk in response.iter_bytes():
            for event in decoder.feed(chunk):
                if event.event is not None or event.data == "[DONE]":
                    continue
                payload = json.loads(event.data)
                if "token" in payload:
                    out.tokens.append(payload["token"])
                elif "reasoning" in payload:
                    out.reasoning += payload["reasoning"]
                elif "tool_call" in payload:
                    call = payload["tool_call"]
                    index = call.get("index", 0)
                    out.tool_args[index] = out.tool_args.get(index, "") + call.get("arguments", "")
                    if call.get("name"):
                        out.tool_names[index] = call["name"]
    return out


def retry_outcome(page: Page) -> str:
    return page.evaluate(f"() => {LAST_TURN}.dataset.retry ?? ''")


def rendered_alone(page: Page, text: str) -> str:
    """The HTML the page's renderer makes of `text` given at once: streamed, resumed or not,
    the answer must end up the same."""
    return page.evaluate(
        """async (text) => {
          const { MarkdownStream } = await import('./markdown.js');
          const box = document.createElement('div');
          const md = new MarkdownStream(box);
          md.append(text);
          md.end();
          return box.innerHTML;
        }""",
        text,
    )


# Closed blocks must never change: freeze() remembers every top-level block of the answer but
# the last two (the open block, and one the partial line may be starting); any later
# mutation inside a remembered block, or its removal, is recorded in window.touched.
WATCH_CLOSED_BLOCKS = f"""() => {{
  window.frozen = new Set();
  window.snapshots = [];
  window.touched = [];
  window.freeze = () => {{
    const answer = {ANSWER};
    if (!answer) return 0;
    for (const block of [...answer.children].slice(0, -2)) {{
      if (!frozen.has(block)) {{
        frozen.add(block);
        snapshots.push([block, block.outerHTML]);
      }}
    }}
    return frozen.size;
  }};
  new MutationObserver((records) => {{
    for (const r of records) {{
      for (let n = r.target; n && n.id !== 'log'; n = n.parentNode) {{
        if (frozen.has(n)) {{ touched.push(r.type + ' in ' + n.tagName); break; }}
      }}
      for (const gone of r.removedNodes) if (frozen.has(gone)) touched.push('removed');
    }}
  }}).observe(document.getElementById('log'),
    {{ subtree: true, childList: true, characterData: true, attributes: true }});
}}"""


def median_cost_per_token(timings: list[dict], lo: int, hi: int, group: int = 100) -> float:
    """Median render time per token (ms) over groups of about `group` tokens whose render
    calls happened while the answer had between lo and hi tokens."""
    costs: list[float] = []
    ms = tokens = 0.0
    for t in timings:
        if not lo < t["tokens"] <= hi:
            continue
        ms += t["ms"]
        tokens += t["n"]
        if tokens >= group:
            costs.append(ms / tokens)
            ms = tokens = 0.0
    assert len(costs) >= 5, f"too few render groups between {lo} and {hi} tokens: {costs}"
    return statistics.median(costs)


# ---- tests ------------------------------------------------------------------------------------


def test_long_markdown_answer_renders_progressively_at_flat_cost(
    server: Server, open_page: Callable[..., Page]
) -> None:
    params = {
        "style": "markdown",
        "answer_tokens": 4000,
        "max_tokens": 4000,
        "itl_ms": 1,
        "ttft_ms": 0,
        "perf": 1,
    }
    expected = reference(server, **params).text
    page = open_page(page_url(server.url, **params), viewport={"width": 1000, "height": 800})
    page.evaluate(WATCH_CLOSED_BLOCKS)
    send(page)
    frozen = []
    for share in (0.25, 0.5, 0.75):
        wait_for_length(page, int(len(expected) * share))
        frozen.append(page.evaluate("() => window.freeze()"))
        if share == 0.5:
            assert page.evaluate(f"() => {LAST_TURN}.dataset.state") == "streaming"
            page.screenshot(path=ARTIFACTS / "web-markdown-streaming.png")
    wait_for_state(page, "done", timeout_ms=60_000)
    page.screenshot(path=ARTIFACTS / "web-markdown-done.png")

    assert answer(page) == expected
    # Progressive: blocks were already closed at each quarter, more each time.
    assert 10 < frozen[0] < frozen[1] < frozen[2], frozen
    # Closed blocks were never touched again, nor replaced.
    assert page.evaluate("() => window.touched") == []
    assert page.evaluate(
        "() => snapshots.every(([el, html]) => el.isConnected && el.outerHTML === html)"
    )

    # The render work per token does not grow with the answer.
    timings = page.evaluate("() => window.renderTimings")
    assert sum(t["n"] for t in timings) == 4000
    first = median_cost_per_token(timings, 0, 1000)
    last = median_cost_per_token(timings, 3000, 4000)
    print(f"render ms/token: first thousand {first:.4f}, last thousand {last:.4f}")
    assert last <= 2.5 * max(first, 0.002), (first, last)

    # The answer's constructs, as DOM elements (never raw markers).
    count = page.evaluate(
        f"""() => {{
          const a = {ANSWER};
          const n = (sel) => a.querySelectorAll(sel).length;
          return {{
            h1: n(':scope > h1'), h2: n(':scope > h2'), ul: n(':scope > ul'),
            ol: n(':scope > ol'), li: n('li'), strong: n('strong'), code: n(':not(pre) > code'),
            fences: n('.code-block pre > code'), copy: n('.code-block button.copy'),
            tables: n('.table-wrap > table'), th: n('thead th'), rows: n('tbody tr'),
            links: n('a[href^="http"], a[href^="mailto:"]'),
          }};
        }}"""
    )
    fences = len(re.findall(r"^```", expected, re.M)) // 2
    tables = len(re.findall(r"^\|[-:| ]+\|$", expected, re.M))
    assert count["h1"] == 1 and count["h2"] >= 5
    assert count["ul"] >= 5 and count["ol"] >= 5 and count["li"] >= 50
    assert count["strong"] >= 10 and count["code"] >= 20 and count["links"] >= 5
    assert count["fences"] == fences >= 5 and count["copy"] == fences
    assert count["tables"] == tables >= 5 and count["th"] >= 2 * tables
    assert count["rows"] == len(re.findall(r"^\| [^-]", expected, re.M)) - tables
    text = page.evaluate(f"() => {ANSWER}.textContent")
    assert "```" not in text and "**" not in text and "|---" not in text
    # Streaming ended with what the renderer makes of the whole text at once.
    assert page.evaluate(f"() => {ANSWER}.innerHTML") == rendered_alone(page, expected)


def test_hostile_answer_renders_as_text(server: Server, open_page: Callable[..., Page]) -> None:
    params = {"style": "hostile", "answer_tokens": 800, "max_tokens": 800, "itl_ms": 2}
    expected = reference(server, **params).text
    page = open_page(page_url(server.url, **params))
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.evaluate(
        """() => {
          window.added = [];
          new MutationObserver((records) => {
            for (const r of records) for (const n of r.addedNodes) {
              if (n.nodeType !== 1) continue;
              for (const el of [n, ...n.querySelectorAll('*')]) added.push(el.tagName);
            }
          }).observe(document, { subtree: true, childList: true });
          window.scriptsBefore = document.scripts.length;
        }"""
    )
    send(page)
    wait_for_state(page, "done")
    page.wait_for_timeout(500)  # time for any injected handler to fire
    page.screenshot(path=ARTIFACTS / "web-hostile.png")

    assert answer(page) == expected
    added = set(page.evaluate("() => window.added"))
    dangerous = {"SCRIPT", "IMG", "IFRAME", "SVG", "STYLE", "OBJECT", "EMBED", "svg"}
    assert not added & dangerous, added
    assert page.evaluate("() => document.scripts.length === window.scriptsBefore")
    # Every link is http(s) or mailto; no element carries an event-handler attribute.
    hrefs = page.evaluate(f"() => [...{ANSWER}.querySelectorAll('a')].map((a) => a.href)")
    assert hrefs and all(re.match(r"(https?|mailto):", h) for h in hrefs), hrefs
    handlers = page.evaluate(
        f"""() => [...{ANSWER}.querySelectorAll('*')].flatMap(
          (el) => [...el.attributes].map((a) => a.name).filter((n) => n.startsWith('on')))"""
    )
    assert handlers == []
    assert dialogs == []
    text = page.evaluate(f"() => {ANSWER}.textContent")
    for literal in ("<script>", "</script>", "<img src=x onerror=", "<iframe src=", "javascript:"):
        assert literal in text, literal
    assert "[click](javascript:alert(1))" in text  # an unsafe link stays as written


def test_reasoning_is_folded_with_its_duration(
    server: Server, open_page: Callable[..., Page]
) -> None:
    params = {
        "style": "markdown",
        "reasoning_tokens": 40,
        "answer_tokens": 350,
        "seed": 264,  # its first 350 tokens have a list, a table, a fence: the README's picture
        "max_tokens": 1000,
        "itl_ms": 25,
        "ttft_ms": 0,
    }
    expected = reference(server, **params)
    assert expected.reasoning, "the server sent no reasoning events"
    page = open_page(page_url(server.url, **params), viewport={"width": 900, "height": 1280})
    send(page)
    thinking = page.locator(".turn:last-child details.thinking")
    thinking.locator("summary", has_text="Thinking…").wait_for()
    assert answer(page) == ""  # reasoning comes first
    assert thinking.get_attribute("open") is None  # folded

    wait_for_state(page, "done")
    assert thinking.get_attribute("open") is None
    summary = thinking.locator("summary").inner_text()
    assert re.fullmatch(r"Thought for \d+\.\d s", summary), summary
    seconds = float(thinking.get_attribute("data-seconds") or "nan")
    assert 0.5 <= seconds <= 10, seconds  # ~40 tokens at 25 ms
    assert page.evaluate("() => document.querySelector('.reasoning').textContent") == (
        expected.reasoning
    )
    assert answer(page) == expected.text
    page.evaluate(f"() => {{ {ANSWER}.scrollIntoView(); }}")
    page.screenshot(path=ARTIFACTS / "chat-page.png")  # the README's picture (docs/)

    thinking.locator("summary").click()  # unfolds on demand
    assert thinking.get_attribute("open") is not None
    assert page.locator(".turn:last-child .reasoning").is_visible()


def test_tool_call_card_grows_then_shows_complete_arguments(
    server: Server, open_page: Callable[..., Page]
) -> None:
    params = {
        "tool": "get_weather",
        "tool_args": json.dumps(WEATHER),
        "reasoning_tokens": 10,
        "itl_ms": 40,
        "ttft_ms": 0,
    }
    expected = reference(server, **params)
    assert expected.tool_names == {0: "get_weather"}
    assert json.loads(expected.tool_args[0]) == WEATHER
    page = open_page(page_url(server.url, **params))
    page.evaluate(
        """() => {
          window.argLengths = [];
          new MutationObserver(() => {
            const args = document.querySelector('.turn:last-child .tool-args');
            if (args) argLengths.push(args.textContent.length);
          }).observe(document.getElementById('log'), { subtree: true, childList: true });
        }"""
    )
    send(page)
    card = page.locator(".turn:last-child .tool-call")
    card.wait_for()
    assert card.locator(".tool-name").inner_text() == "get_weather"
    wait_for_state(page, "done")

    lengths = sorted(set(page.evaluate("() => window.argLengths")))
    assert len(lengths) >= 3, f"the arguments did not grow as they streamed: {lengths}"
    assert card.get_attribute("data-complete") == "true"
    shown = card.locator(".tool-args").inner_text()
    assert shown == json.dumps(WEATHER, indent=2)  # pretty-printed once complete
    assert "tool call" in page.inner_text("#state")
    assert (
        page.locator(".turn:last-child details.thinking summary")
        .inner_text()
        .startswith("Thought for")
    )
    page.screenshot(path=ARTIFACTS / "web-tool-call.png")


RETRY_PARAMS = {"style": "markdown", "answer_tokens": 500, "max_tokens": 500, "itl_ms": 15}


def interrupt_mid_answer(page: Page, proxy: CuttableProxy, full: str) -> str:
    send(page)
    wait_for_length(page, len(full) // 4)
    proxy.close()  # connection reset, and every reconnect refused
    wait_for_state(page, "interrupted", timeout_ms=20_000)
    partial = answer(page)
    assert len(full) // 4 <= len(partial) < len(full)
    assert full.startswith(partial)
    return partial


def test_retry_resumes_the_interrupted_stream(
    server: Server, open_page: Callable[..., Page]
) -> None:
    full = reference(server, **RETRY_PARAMS).text
    proxy = CuttableProxy(server.port)
    page = open_page(page_url(proxy.url, **RETRY_PARAMS))
    interrupt_mid_answer(page, proxy, full)
    blocks_before = page.evaluate(f"() => {ANSWER}.children.length")
    posts_before = sum(1 for r in server.log_records() if r.get("event") == "stream.accepted")

    proxy.reopen()
    page.locator(".turn:last-child .notice").get_by_role("button", name="Retry").click()
    wait_for_state(page, "done", timeout_ms=30_000)

    assert answer(page) == full  # exactly: nothing missing, nothing twice
    assert retry_outcome(page) == "resumed"
    assert "Resumed" in page.locator(".turn:last-child .retry-note").inner_text()
    assert page.evaluate(f"() => {ANSWER}.children.length") > blocks_before  # appended
    assert page.evaluate(f"() => {ANSWER}.innerHTML") == rendered_alone(page, full)
    assert sum(1 for r in server.log_records() if r.get("event") == "stream.accepted") == (
        posts_before
    )
    page.screenshot(path=ARTIFACTS / "web-resumed.png")


def test_retry_starts_over_when_the_server_lost_the_stream(
    open_page: Callable[..., Page],
) -> None:
    with run_server() as first:
        full = reference(first, **RETRY_PARAMS).text
        proxy = CuttableProxy(first.port)
        page = open_page(page_url(proxy.url, **RETRY_PARAMS))
        interrupt_mid_answer(page, proxy, full)
    # The server restarted (in-memory streams are gone): a new one behind the same proxy.
    with run_server() as second:
        proxy.target = ("127.0.0.1", second.port)
        proxy.reopen()
        page.locator(".turn:last-child .notice").get_by_role("button", name="Retry").click()
        wait_for_state(page, "done", timeout_ms=30_000)

        assert retry_outcome(page) == "restarted"
        assert "Started over" in page.locator(".turn:last-child .retry-note").inner_text()
        assert answer(page) == full  # the same request again, from its start
        assert page.evaluate(f"() => {ANSWER}.innerHTML") == rendered_alone(page, full)
        page.screenshot(path=ARTIFACTS / "web-started-over.png")


# ---- the renderer alone, in the page ----------------------------------------------------------

RENDER_PIECES = """async ([pieces, close]) => {
  const { MarkdownStream } = await import('./markdown.js');
  const box = document.createElement('div');
  const md = new MarkdownStream(box);
  for (const piece of pieces) md.append(piece);
  if (close) md.end();
  return box.innerHTML;
}"""


def render(page: Page, *pieces: str, close: bool = False) -> str:
    return page.evaluate(RENDER_PIECES, [list(pieces), close])


def test_half_open_constructs_render_while_open(
    server: Server, open_page: Callable[..., Page]
) -> None:
    page = open_page(server.url + "/")
    # A fence without its closing line is a code block already; the closing fence on its
    # way is not shown as code.
    html = render(page, "```", "python", "\n", "print", "(1)\n", "``")
    assert re.search(
        r'<div class="code-block"><div class="code-head"><span class="code-lang">'
        r'python</span><button class="copy" type="button">Copy</button></div>'
        r'<pre><code class="language-python">print\(1\)\n</code></pre></div>$',
        html,
    ), html
    # A table shows its header row from the start, before any body row.
    assert render(page, "| Setting | Va") == (
        '<div class="table-wrap"><table><thead><tr><th>Setting</th><th>Va</th></tr></thead>'
        "<tbody></tbody></table></div>"
    )
    header = "| a | b |\n"
    for pieces in ([header], [header, "|--"], [header, "|---|---|\n"]):
        html = render(page, *pieces)
        assert "<thead><tr><th>a</th><th>b</th></tr></thead><tbody></tbody>" in html, html
    html = render(page, header, "|---|---|\n", "| 1 | `x")
    assert "<tbody><tr><td>1</td><td><code>x</code></td></tr></tbody>" in html, html
    # Bold, code and links before they close; a link's URL is not shown while it streams.
    assert render(page, "some **bold te") == "<p>some <strong>bold te</strong></p>"
    assert render(page, "a `co") == "<p>a <code>co</code></p>"
    assert render(page, "see [the spec](https://exa") == (
        '<p>see <span class="link-pending">the spec</span></p>'
    )
    # …and as written once the answer ends without closing them.
    assert render(page, "some **bold te", close=True) == "<p>some **bold te</p>"
    assert render(page, "- one\n- tw") == (
        '<ul><li><span class="li-text">one</span></li><li><span class="li-text">tw</span></li></ul>'
    )
    assert render(page, "# Ti") == "<h1>Ti</h1>"


def test_unsafe_markup_and_links_stay_text(server: Server, open_page: Callable[..., Page]) -> None:
    page = open_page(server.url + "/")
    html = render(
        page,
        "<img src=x onerror=alert(1)> [a](javascript:alert(1)) [b](JAVASCRIPT:x)"
        " [c](data:text/html,x) [d](vbscript:x) [e](/relative)"
        ' <a href="javascript:x">f</a> [g](https://ok.example/"onclick="x)',
        close=True,
    )
    assert "<img" not in html and '<a href="javascript' not in html
    anchors = re.findall(r"<a [^>]*>", html)
    assert anchors == [
        '<a href="https://ok.example/%22onclick=%22x" rel="noopener noreferrer nofollow"'
        ' target="_blank">'
    ], anchors
    assert "[a](javascript:alert(1))" in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_streamed_in_any_pieces_ends_as_rendered_at_once(
    server: Server, open_page: Callable[..., Page]
) -> None:
    """Whatever the token boundaries, streaming ends with the DOM of the whole text."""
    page = open_page(server.url + "/")
    texts = [
        reference(server, style=s, answer_tokens=1500, seed=seed).text
        for s in ("markdown", "hostile")
        for seed in (1, 2)
    ]
    texts += [
        "Hello *world* **bold** ***both*** _u_ snake_case ~~gone~~ `a` ``b ` c`` \\*esc\\*",
        "- a\n- b\n  - nested\n- c\n\n1. one\n2. two\n\n3. three\n\nafter",
        "| a | b |\n|---|:-:|\n| 1 | 2 |\n| x \\| y | `z` |\n\n| not a table |\nplain",
        "# H1\n## H2 ##\n#nohead\n\n---\n\n> quote\n> more\n\n```js\nunclosed",
        "text\n- list\nlazy\n\n* star\n+ plus\n10. ten\n11. eleven",
    ]
    for seed in range(4):
        result = page.evaluate(
            """async ([texts, seed]) => {
              const { MarkdownStream } = await import('./markdown.js');
              let x = seed + 1;
              const rnd = () => (x = (x * 1103515245 + 12345) % 2147483648) / 2147483648;
              return texts.map((text) => {
                const whole = document.createElement('div');
                const w = new MarkdownStream(whole);
                w.append(text);
                w.end();
                const pieces = document.createElement('div');
                const p = new MarkdownStream(pieces);
                for (let i = 0; i < text.length; ) {
                  const n = 1 + Math.floor(rnd() * 7);
                  p.append(text.slice(i, i + n));
                  i += n;
                }
                p.end();
                return [whole.innerHTML, pieces.innerHTML, p.text === text];
              });
            }""",
            [texts, seed],
        )
        for text, (whole, pieces, same_text) in zip(texts, result, strict=True):
            assert same_text
            assert pieces == whole, text[:80]
