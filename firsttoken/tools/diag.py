"""`firsttoken diag URL`: measure any SSE endpoint and say whether something buffered it.

Exit status: 0 when every stream completed ([DONE] seen, no error), 1 when any failed or was
truncated, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from firsttoken.config import Parser
from firsttoken.tools._capture import CaptureWriter
from firsttoken.tools._load import HttpVersions, LoadRun, limits, make_client, run_load
from firsttoken.tools._measure import Kind, RequestSpec, StreamResult, detect_kind
from firsttoken.tools._plot import NEEDS as PLOT_NEEDS
from firsttoken.tools._report import load_json, render_load, render_single, single_json
from firsttoken.tools._tcpinfo import TcpWatch, watched_transport
from firsttoken.tools._tcpinfo import describe as describe_tcp

__all__ = ["main"]

DEFAULT_PROMPT = "Tell me a long story about a lighthouse keeper."


def build_parser() -> Parser:
    p = Parser(
        prog="firsttoken diag",
        description="Measure an SSE endpoint (OpenAI-compatible or native): TTFT, inter-chunk "
        "times, [DONE], id gaps, heartbeats, anti-buffering headers, and a buffering verdict.",
    )
    _request_options(p)
    _run_options(p)
    return p


def _request_options(p: Parser) -> None:
    """What each stream asks for, and how."""
    p.add_argument("url", help="…/chat/completions, …/completions, …/v1/streams, or any SSE URL")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: %(default)r)")
    p.add_argument(
        "--model",
        default=None,
        help="model id (default: the server's only model from /models, else none)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens (default: 128; 0 omits)")
    p.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="JSON object merged into the request body, e.g. '{\"seed\": 1}'",
    )
    p.add_argument(
        "-H",
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="extra request header (repeatable)",
    )
    p.add_argument("--api-key", default=None, help="sends Authorization: Bearer KEY")
    p.add_argument(
        "--no-usage", action="store_true", help="don't ask for stream_options.include_usage"
    )
    p.add_argument(
        "--timestamps",
        action="store_true",
        help="ask the server for `: t=` send timestamps (firsttoken: stream_options.timestamps "
        "or ?timestamps=1) to measure the delay the path adds",
    )
    p.add_argument(
        "--kind",
        choices=["auto", *[k.value for k in Kind]],
        default="auto",
        help="request shape (default: auto, from the URL path)",
    )


def _run_options(p: Parser) -> None:
    """How many streams, how long to wait, and what to make of what arrives."""
    p.add_argument("--concurrency", type=int, default=1, help="streams at once (default: 1)")
    p.add_argument(
        "--requests", type=int, default=None, help="streams in all (default: the concurrency)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the next byte (default: 60)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--packet-loss",
        action="store_true",
        help="read the client socket's TCP_INFO over the stream: retransmissions, loss, RTT, "
        'and how much of the inter-chunk tail they explain (--json: "tcp")',
    )
    p.add_argument(
        "--capture",
        default=None,
        metavar="FILE",
        help="write every event with its receive time (JSON lines)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw the chunk arrival timeline and latency histograms",
    )
    p.add_argument("--insecure", action="store_true", help="don't verify TLS certificates")
    p.add_argument(
        "--http2",
        action="store_true",
        help="speak HTTP/2 to an http:// URL (h2c, prior knowledge); https:// URLs offer "
        'HTTP/2 and HTTP/1.1 always, and the server picks (--json: "http_version")',
    )
    p.add_argument(
        "--progress",
        choices=["auto", "on", "off"],
        default="auto",
        help="progress bar in load mode (default: auto, when stderr is a terminal)",
    )


def build_spec(args: argparse.Namespace) -> RequestSpec:
    if urlsplit(args.url).scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {args.url}")
    kind = detect_kind(args.url) if args.kind == "auto" else Kind(args.kind)
    extra: dict[str, Any] = {}
    if args.extra_body:
        bad = f"invalid --extra-body {args.extra_body!r}"
        try:
            extra = json.loads(args.extra_body)
        except ValueError as exc:  # the parser's words alone do not say which option
            raise ValueError(f"{bad}: not JSON ({exc})") from None
        if not isinstance(extra, dict):
            raise ValueError(f"{bad}: must be a JSON object")
    headers: dict[str, str] = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"bad header {h!r}: want 'Name: value'")
        headers[name.strip()] = value.strip()
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
        if kind is Kind.MESSAGES:
            headers["x-api-key"] = args.api_key  # what Anthropic's API reads
    if kind is Kind.MESSAGES:
        headers.setdefault("anthropic-version", "2023-06-01")
    if args.concurrency < 1 or (args.requests is not None and args.requests < 1):
        raise ValueError("--concurrency and --requests must be at least 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Said before the load runs, not after it.
        raise ValueError(PLOT_NEEDS)
    return RequestSpec(
        url=args.url,
        kind=kind,
        prompt=args.prompt,
        model=args.model,
        max_tokens=args.max_tokens or None,
        extra_body=extra,
        headers=headers,
        include_usage=not args.no_usage,
        timestamps=args.timestamps,
    )


async def resolve_model(
    spec: RequestSpec, timeout_s: float, verify: bool, versions: HttpVersions | None = None
) -> None:
    """Fill in the model when the server offers exactly one (or `synthetic`)."""
    endpoints = {
        Kind.CHAT: "/chat/completions",
        Kind.COMPLETIONS: "/completions",
        Kind.RESPONSES: "/responses",
        Kind.MESSAGES: "/messages",
    }
    if spec.model is not None or spec.kind not in endpoints:
        return
    base = spec.url.rstrip("/").rsplit(endpoints[spec.kind], 1)[0]
    try:
        async with make_client(min(timeout_s, 10.0), 1, verify, versions=versions) as client:
            resp = await client.get(base + "/models", headers=spec.headers)
        ids = [str(m["id"]) for m in resp.json().get("data", [])] if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        ids = []
    if len(ids) == 1:
        spec.model = ids[0]
    elif "synthetic" in ids:
        spec.model = "synthetic"
    elif ids:
        shown = ", ".join(ids[:8]) + (" …" if len(ids) > 8 else "")
        raise ValueError(f"the server offers several models; pass --model (one of: {shown})")


async def _run(args: argparse.Namespace, spec: RequestSpec) -> int:
    verify = not args.insecure
    versions = HttpVersions.for_url(spec.url, args.http2)
    await resolve_model(spec, args.timeout, verify, versions)
    requests = args.requests or args.concurrency
    load_mode = requests > 1 or args.concurrency > 1
    writer: CaptureWriter | None = None
    if args.capture:
        writer = CaptureWriter(args.capture, spec.url, str(spec.kind), time.time())
    show = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    progress = Progress(
        TextColumn("streams"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not (load_mode and show),
    )
    task = progress.add_task("streams", total=requests)

    def on_result(i: int, result: StreamResult) -> None:
        if writer is not None:
            writer.stream(i, result)
        progress.advance(task)

    watch = TcpWatch() if args.packet_loss else None
    transport = None
    if watch is not None:
        transport = watched_transport(
            watch, limits(args.concurrency), verify, versions.http1, versions.http2
        )
    try:
        with progress:
            run: LoadRun = await run_load(
                spec,
                args.concurrency,
                requests,
                args.timeout,
                verify,
                on_result,
                transport,
                versions,
            )
    finally:
        if writer is not None:
            writer.close()
    if args.plot:
        from firsttoken.tools._plot import plot

        plot(run.results, args.plot, spec.url)
    data = load_json(run) if load_mode else single_json(run.results[0], run.verdicts[0])
    if watch is not None:
        data["tcp"] = watch.summary()
    problems = [r.problem() for r in run.results]
    if args.json:
        print(json.dumps(data), flush=True)
    elif all(problems):
        # Nothing was measured: one line that says why, not a table of dashes.
        print(f"firsttoken diag: {problems[0]}", file=sys.stderr)
    elif load_mode:
        render_load(Console(), data)
    else:
        render_single(Console(), data)
    if watch is not None and not args.json:
        print(describe_tcp(data["tcp"]))
    return 0 if all(r.ok for r in run.results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = build_spec(args)
        return asyncio.run(_run(args, spec))
    except ValueError as exc:
        print(f"firsttoken diag: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `diag ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
