"""`firsttoken replay FILE`: play a `diag --capture` file back with its original timing.

To stdout (SSE wire format, or just the text), or with `--serve` as an SSE endpoint on any path
(GET or POST; `POST …/v1/streams` answers like the native API) that the web page or `diag` can
consume. Times are the capture's receive times divided by `--speed`, counted from the moment the
request arrives.
"""

from __future__ import annotations

import asyncio
import errno
import json
import signal
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from firsttoken.config import Parser
from firsttoken.formats.sse import ServerSentEvent, comment
from firsttoken.tools._capture import Recorded, load_capture
from firsttoken.tools._measure import Event, classify

__all__ = ["main"]

_MAX_HEADER = 65536
_STREAM_HEADERS = (
    "Content-Type: text/event-stream\r\n"
    "Cache-Control: no-cache, no-transform\r\n"
    "X-Accel-Buffering: no\r\n"
    "Access-Control-Allow-Origin: *\r\n"
    "X-Stream-Id: replay\r\n"
    "Transfer-Encoding: chunked\r\n"
)


def build_parser() -> Parser:
    p = Parser(prog="firsttoken replay", description=__doc__.splitlines()[0])
    p.add_argument("file", help="a capture written by `firsttoken diag --capture`")
    p.add_argument(
        "--speed", type=float, default=1.0, help="divide the original timing by this (default: 1.0)"
    )
    p.add_argument(
        "--stream", type=int, default=0, help="which stream of a load-mode capture (default: 0)"
    )
    p.add_argument(
        "--format",
        choices=["sse", "text"],
        default="sse",
        help="stdout: SSE wire format or just the content text (default: sse)",
    )
    p.add_argument("--serve", action="store_true", help="serve it as an SSE endpoint")
    p.add_argument("--host", default="127.0.0.1", help="--serve address (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=8000, help="--serve port, 0 for any free one (default: 8000)"
    )
    p.add_argument(
        "--send-timestamps",
        action="store_true",
        help="--serve: put a `: t=<send time>` comment before every event "
        "(default: only where the capture had one)",
    )
    return p


def _due(rec: Recorded, record: dict[str, Any], speed: float) -> float:
    return max(0.0, float(record["t"]) - rec.sse_request_t) / speed


def _is_stamp(text: str) -> bool:
    return text.strip().startswith("t=")


def _encode(record: dict[str, Any], stamp: bool) -> bytes:
    if record["type"] == "comment":
        return comment(record["text"])
    ev = ServerSentEvent(data=record["data"], event=record.get("event"), id=record.get("id"))
    # The original send stamps are stale; a fresh one says when *this* copy was sent.
    prefix = f": t={time.time():.6f}\n".encode() if stamp else b""
    return prefix + ev.encode()


def _playable(rec: Recorded, keep_stamps: bool) -> list[dict[str, Any]]:
    return [
        r for r in rec.records if r["type"] == "event" or not _is_stamp(r["text"]) or keep_stamps
    ]


def play_stdout(rec: Recorded, speed: float, fmt: str, out: IO[bytes]) -> None:
    start = time.perf_counter()
    for record in _playable(rec, keep_stamps=False):
        delay = start + _due(rec, record, speed) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if fmt == "sse":
            out.write(_encode(record, stamp=record.get("server_t") is not None))
        elif record["type"] == "event":
            ev = Event(t=0.0, data=record["data"], event=record.get("event"), id=None, size=0)
            classify(ev)
            if ev.role == "content":
                out.write(ev.text.encode())
        out.flush()
    if fmt == "text":
        out.write(b"\n")
        out.flush()


class _Request:
    def __init__(self, method: str, path: str, headers: dict[str, str]) -> None:
        self.method, self.path, self.headers = method, path, headers


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:  # drain a chunked body; its content doesn't matter to a replay
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        await reader.readexactly(int(headers.get("content-length", "0") or 0))
    return _Request(parts[0].upper(), parts[1], headers)


def _simple(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        "Access-Control-Allow-Origin: *\r\n\r\n"
    ).encode() + body


async def _play_http(
    rec: Recorded, speed: float, stamp_all: bool, writer: asyncio.StreamWriter
) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    writer.write(f"HTTP/1.1 200 OK\r\n{_STREAM_HEADERS}\r\n".encode())
    await writer.drain()
    for record in _playable(rec, keep_stamps=False):
        delay = start + _due(rec, record, speed) - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        stamp = record["type"] == "event" and (stamp_all or record.get("server_t") is not None)
        body = _encode(record, stamp)
        writer.write(f"{len(body):x}\r\n".encode() + body + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


def _handler(rec: Recorded, speed: float, stamp_all: bool) -> Callable[..., Any]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another on the connection
                req = await _read_request(reader)
                if req is None:
                    break
                path = req.path.split("?", 1)[0].rstrip("/")
                if req.method == "OPTIONS":
                    writer.write(
                        b"HTTP/1.1 204 No Content\r\nAccess-Control-Allow-Origin: *\r\n"
                        b"Access-Control-Allow-Methods: GET, POST\r\n"
                        b"Access-Control-Allow-Headers: *\r\nContent-Length: 0\r\n\r\n"
                    )
                elif req.method == "POST" and path.endswith("/v1/streams"):
                    info = {
                        "id": "replay",
                        "resume_token": "replay",
                        "events_url": f"{path}/replay/events?token=replay",
                    }
                    writer.write(_simple("201 Created", json.dumps(info).encode()))
                elif path.endswith("/healthz"):
                    writer.write(_simple("200 OK", b"ok\n", "text/plain"))
                else:
                    await _play_http(rec, speed, stamp_all, writer)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    return handle


class CannotListen(Exception):
    """The address cannot be bound; `str()` is the line a person reads."""


def _cannot_listen(host: str, port: int, exc: OSError) -> CannotListen:
    # The same words `serve` uses for the same mistakes.
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    why = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        why = "the address is already in use (another server? --port 0 picks a free port)"
    return CannotListen(f"cannot listen on {where}: {why}")


async def serve(rec: Recorded, speed: float, host: str, port: int, stamp_all: bool) -> None:
    """Serve until SIGINT/SIGTERM; raises CannotListen when the address cannot be bound."""
    try:
        server = await asyncio.start_server(_handler(rec, speed, stamp_all), host, port)
    except OSError as exc:  # busy port, an address not on this host, a host that won't resolve
        raise _cannot_listen(host, port, exc) from None
    bound = server.sockets[0].getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    print(
        json.dumps(
            {
                "event": "listening",
                "url": f"http://{shown}:{bound[1]}",
                "events": len(rec.events),
                "speed": speed,
            }
        ),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.speed <= 0:
        print("firsttoken replay: --speed must be positive", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(
            f"firsttoken replay: invalid --port {args.port}: must be from 0 to 65535",
            file=sys.stderr,
        )
        return 2
    try:
        rec = load_capture(args.file, args.stream)
    except (OSError, ValueError) as exc:
        print(f"firsttoken replay: {exc}", file=sys.stderr)
        return 2
    try:
        if args.serve:
            asyncio.run(serve(rec, args.speed, args.host, args.port, args.send_timestamps))
        else:
            play_stdout(rec, args.speed, args.format, sys.stdout.buffer)
    except CannotListen as exc:
        print(f"firsttoken replay: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
