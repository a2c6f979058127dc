"""The operator's page (`GET /ops`) in a real headless Chromium, behind the admin key, while a
load runs: a route whose first target is down (it gets ejected), a target with a queue, an
upstream that cuts its answers, two keys. Each section shows what /metrics says, a broken
service level is marked, and the page comes back by itself after the gateway restarts.

Screenshots land in test-artifacts/ (docs/ops-page.png is one of them).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.servers import Server, parse_metrics, run_server, wait_for
from tests.system.test_web import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS
from tests.upstreams import free_port, scripted_upstream

ADMIN = "admin-secret-ops"
ADMIN_ENV = {"OPS_TEST_ADMIN": ADMIN}
BEARER = {"Authorization": f"Bearer {ADMIN}"}
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}


def routes_file(tmp: Path, upstream: str) -> Path:
    path = tmp / "routes.toml"
    path.write_text(
        f"""
[targets.gpu-down]
kind = "openai"
url = "http://127.0.0.1:{free_port()}/v1"
connect_timeout_s = 1
eject_s = 60

[targets.gpu-a]
kind = "synthetic"
max_concurrency = 2
queue_timeout_s = 30
ttft_ms = 400  # past the 300 ms TTFT target: the page must mark it broken
itl_ms = 40

[targets.gpu-cut]
kind = "openai"
url = "{upstream}/v1"
model = "cut-chunked"
first_token_timeout_s = 2
idle_timeout_s = 2

[models.chat]
targets = ["gpu-down", "gpu-a"]

[models.cut]
targets = ["gpu-cut"]
max_splices = 0
"""
    )
    return path


def keys_file(tmp: Path) -> Path:
    path = tmp / "keys.toml"
    path.write_text(
        '[[keys]]\nname = "alice"\nkey = "sk-alice"\nmax_streams = 8\n'
        "tokens_per_minute = 1000000\n"
        '[[keys]]\nname = "bob"\nkey = "sk-bob"\nmax_streams = 4\n'
    )
    return path


class Load:
    """Streams in threads until stopped: `alice` keeps 4 slow streams on `chat` (gpu-a takes
    2, 2 queue), `bob` one on `chat` and one on `cut` (each of those ends in an error)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.error_traces: list[str] = []
        plan = [("alice", "chat")] * 4 + [("bob", "chat"), ("bob", "cut")]
        self.threads = [threading.Thread(target=self._run, args=p, daemon=True) for p in plan]

    def _run(self, key: str, model: str) -> None:
        body = {
            "model": model,
            "stream": True,
            "max_tokens": 30,
            # Nothing but known fields: a target's failures then count for every key alike
            # (a request passing unread fields through is its own key's fault first).
            "messages": [{"role": "user", "content": "ops"}],
        }
        headers = {"Authorization": f"Bearer {KEYS[key]}"}
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                try:
                    with client.stream(
                        "POST", self.url + "/v1/chat/completions", json=body, headers=headers
                    ) as resp:
                        text = resp.read().decode()
                        if "event: error" in text:
                            self.error_traces.append(resp.headers.get("x-request-id", ""))
                except httpx.TransportError:
                    time.sleep(0.2)  # the gateway is restarting
                if model == "cut":
                    time.sleep(0.5)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()


def open_ops(browser: Browser, url: str, errors: list[str]) -> Page:
    # The admin key on every request the page makes: the page, its files, its EventSource.
    context = browser.new_context(
        extra_http_headers=BEARER, viewport={"width": 1440, "height": 1000}
    )
    context.set_default_timeout(20_000)
    page = context.new_page()
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on(
        "console",
        lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None,
    )
    page.goto(url + "/ops")
    return page


def snapshots(page: Page) -> int:
    return int(page.evaluate("() => window.opsState.snapshots"))


def cell(page: Page, section: str, row: str, field: str) -> str:
    selector = f'#{section} tr[data-name="{row}"] td[data-field="{field}"]'
    return str(page.eval_on_selector(selector, "td => td.textContent"))


