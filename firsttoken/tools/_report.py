"""What diag prints: one JSON object, or rich tables."""

from __future__ import annotations

import itertools
from typing import Any

from rich.console import Console
from rich.table import Table

from firsttoken.formats.sse import owner_of_id
from firsttoken.tools._load import LoadRun
from firsttoken.tools._measure import StreamResult
from firsttoken.tools._stats import summary
from firsttoken.tools._verdict import Verdict

__all__ = ["header_checks", "load_json", "render_load", "render_single", "single_json"]

_SHOWN_HEADERS = (
    "content-type",
    "cache-control",
    "x-accel-buffering",
    "content-encoding",
    "content-length",
    "transfer-encoding",
    "connection",
    "x-stream-id",
    "x-request-id",
)


def header_checks(headers: dict[str, str]) -> list[dict[str, Any]]:
    """The headers that decide whether intermediaries leave a stream alone."""
    h = {k.lower(): v for k, v in headers.items()}
    out: list[dict[str, Any]] = []

    def add(name: str, ok: bool | None, note: str) -> None:
        out.append({"header": name, "value": h.get(name), "ok": ok, "note": note})

    ctype = h.get("content-type", "")
    add(
        "content-type",
        ctype.startswith("text/event-stream"),
        "text/event-stream" if ctype.startswith("text/event-stream") else "not an event stream",
    )
    cache = h.get("cache-control", "").lower()
    add(
        "cache-control",
        "no-cache" in cache and "no-transform" in cache,
        "ok"
        if "no-transform" in cache
        else "want no-cache, no-transform (stops transforming proxies and caches)",
    )
    xab = h.get("x-accel-buffering", "").lower()
    add(
        "x-accel-buffering",
        xab == "no",
        "ok: nginx won't buffer" if xab == "no" else "absent: nginx may buffer this response",
    )
    enc = h.get("content-encoding", "").lower()
    add(
        "content-encoding",
        True if enc in ("", "identity") else None,
        "none"
        if enc in ("", "identity")
        else "compressed: fine only if flushed per event (see the verdict)",
    )
    if "content-length" in h:
        add("content-length", False, "a length means the body was complete before it was sent")
    for name in ("transfer-encoding", "connection"):
        if name in h:
            add(name, None, "")
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 3)


def _tokens(result: StreamResult) -> int:
    usage = result.usage or {}
    n = usage.get("completion_tokens")
    return int(n) if isinstance(n, int) and n > 0 else len(result.content)


def tokens_per_s(result: StreamResult) -> float | None:
    """Decode rate: tokens after the first chunk over the time they took to arrive."""
    content = result.content
    if len(content) < 2:
        return None
    span = content[-1].t - content[0].t
    tokens = _tokens(result)
    after_first = tokens * (len(content) - 1) / len(content)
    return round(after_first / span, 2) if span > 0 else None


def _heartbeats(result: StreamResult) -> dict[str, Any]:
    pings = [c.t for c in result.comments if c.text.strip() == "ping"]
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    return {"count": len(pings), "max_gap_ms": _ms(max(gaps)) if gaps else None}


def _ids(result: StreamResult) -> dict[str, Any]:
    seen = 0
    gaps = 0
    missing = 0
    backwards = 0
    prev: int | None = None
    for ev in result.events:
        if ev.id is None:
            continue
        seen += 1
        try:
            cur = owner_of_id(int(ev.id))[1]  # a takeover's ids name their owner too
        except ValueError:
            prev = None
            continue
        if prev is not None:
            if cur > prev + 1:
                gaps += 1
                missing += cur - prev - 1
            elif cur <= prev:
                backwards += 1
        prev = cur
    return {"seen": seen, "gaps": gaps, "missing": missing, "out_of_order": backwards}


