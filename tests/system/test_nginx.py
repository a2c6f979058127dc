"""deploy/nginx.conf with a real nginx: clean streaming, and diag catching a misconfigured one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from statistics import median
from typing import Any

import httpx
import pytest

from firsttoken.engines import synthetic_tokens
from firsttoken.formats.sse import EventDecoder
from tests.nginx import (
    DEPLOY_CONF,
    MULTI_CONF,
    check_config,
    free_port,
    render_config,
    run_nginx,
)
from tests.redis_server import run_redis
from tests.servers import Server, run_server
from tests.system.test_diag import run_diag

# No skip when nginx is missing: ./scripts/test installs it, and CI must fail without it.

CHAT = "/v1/chat/completions"
# gzip for the event stream, as a careless global `gzip_types` would do.
GZIP_SSE = {
    "gzip off;": "gzip on;\n            gzip_types text/event-stream;\n"
    "            gzip_min_length 0;"
}
# Buffering on, and our X-Accel-Buffering: no ignored.
BUFFER_IGNORING = {
    "proxy_buffering off;": "proxy_buffering on;\n"
    "            proxy_ignore_headers X-Accel-Buffering;"
}
# Buffering on, but X-Accel-Buffering: no honoured (nginx's default behaviour).
BUFFER_HONOURING = {"proxy_buffering off;": "proxy_buffering on;"}


@pytest.fixture(scope="module")
def upstream() -> Iterator[Server]:
    with run_server("--synthetic-ttft-ms", "100", "--synthetic-itl-ms", "10") as s:
        yield s


@pytest.mark.parametrize("conf", [DEPLOY_CONF, MULTI_CONF], ids=["single", "multi"])
def test_deploy_config_is_valid(conf: Path, tmp_path: Path) -> None:
    text = render_config(conf.read_text(), [8000, 8001], free_port(), tmp_path)
    proc = check_config(text, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_clean_through_nginx(upstream: Server, tmp_path: Path) -> None:
    direct: list[dict[str, Any]] = []
    proxied: list[dict[str, Any]] = []
    with run_nginx([upstream.port], tmp_path) as ng:
        run_diag(ng.url + CHAT, "--max-tokens", "2")  # warm the worker and upstream keepalive
        for _ in range(4):  # interleaved, so a busy spell on the machine hits both alike
            for base, out in ((upstream.url, direct), (ng.url, proxied)):
                rc, d = run_diag(base + CHAT, "--max-tokens", "20")
                assert rc == 0 and d["chunks"] == 20 and d["done"] is True
                out.append(d)
        rc_native, native = run_diag(ng.url + "/v1/streams", "--max-tokens", "20")
        rc_stamped, stamped = run_diag(ng.url + CHAT, "--max-tokens", "20", "--timestamps")
    assert all(d["buffered"] is False for d in direct + proxied), [d["reason"] for d in proxied]
    ttft_direct = [d["ttft_ms"] for d in direct]
    ttft_proxied = [d["ttft_ms"] for d in proxied]
    itl_direct = median(d["itl_ms"]["p50"] for d in direct)
    itl_proxied = median(d["itl_ms"]["p50"] for d in proxied)
    # Paired by round: what nginx adds, with the machine's slow spells cancelled out.
    added = median(p - d for p, d in zip(ttft_proxied, ttft_direct, strict=True))
    print(
        f"TTFT p50 direct {median(ttft_direct):.2f} ms, via nginx {median(ttft_proxied):.2f} ms "
        f"(nginx adds {added:+.2f} ms, paired median); ITL p50 {itl_direct:.2f} / "
        f"{itl_proxied:.2f} ms"
    )
    assert abs(added) < 5.0
    assert abs(median(ttft_proxied) - median(ttft_direct)) < 10.0
    assert abs(itl_proxied - itl_direct) < 2.0
    assert rc_native == 0
    assert native["done"] is True and native["buffered"] is False and native["chunks"] == 20
    assert rc_stamped == 0 and stamped["buffered"] is False, stamped["reason"]
    assert stamped["server_delay_ms"] is not None


def test_gzip_and_ignored_x_accel_is_flagged(upstream: Server, tmp_path: Path) -> None:
    """Measured on Debian's nginx 1.22: the whole stream then arrives at the end."""
    with run_nginx([upstream.port], tmp_path, {**GZIP_SSE, **BUFFER_IGNORING}) as ng:
        rc, d = run_diag(ng.url + CHAT, "--max-tokens", "30")
        rc_stamped, stamped = run_diag(ng.url + CHAT, "--max-tokens", "30", "--timestamps")
    assert rc_stamped == 0 and stamped["buffered"] is True
    assert "added delay" in stamped["reason"] and "nothing until the end" in stamped["reason"]
    assert rc == 0 and d["done"] is True and d["chunks"] == 30
    assert d["headers"].get("content-encoding") == "gzip"
    assert d["buffered"] is True, d["reason"]
    assert d["reason"].startswith("nothing until the end") and "gzip" in d["reason"]


