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


def _chat_events(count: int) -> list[bytes]:
    return [
        b'id: %d\ndata: {"id":"chatcmpl-3f2a9c","object":"chat.completion.chunk","created":1,'
        b'"model":"synthetic","choices":[{"index":0,"delta":{"content":" w%d"},'
        b'"logprobs":null,"finish_reason":null}]}\n\n' % (i, i % 97)
        for i in range(count)
    ]


def test_a_zstd_reader_keeps_no_more_than_a_gzip_one_roughly() -> None:
    """Every live reader keeps its own compressor: zstd's level 3 as it comes allocates
    ~3.5 MiB for a 2 MiB window; ours has gzip's window and stays within ~1.5x of gzip."""
    events = _chat_events(3000)  # long enough for every table to be in use
    ours, gzip = StreamCompressor("zstd"), StreamCompressor("gzip")
    decode = zstandard.ZstdDecompressor().decompressobj().decompress
    sent = b"".join(decode(ours.compress(e)) for e in events)
    assert sent == b"".join(events)
    assert ours.memory_bytes() < 1.5 * gzip.memory_bytes() < 400 * 1024
    stock = zstandard.ZstdCompressor(level=3)
    whole = stock.compressobj()
    for e in events:
        whole.compress(e)
        whole.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    assert stock.memory_size() > 8 * ours.memory_bytes()  # what the cap saves per reader