def single_json(result: StreamResult, verdict: Verdict) -> dict[str, Any]:
    content = result.content
    first_byte = result.reads[0].t if result.reads else None
    return {
        "url": result.url,
        "kind": str(result.kind),
        "status": result.status,
        "http_version": result.http_version,
        "ttft_ms": _ms(result.ttft),
        "ttft_e2e_ms": _ms(result.ttft_e2e),
        "connect_ms": _ms(result.connect_s),
        "request_sent_ms": _ms(result.sent_t),
        "first_byte_ms": _ms(first_byte),
        "headers_ms": _ms(result.headers_t),
        "total_ms": _ms(result.end_t),
        "itl_ms": summary(result.intervals),
        "chunks": len(content),
        "events": len(result.events),
        "tokens": _tokens(result),
        "tokens_per_s": tokens_per_s(result),
        "bytes": result.decoded_bytes,
        "wire_bytes": result.wire_bytes,
        "reads": len(result.reads),
        "done": result.done,
        "truncated": not result.done,
        "finish_reason": result.finish_reason,
        "error": result.error,
        "ids": _ids(result),
        "heartbeats": _heartbeats(result),
        "headers": {k: result.headers[k] for k in _SHOWN_HEADERS if k in result.headers},
        # Anti-buffering headers mean something only on an event stream.
        "header_checks": header_checks(result.headers) if result.is_stream else [],
        "problem": result.problem(),
        "buffered": verdict.buffered,
        "verdict": verdict.label,
        "reason": verdict.reason,
        "bursts": len(verdict.bursts),
        "server_delay_ms": verdict.server_delay_ms,
    }


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}{unit}"
    return f"{v}{unit}"


def _verdict_style(buffered: bool | None) -> str:
    return "yellow" if buffered is None else "red bold" if buffered else "green bold"


