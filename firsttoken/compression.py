"""Compression that keeps streaming: every write is compressed and flushed at once.

A compression middleware that buffers (Starlette's GZip holds ~32 KiB) is what turns a stream
into one late blob; here each event leaves as its own complete compressed block, while the
compressor keeps its window across events (so repeated JSON keys compress well).
"""

from __future__ import annotations

import zlib

import zstandard

__all__ = ["StreamCompressor", "negotiate"]

ZSTD_LEVEL = 3
GZIP_LEVEL = 6


def negotiate(accept_encoding: str) -> str | None:
    """zstd preferred, gzip as fallback, honouring q=0; None: send identity."""
    offered: dict[str, float] = {}
    for part in accept_encoding.lower().split(","):
        name, _, params = part.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if name:
            offered[name] = q
    for name in ("zstd", "gzip"):
        if offered.get(name, offered.get("*", 0.0)) > 0:
            return name
    return None


class StreamCompressor:
    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        if encoding == "zstd":
            self._zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj()
        elif encoding == "gzip":
            self._gzip = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        else:
            raise ValueError(f"unsupported encoding {encoding!r}")

    def compress(self, data: bytes) -> bytes:
        """Compressed bytes for `data`, flushed so the peer can decode all of it now."""
        if self.encoding == "zstd":
            return self._zstd.compress(data) + self._zstd.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        return self._gzip.compress(data) + self._gzip.flush(zlib.Z_SYNC_FLUSH)

    def finish(self) -> bytes:
        if self.encoding == "zstd":
            return self._zstd.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH)
        return self._gzip.flush(zlib.Z_FINISH)