def test_gzip_with_x_accel_honoured_streams_cleanly(upstream: Server, tmp_path: Path) -> None:
    with run_nginx([upstream.port], tmp_path, {**GZIP_SSE, **BUFFER_HONOURING}) as ng:
        rc, d = run_diag(ng.url + CHAT, "--max-tokens", "30")
    assert rc == 0 and d["done"] is True and d["chunks"] == 30
    assert d["headers"].get("content-encoding") == "gzip"  # compressed, flushed per event
    assert d["buffered"] is False and d["verdict"] == "clean", d["reason"]


def test_buffering_on_with_slow_small_events_is_not_flagged(
    upstream: Server, tmp_path: Path
) -> None:
    """nginx's proxy buffering still passes slow, small events on at once: judge arrivals."""
    with run_nginx([upstream.port], tmp_path, BUFFER_IGNORING) as ng:
        rc, d = run_diag(ng.url + CHAT, "--max-tokens", "30")
    assert rc == 0 and d["buffered"] is False, d["reason"]


def test_multi_instance_config_balances_streams(tmp_path: Path) -> None:
    with (
        run_server("--synthetic-ttft-ms", "50", "--synthetic-itl-ms", "5") as a,
        run_server("--synthetic-ttft-ms", "50", "--synthetic-itl-ms", "5") as b,
        run_nginx([a.port, b.port], tmp_path, base=MULTI_CONF) as ng,
    ):
        rc, d = run_diag(
            ng.url + CHAT, "--max-tokens", "10", "--requests", "4", "--concurrency", "2"
        )
        served = [s.metric('firsttoken_streams_total{outcome="completed"}') for s in (a, b)]
    assert rc == 0 and d["completed"] == 4 and d["buffered"] is False
    assert sum(served) >= 4 and min(served) >= 1, served


def test_multi_instance_config_resumes_on_the_other_instance_with_redis(tmp_path: Path) -> None:
    def tokens_of(body: bytes, after: int = 0) -> tuple[list[str], bool]:
        events = EventDecoder().feed(body)
        done = any(e.data == "[DONE]" for e in events)
        texts = [
            e.data
            for e in events
            if e.event is None and e.data != "[DONE]" and int(e.id or 0) > after
        ]
        return [json.loads(t)["token"] for t in texts], done

    with run_redis() as redis_url:
        # At debug, `stream.accepted` names the instance that made the stream.
        args = ("--redis", redis_url, "--synthetic-ttft-ms", "10", "--synthetic-itl-ms", "5")
        args = (*args, "--log-level", "debug")
        with (
            run_server(*args) as a,
            run_server(*args) as b,
            run_nginx([a.port, b.port], tmp_path, base=MULTI_CONF) as ng,
        ):
            body = {"prompt": "through nginx", "max_tokens": 40}
            created = httpx.post(ng.url + "/v1/streams", json=body, timeout=10).json()
            events_url = ng.url + created["events_url"]
            whole = httpx.get(events_url, timeout=20).content
            tokens, done = tokens_of(whole)
            assert done and tokens == synthetic_tokens("through nginx", None, 40)[0]
            # The instance that made the stream goes away; nginx sends the resume to the
            # other one, which reads the stream from Redis.
            [owner] = [
                s
                for s in (a, b)
                if any(
                    x["event"] == "stream.accepted" and x.get("stream") == created["id"]
                    for x in s.log_records()
                )
            ]
            owner.kill()
            r = httpx.get(events_url, headers={"Last-Event-ID": "10"}, timeout=20)
            assert r.status_code == 200
            assert tokens_of(r.content) == tokens_of(whole, after=10)
