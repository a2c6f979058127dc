"""After a run: turn each stream's timed reads into content events, and check them.

Independent of firsttoken's own parser on purpose (a bug there must not hide a bug here).
Handles HTTP/1.1 chunked or close-delimited bodies, and SSE with LF, CRLF or CR line ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from bench.load import Capture

__all__ = ["Decoded", "decode"]


@dataclass(slots=True)
class Decoded:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    contents: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # arrival time of each content event
    done: bool = False
    finish_reason: str | None = None
    heartbeats: int = 0
    problem: str | None = None  # protocol error, error event, or text mismatch

    def received_tokens(self, expected: tuple[str, ...]) -> int:
        """Whole expected tokens delivered (robust to a server that coalesces tokens)."""
        text = "".join(self.contents)
        n = pos = 0
        for token in expected:
            if not text.startswith(token, pos):
                break
            pos += len(token)
            n += 1
        return n


class _Dechunker:
    __slots__ = ("_buf", "_left", "finished")

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # bytes of chunk data still to pass through; -1: want the CRLF after it
        self.finished = False

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data
        out: list[bytes] = []
        i = 0
        while i < len(buf) and not self.finished:
            if self._left > 0:
                take = buf[i : i + self._left]
                out.append(take)
                self._left -= len(take)
                i += len(take)
                if self._left == 0:
                    self._left = -1
                continue
            eol = buf.find(b"\r\n", i)
            if eol < 0:
                break
            line = buf[i:eol]
            i = eol + 2
            if self._left == -1:
                self._left = 0  # the CRLF that closes a chunk's data
                continue
            size = int(line.split(b";", 1)[0], 16)
            if size == 0:
                self.finished = True
            self._left = size
        self._buf = buf[i:]
        return b"".join(out)


class _Events:
    """SSE block splitter: feed body bytes, get complete event blocks as lists of lines."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[list[bytes]]:
        buf = self._buf + data
        hold = b""
        if buf.endswith(b"\r"):  # may be half of a CRLF
            buf, hold = buf[:-1], b"\r"
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        blocks = buf.split(b"\n\n")
        self._buf = blocks.pop() + hold
        return [b.split(b"\n") for b in blocks]


def decode(cap: Capture) -> Decoded:
    out = Decoded()
    head = b""
    body: list[tuple[float, bytes]] = []
    for i, (t, data) in enumerate(cap.reads):
        head += data
        end = head.find(b"\r\n\r\n")
        if end >= 0:
            body = [(t, head[end + 4 :]), *cap.reads[i + 1 :]]
            head = head[:end]
            break
    if not body:
        out.problem = cap.error or ("no response" if not cap.reads else "incomplete HTTP head")
        return out
    lines = head.split(b"\r\n")
    try:
        out.status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        out.problem = f"bad status line {lines[0][:80]!r}"
        return out
    for ln in lines[1:]:
        name, _, value = ln.partition(b":")
        out.headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    if out.status != 200:
        out.problem = f"HTTP {out.status}"
        return out
    chunked = "chunked" in out.headers.get("transfer-encoding", "")
    dechunk = _Dechunker() if chunked else None
    events = _Events()
    try:
        for t, data in body:
            raw = dechunk.feed(data) if dechunk is not None else data
            for block in events.feed(raw):
                _event(out, t, block)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        out.problem = out.problem or f"undecodable stream: {exc!r}"
    if cap.error and not out.problem and not out.done:
        out.problem = cap.error
    return out


def _event(out: Decoded, t: float, block: list[bytes]) -> None:
    data: list[bytes] = []
    name = b""
    for line in block:
        if line.startswith(b":"):
            if b"ping" in line:
                out.heartbeats += 1
            continue
        field_name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field_name == b"data":
            data.append(value)
        elif field_name == b"event":
            name = value
    if not data:
        return
    payload = b"\n".join(data)
    if name == b"error":
        out.problem = out.problem or f"error event: {payload[:200].decode(errors='replace')}"
        return
    if payload == b"[DONE]":
        out.done = True
        return
    chunk = orjson.loads(payload)
    if "error" in chunk:
        out.problem = out.problem or f"error chunk: {payload[:200].decode(errors='replace')}"
        return
    # A usage chunk has no choices; proxies (LiteLLM) send those too.
    for choice in chunk.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if content:
            out.contents.append(content)
            out.times.append(t)
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]