def agrees(page: Page, server: Server, check: Callable[[Page, dict[str, float]], bool]) -> bool:
    """The page and /metrics agree within a snapshot: the page is read, then /metrics, then
    the page again after its next snapshot; either reading may match (values move)."""
    for _ in range(8):
        seen = snapshots(page)
        metrics = parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)
        if check(page, metrics):
            return True
        wait_for(lambda seen=seen: snapshots(page) > seen, timeout=5)
        if check(page, metrics):
            return True
    return False


def test_ops_page_shows_the_live_server_and_survives_a_restart(
    browser: Browser, tmp_path: Path
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    port = free_port()
    errors: list[str] = []
    with ExitStack() as stack:
        upstream = stack.enter_context(scripted_upstream())
        args = (
            "--port",
            str(port),
            "--routes",
            str(routes_file(tmp_path, upstream.url)),
            "--api-keys",
            str(keys_file(tmp_path)),
            "--admin-key-env",
            "OPS_TEST_ADMIN",
            "--rate-limit-per-s",
            "0",
            "--breaker-error-rate",
            "1",
            "--ttft-slo-ms",
            "0",  # the queue's TTFT would have the shedder refuse alice's streams
            "--drain-timeout-s",
            "1",
        )
        server = stack.enter_context(run_server(*args, env=ADMIN_ENV))
        assert httpx.get(server.url + "/ops").status_code == 404  # no admin key: not there
        assert httpx.get(server.url + "/v1/admin/events").status_code == 404
        page_headers = httpx.get(server.url + "/ops", headers=BEARER).headers
        assert "default-src 'self'" in page_headers["content-security-policy"]
        assert page_headers["x-frame-options"] == "DENY"

        load = stack.enter_context(Load(server.url))
        page = open_ops(browser, server.url, errors)
        wait_for(lambda: snapshots(page) >= 2, timeout=15)

        # Targets: gpu-down ejected, gpu-a full with a queue, as /metrics says.
        def targets_agree(page: Page, m: dict[str, float]) -> bool:
            down = m['firsttoken_target_up{target="gpu-down"}'] == 0
            shown_down = cell(page, "targets", "gpu-down", "state").startswith("ejected")
            flight = int(m['firsttoken_target_in_flight{target="gpu-a"}'])
            queued = int(m['firsttoken_queue_length{target="gpu-a"}'])
            return (
                down
                and shown_down
                and cell(page, "targets", "gpu-a", "in_flight") == f"{flight} / 2"
                and cell(page, "targets", "gpu-a", "queue") == str(queued)
                and queued > 0
            )

        wait_for(lambda: agrees(page, server, targets_agree), timeout=60, interval=0.5)

        # Traffic by route, keys against their limits.
        def traffic_agrees(page: Page, m: dict[str, float]) -> bool:
            chat = int(m.get('firsttoken_route_active_streams{route="chat"}', -1))
            alice = int(m.get('firsttoken_key_active_streams{key="alice"}', -1))
            bob = int(m.get('firsttoken_key_active_streams{key="bob"}', -1))
            return (
                cell(page, "traffic", "chat", "active") == str(chat)
                and cell(page, "keys", "alice", "streams") == f"{alice} / 8"
                and cell(page, "keys", "bob", "streams") == f"{bob} / 4"
            )

        assert agrees(page, server, traffic_agrees)

        # Tokens per minute against alice's budget: a number with its limit.
        assert cell(page, "keys", "alice", "tokens_per_min").endswith("/ 1,000,000")
        assert page.is_hidden("#keys th.spend")  # no prices on this server: no spend column

        # The cut upstream's errors, with their trace ids, route and target.
        wait_for(lambda: load.error_traces, timeout=30)
        traces = set(load.error_traces)

        def error_shown() -> bool:
            shown = page.evaluate(
                "() => [...document.querySelectorAll('#errors tbody tr')].map(tr => Object"
                ".fromEntries([...tr.children].map(td => [td.dataset.field, td.textContent])))"
            )
            return any(
                row["trace_id"] in traces
                and row["route"] == "cut"
                and row["target"] == "gpu-cut"
                and row["key"] == "bob"
                for row in shown
            ) or bool(traces.update(load.error_traces))

        wait_for(error_shown, timeout=15, interval=0.3)

        # TTFT p99 is past 300 ms: marked broken, on the page and in its title.
        level = '#slo [data-level="ttft_p99"]'
        wait_for(lambda: page.get_attribute(level, "data-broken") == "true", timeout=30)
        assert "BROKEN" in page.inner_text(level)
        assert page.get_attribute('#slo [data-level="ttft_p50"]', "data-broken") == "false"
        assert page.title().startswith("⚠")

        # The charts have points and are drawn (a canvas with pixels on it).
        assert page.evaluate("() => window.opsState.points.length") >= 2
        painted = page.evaluate(
            "() => { const c = document.getElementById('chart-active');"
            " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            " let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }"
        )
        assert painted > 500
        # No flicker: over three snapshots, rows and cards are updated in place, never
        # replaced (only text changes), and the charts' canvases stay the same elements (the
        # errors and events lists drop their oldest rows: those are not watched).
        page.evaluate(
            """() => { window.replacedNodes = 0;
            new MutationObserver((records) => { for (const r of records) {
              if (r.target.closest('#errors, #events')) continue;
              for (const n of r.removedNodes)
                if (n.nodeType === 1 && n.matches('tr, .level, canvas')) window.replacedNodes++;
            } }).observe(document.querySelector('main'), { childList: true, subtree: true });
            }"""
        )
        seen = snapshots(page)
        wait_for(lambda: snapshots(page) >= seen + 3, timeout=10)
        assert page.evaluate("() => window.replacedNodes") == 0
        # Live lines: the ejection and failovers were said as they happened.
        assert page.locator("#events li").count() > 0
        page.screenshot(path=ARTIFACTS / "ops-page.png", full_page=True)

        # A restart: the page says it lost the feed, and comes back on its own.
        server.kill(15)
        wait_for(lambda: page.get_attribute("#status", "data-state") == "reconnecting", timeout=15)
        page.screenshot(path=ARTIFACTS / "ops-reconnecting.png")
        before = snapshots(page)
        second = stack.enter_context(run_server(*args, env=ADMIN_ENV))
        wait_for(lambda: snapshots(page) > before + 1, timeout=30)
        assert page.get_attribute("#status", "data-state") == "live"
        assert second.port == port
        wait_for(lambda: cell(page, "targets", "gpu-a", "in_flight").endswith("/ 2"), timeout=10)
    assert not errors, f"uncaught errors in the page: {errors}"