def render_single(console: Console, data: dict[str, Any]) -> None:
    table = Table(title=f"firsttoken diag  {data['url']}", show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    itl = data["itl_ms"]
    table.add_row("status", f"{_fmt(data['status'])} {data['http_version'] or ''} ({data['kind']})")
    table.add_row(
        "TTFT",
        f"{_fmt(data['ttft_ms'], ' ms')} after the request was sent "
        f"({_fmt(data['ttft_e2e_ms'], ' ms')} with connect "
        f"{_fmt(data['connect_ms'], ' ms')} and send)",
    )
    table.add_row(
        "first byte / headers",
        f"{_fmt(data['first_byte_ms'], ' ms')} / {_fmt(data['headers_ms'], ' ms')}",
    )
    table.add_row(
        "inter-chunk p50/p90/p99/max",
        " / ".join(_fmt(itl[k]) for k in ("p50", "p90", "p99", "max")) + " ms",
    )
    table.add_row("chunks / tokens", f"{data['chunks']} / {data['tokens']}")
    table.add_row("tokens/s", _fmt(data["tokens_per_s"]))
    table.add_row(
        "bytes (wire)", f"{data['bytes']:,} ({data['wire_bytes']:,}) in {data['reads']} reads"
    )
    table.add_row("total", _fmt(data["total_ms"], " ms"))
    done = "[green]yes[/]" if data["done"] else "[red]no: truncated[/]"
    table.add_row(
        "[DONE] seen",
        done + (f"  finish_reason={data['finish_reason']}" if data["finish_reason"] else ""),
    )
    if data["error"]:
        table.add_row("error", f"[red]{data['error']['code']}[/]: {data['error']['message']}")
    ids = data["ids"]
    table.add_row(
        "ids",
        f"{ids['seen']} seen, {ids['gaps']} gaps ({ids['missing']} missing), "
        f"{ids['out_of_order']} out of order"
        if ids["seen"]
        else "none",
    )
    hb = data["heartbeats"]
    table.add_row(
        "heartbeats",
        f"{hb['count']}" + (f", max gap {hb['max_gap_ms']:.0f} ms" if hb["max_gap_ms"] else ""),
    )
    sd = data["server_delay_ms"]
    if sd:
        table.add_row(
            "server→client delay",
            f"p50 {sd['p50']:.1f} / p99 {sd['p99']:.1f} / max "
            f"{sd['max']:.1f} ms; added over best p50 {sd['added_p50']:.1f} / p90 "
            f"{sd['added_p90']:.1f} / max {sd['added_max']:.1f} ms",
        )
    console.print(table)
    headers = Table(title="anti-buffering headers", title_justify="left")
    for col in ("header", "value", "", "note"):
        headers.add_column(col)
    for chk in data["header_checks"]:
        mark = {True: "[green]ok[/]", False: "[red]!![/]", None: ""}[chk["ok"]]
        headers.add_row(chk["header"], chk["value"] or "-", mark, chk["note"])
    console.print(headers)
    style = _verdict_style(data["buffered"])
    console.print(f"verdict: [{style}]{data['verdict']}[/] — {data['reason']}")


def load_json(run: LoadRun) -> dict[str, Any]:
    results = run.results
    ttfts = [r.ttft for r in results if r.ttft is not None]
    intervals = [i for r in results for i in r.intervals]
    completed = sum(1 for r in results if r.ok)
    buffered = [v.buffered for v in run.verdicts]
    ttft = summary(ttfts)
    wall = run.wall_s
    tokens = sum(_tokens(r) for r in results if r.status == 200)
    return {
        "mode": "load",
        "url": run.url,
        "requests": len(results),
        "concurrency": run.concurrency,
        # The versions the streams went over, e.g. "HTTP/2" ("HTTP/1.1, HTTP/2" when mixed).
        "http_version": ", ".join(sorted({r.http_version for r in results if r.http_version}))
        or None,
        "completed": completed,
        "completion_rate": round(completed / len(results), 4) if results else None,
        "errors": dict(sorted(run.error_counts().items())),
        "ttft_ms": ttft["p50"],
        "ttft_ms_pct": ttft,
        "itl_ms": summary(intervals),
        "chunks": sum(len(r.content) for r in results),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "bytes": sum(r.decoded_bytes for r in results),
        "done": bool(results) and all(r.done for r in results),
        "buffered": any(b is True for b in buffered),
        "buffered_streams": sum(1 for b in buffered if b is True),
        "verdicts": dict(sorted(run.verdict_counts().items())),
        "wall_s": round(wall, 3),
        "client_cpu_s": round(run.cpu_s, 3),
        "client_cpu_percent": round(100.0 * run.cpu_s / wall, 1) if wall > 0 else None,
    }


def render_load(console: Console, data: dict[str, Any]) -> None:
    table = Table(title=f"firsttoken diag load  {data['url']}", title_justify="left")
    for col in ("", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="right")
    for name, key in (("TTFT ms", "ttft_ms_pct"), ("inter-chunk ms", "itl_ms")):
        row = data[key]
        table.add_row(name, *(_fmt(row[k]) for k in ("p50", "p90", "p99", "max")))
    console.print(table)
    summary_table = Table(show_header=False)
    summary_table.add_column("metric", style="bold")
    summary_table.add_column("value")
    summary_table.add_row("requests / concurrency", f"{data['requests']} / {data['concurrency']}")
    summary_table.add_row("HTTP version", data["http_version"] or "-")
    rate = data["completion_rate"]
    summary_table.add_row("completed", f"{data['completed']} ({_fmt(rate and rate * 100)}%)")
    errors = ", ".join(f"{k}: {v}" for k, v in data["errors"].items()) or "none"
    summary_table.add_row("errors by code", errors)
    summary_table.add_row("chunks / tokens", f"{data['chunks']} / {data['tokens']}")
    summary_table.add_row("tokens/s (all streams)", _fmt(data["tokens_per_s"]))
    summary_table.add_row("wall", _fmt(data["wall_s"], " s"))
    cpu = data["client_cpu_percent"]
    warn = "  [yellow](client-bound: figures include client delay)[/]" if cpu and cpu > 80 else ""
    summary_table.add_row(
        "client CPU", f"{_fmt(data['client_cpu_s'], ' s')} = {_fmt(cpu, '% of one core')}{warn}"
    )
    verdicts = ", ".join(f"{k}: {v}" for k, v in data["verdicts"].items())
    summary_table.add_row("verdicts", verdicts)
    console.print(summary_table)
    style = _verdict_style(data["buffered"])
    label = f"{data['buffered_streams']} streams buffered" if data["buffered"] else "clean"
    console.print(f"verdict: [{style}]{label}[/]")
