"""The capture file: JSON lines, one record per event/comment with its receive time.

Records (all carry `type`; per-stream ones carry `stream`, `t` = seconds since that stream's
request started):
  {"type": "capture", "version": 1, "url", "kind", "started_at"}           first line
  {"type": "response", "stream", "t", "status", "headers", "sse_request_t"}
  {"type": "event", "stream", "t", "data", "event", "id", "server_t"}
  {"type": "comment", "stream", "t", "text"}
  {"type": "end", "stream", "t", "done", "error"}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from firsttoken.tools._measure import StreamResult

__all__ = ["CaptureWriter", "Recorded", "load_capture"]

VERSION = 1


class CaptureWriter:
    def __init__(self, path: str | Path, url: str, kind: str, started_at: float) -> None:
        self._fh: IO[str] = open(path, "w", encoding="utf-8")
        self._write(
            {
                "type": "capture",
                "version": VERSION,
                "url": url,
                "kind": kind,
                "started_at": started_at,
            }
        )

    def _write(self, rec: dict[str, Any]) -> None:
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")

    def stream(self, index: int, result: StreamResult) -> None:
        self._write(
            {
                "type": "response",
                "stream": index,
                "t": result.headers_t,
                "status": result.status,
                "headers": result.headers,
                "sse_request_t": result.sse_request_t,
                "started_at": result.started_at,
            }
        )
        records: list[tuple[int, dict[str, Any]]] = []
        for ev in result.events:
            records.append(
                (
                    ev.seq,
                    {
                        "type": "event",
                        "stream": index,
                        "t": round(ev.t, 6),
                        "data": ev.data,
                        "event": ev.event,
                        "id": ev.id,
                        "server_t": ev.server_t,
                    },
                )
            )
        for c in result.comments:
            records.append(
                (c.seq, {"type": "comment", "stream": index, "t": round(c.t, 6), "text": c.text})
            )
        for _, rec in sorted(records, key=lambda r: r[0]):  # wire order
            self._write(rec)
        self._write(
            {
                "type": "end",
                "stream": index,
                "t": round(result.end_t, 6),
                "done": result.done,
                "error": result.error,
            }
        )
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


@dataclass
class Recorded:
    """One stream of a capture, ready to replay."""

    url: str
    status: int | None
    headers: dict[str, str]
    sse_request_t: float
    records: list[dict[str, Any]] = field(default_factory=list)  # events and comments, by t
    end_t: float | None = None

    @property
    def events(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == "event"]


def load_capture(path: str | Path, stream: int = 0) -> Recorded:
    url = ""
    rec = Recorded(url="", status=None, headers={}, sse_request_t=0.0)
    found = False
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
            typ = obj.get("type")
            if typ == "capture":
                url = str(obj.get("url", ""))
                continue
            if obj.get("stream", 0) != stream:
                continue
            found = True
            if typ == "response":
                rec.status = obj.get("status")
                rec.headers = dict(obj.get("headers") or {})
                rec.sse_request_t = float(obj.get("sse_request_t") or 0.0)
            elif typ in ("event", "comment"):
                rec.records.append(obj)
            elif typ == "end":
                rec.end_t = float(obj["t"])
    if not found:
        raise ValueError(f"{path}: no stream {stream} in this capture")
    rec.url = url
    rec.records.sort(key=lambda r: float(r["t"]))  # stable: keeps wire order within a read
    return rec