def test_admin_events_feed_shapes(tmp_path: Path) -> None:
    """The feed other tools read: `retry`, then `history`, then a `snapshot` a second."""
    with run_server("--admin-key-env", "OPS_TEST_ADMIN", env=ADMIN_ENV) as server:
        events: list[tuple[str, Any]] = []
        with httpx.stream(
            "GET", server.url + "/v1/admin/events", headers=BEARER, timeout=10
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert resp.headers["cache-control"] == "no-cache, no-transform"
            started = time.monotonic()
            block: dict[str, str] = {}
            for line in resp.iter_lines():
                if line == "":
                    if "event" in block:
                        events.append((block["event"], json.loads(block["data"])))
                    block = {}
                    if sum(e == "snapshot" for e, _ in events) >= 3:
                        break
                    continue
                name, _, value = line.partition(": ")
                block[name] = value
        elapsed = time.monotonic() - started
        assert events[0][0] == "history" and isinstance(events[0][1], list)
        kinds = [e for e, _ in events]
        assert kinds.count("snapshot") == 3
        assert elapsed < 4  # one a second (the first is sent at once)
        snapshot = events[-1][1]
        for section in ("slo", "traffic", "targets", "keys", "errors", "breaker", "deps"):
            assert section in snapshot
        assert snapshot["slo"]["ttft_p99"]["target"] == 0.3
        assert snapshot["deps"] == {"redis": None, "otel": None, "ledger": None}


def test_the_feed_shows_every_worker(tmp_path: Path) -> None:
    """Under --workers the feed is the whole server: streams and errors of every worker,
    whichever worker serves the feed."""
    body = {
        "stream": True,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "w"}],
        "synthetic": {"ttft_ms": 10, "itl_ms": 100},
    }
    failing = {**body, "max_tokens": 5, "synthetic": {"fail_after": 2, "itl_ms": 1}}
    args = ("--workers", "2", "--admin-key-env", "OPS_TEST_ADMIN")
    with run_server(*args, env=ADMIN_ENV) as server:
        url = server.url + "/v1/chat/completions"
        # New connections each: the kernel spreads them over both workers, though not always
        # evenly (once all of 8 went to one): more until both have failed some.
        sent = 0
        while sent < 8 or (len(_error_pids(server, sent)) < 2 and sent < 40):
            for _ in range(8):
                httpx.post(url, json=failing, timeout=10)
            sent += 8
        stop = threading.Event()

        def hold() -> None:
            while not stop.is_set():
                httpx.post(url, json=body, timeout=30)

        threads = [threading.Thread(target=hold, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: server.metric("firsttoken_active_streams") >= 6, timeout=15)
            # A worker's errors reach the others within about two seconds (its file is written
            # a second after an error): past that, every worker's view has them all.
            wait_for(lambda: len(_fresh_snapshot(server)["errors"]) == sent, timeout=15)
            time.sleep(2.5)
            for _ in range(3):  # each time on a new connection, any worker may answer
                snapshot = _fresh_snapshot(server)
                assert snapshot["workers"] == 2
                assert snapshot["traffic"]["active"] == 6
                assert snapshot["keys"]["open"]["active"] == 6
                assert len(snapshot["errors"]) == sent
                assert len({e["pid"] for e in snapshot["errors"]}) == 2  # both workers'
                assert {e["code"] for e in snapshot["errors"]} == {"engine_error"}
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)


