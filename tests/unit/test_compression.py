from __future__ import annotations

import zlib

import pytest
import zstandard

from firsttoken.wire.compression import StreamCompressor, negotiate


@pytest.mark.parametrize(
    ("header", "chosen"),
    [
        ("zstd, gzip", "zstd"),
        ("gzip, deflate, br", "gzip"),
        ("zstd;q=0, gzip;q=0.5", "gzip"),
        ("gzip;q=0", None),
        ("identity", None),
        ("*", "zstd"),
        ("*;q=0, gzip", "gzip"),
        ("", None),
        ("gzip;q=abc", None),
    ],
)
def test_negotiation_honours_q_values(header: str, chosen: str | None) -> None:
    assert negotiate(header) == chosen


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_every_write_decodes_at_once(encoding: str) -> None:
    compressor = StreamCompressor(encoding)
    if encoding == "gzip":
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        decode = d.decompress
    else:
        decode = zstandard.ZstdDecompressor().decompressobj().decompress
    for i in range(5):
        event = b'id: %d\ndata: {"token":"x"}\n\n' % i
        assert decode(compressor.compress(event)) == event  # flushed: nothing held back
