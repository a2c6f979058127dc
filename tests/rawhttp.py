"""A raw-socket HTTP/1.1 client: exact bytes on the wire, and a way to just hang up."""

from __future__ import annotations

import json
import socket
import time


class RawStream:
    def __init__(
        self,
        port: int,
        method: str,
        path: str,
        body: object | None = None,
        headers: dict[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        payload = b"" if body is None else json.dumps(body).encode()
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        self._buf = b""
        head = self._read_until(b"\r\n\r\n")
        status_line, *header_lines = head.decode().split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self.chunked = self.headers.get("transfer-encoding") == "chunked"
        self.body = b""  # de-chunked body bytes read so far
        self.finished = False

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self._buf += data
        head, _, self._buf = self._buf.partition(marker)
        return head

    def read_chunk(self) -> bytes:
        """One HTTP chunk (one server write, as sent); b"" at the end."""
        size = int(self._read_until(b"\r\n"), 16)
        if size == 0:
            self.finished = True
            return b""
        while len(self._buf) < size + 2:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self._buf += data
        chunk, self._buf = self._buf[:size], self._buf[size + 2 :]
        self.body += chunk
        return chunk

    def read_until(self, marker: bytes, timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        while marker not in self.body:
            if time.monotonic() > deadline:
                raise TimeoutError(marker)
            if not self.read_chunk():
                break
        return self.body

    def read_all(self) -> bytes:
        while not self.finished:
            self.read_chunk()
        return self.body

    def read_body_plain(self) -> bytes:
        length = int(self.headers.get("content-length", "0"))
        while len(self._buf) < length:
            self._buf += self.sock.recv(65536)
        return self._buf[:length]

    def close(self) -> None:
        self.sock.close()