def _error_pids(server: Server, sent: int) -> set[int]:
    """The workers that failed the `sent` requests, once the feed holds all of them."""
    wait_for(lambda: len(_fresh_snapshot(server)["errors"]) == sent, timeout=15)
    time.sleep(2.5)  # every worker's file written: any worker's view has them all
    return {e["pid"] for e in _fresh_snapshot(server)["errors"]}


def _fresh_snapshot(server: Server) -> dict[str, Any]:
    """The first snapshot built after connecting (the one sent at once may be a second old)."""
    with httpx.stream("GET", server.url + "/v1/admin/events", headers=BEARER, timeout=10) as resp:
        event, seen = "", 0
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "snapshot":
                seen += 1
                if seen == 2:
                    return dict(json.loads(line[6:]))
    raise AssertionError("no snapshot")


def test_a_reload_is_told_and_the_new_keys_shown(tmp_path: Path) -> None:
    keys = keys_file(tmp_path)
    args = ("--api-keys", str(keys), "--admin-key-env", "OPS_TEST_ADMIN")
    with run_server(*args, env=ADMIN_ENV) as server:
        assert set(_fresh_snapshot(server)["keys"]) == {"alice", "bob"}
        keys.write_text(keys.read_text() + '[[keys]]\nname = "carol"\nkey = "sk-carol"\n')
        seen: list[tuple[str, Any]] = []
        with httpx.stream(
            "GET", server.url + "/v1/admin/events", headers=BEARER, timeout=10
        ) as resp:
            event, sent = "", False
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    seen.append((event, json.loads(line[6:])))
                    if event == "snapshot" and not sent:
                        server.proc.send_signal(signal.SIGHUP)  # reload, now that we listen
                        sent = True
                    if event == "snapshot" and "carol" in seen[-1][1]["keys"]:
                        break
        changes = [data for event, data in seen if event == "change"]
        assert {"kind": "reload", "result": "ok"}.items() <= changes[-1].items()
        assert seen[-1][1]["keys"]["carol"]["max_streams"] == 5  # the server's default
