# ruff: noqa: ASYNC109  (the httpcore network-backend interface takes `timeout` arguments)
"""`diag --packet-loss`: the client socket's TCP view of a stream, read with TCP_INFO.

The client's connection is watched through an httpcore network backend: every read off the
socket takes a TCP_INFO sample (Linux `struct tcp_info`), so each inter-chunk gap can be put
beside what TCP did during it.

A stream's data flows to the client, so most repairs are the server's; the client sees them as
segments that arrive behind a hole (`tcpi_rcv_ooopack`) or twice (`tcpi_dsack_dups`). With its
own retransmissions (`tcpi_total_retrans`: the request, a SYN) they make `retransmits`. `lost`
counts loss episodes: reads during which any of those moved. The gaps are those between the
reads that carried a response's content, from the read with its first content event to the one
with its last (the measuring code marks them: `content_marker`); the wait for the first token
and the time between requests on a kept-alive connection are not inter-chunk gaps. A gap whose
closing read saw a repair is a *retransmission gap*; the share of the inter-chunk p99 they
explain is the p99 minus the p99 without them, over the p99.

The tail is named as theirs when removing those gaps lowers the p99 by a fifth or more, or
when they make up a third or more of the gaps at or above it (they are a few percent of all).

On a platform without TCP_INFO (not Linux) the view is empty: `tcp` is null.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx

from firsttoken.tools._stats import percentile

__all__ = ["TcpInfo", "TcpWatch", "content_marker", "read_tcp_info", "watched_transport"]

# Offsets in Linux's struct tcp_info (include/uapi/linux/tcp.h), stable since they were added.
_U32 = struct.Struct("=I")
_OFFSETS = {
    "lost": 32,  # tcpi_lost: our segments presumed lost now
    "rtt_us": 68,  # tcpi_rtt
    "rttvar_us": 72,  # tcpi_rttvar
    "rcv_rtt_us": 92,  # tcpi_rcv_rtt: the receiver's own RTT estimate
    "total_retrans": 100,  # tcpi_total_retrans: segments we re-sent (4.x+)
    "dsack_dups": 216,  # tcpi_dsack_dups: duplicate segments received (5.1+)
    "rcv_ooopack": 224,  # tcpi_rcv_ooopack: segments received out of order (5.4+)
}
_SIZE = 232


@dataclass(frozen=True, slots=True)
class TcpInfo:
    lost: int = 0
    rtt_us: int = 0
    rttvar_us: int = 0
    rcv_rtt_us: int = 0
    total_retrans: int = 0
    dsack_dups: int = 0
    rcv_ooopack: int = 0

    def repairs(self) -> int:
        """Every retransmission this socket can see: its own, and the peer's it received."""
        return self.total_retrans + self.dsack_dups + self.rcv_ooopack


def read_tcp_info(sock: socket.socket) -> TcpInfo | None:
    """TCP_INFO of a connected socket; None where the platform has no such option."""
    opt = getattr(socket, "TCP_INFO", None)
    if opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, opt, _SIZE)
    except OSError:
        return None
    values = {
        name: _U32.unpack_from(raw, off)[0] if off + 4 <= len(raw) else 0
        for name, off in _OFFSETS.items()
    }
    return TcpInfo(**values)


@dataclass(slots=True)
class _Connection:
    samples: list[tuple[float, int, TcpInfo]] = field(default_factory=list)  # (t, bytes, info)
    start: TcpInfo | None = None
    # Per response on this connection: the indexes in `samples` of the reads that delivered
    # its first and its last content event (so far).
    content: list[list[int]] = field(default_factory=list)

    def note_content(self, first: bool) -> None:
        """The latest read delivered content: the response's first, or a further one."""
        last = len(self.samples) - 1
        if last < 0:
            return
        if first or not self.content:
            self.content.append([last, last])
        else:
            self.content[-1][1] = last


_MARKER = "firsttoken.note_content"


def content_marker(network_stream: Any) -> Callable[[bool], None] | None:
    """What the measuring code calls when a read delivered content (True: the response's
    first), for the stream httpx reports in `response.extensions["network_stream"]`; None
    when that stream is not watched."""
    get = getattr(network_stream, "get_extra_info", None)
    marker = get(_MARKER) if get is not None else None
    return marker if callable(marker) else None


class TcpWatch:
    """The connections a client made while watched, with a sample per read."""

    def __init__(self) -> None:
        self.connections: list[_Connection] = []

    def summary(self) -> dict[str, Any] | None:
        """The `tcp` object of `diag --json`: counts over the streams, RTT, and how much of
        the inter-chunk tail the retransmissions explain."""
        watched = [c for c in self.connections if c.start is not None and c.samples]
        if not watched:
            return None
        sent = dups = ooo = episodes = 0
        gaps: list[tuple[float, bool]] = []
        last = watched[-1].samples[-1][2]
        for conn in watched:
            assert conn.start is not None
            end = conn.samples[-1][2]
            sent += end.total_retrans - conn.start.total_retrans
            dups += end.dsack_dups - conn.start.dsack_dups
            ooo += end.rcv_ooopack - conn.start.rcv_ooopack
            moved: list[bool] = []
            previous = conn.start
            for _, _, info in conn.samples:
                moved.append(info.repairs() > previous.repairs())
                previous = info
            episodes += sum(moved)
            for first, final in conn.content:
                prev_t: float | None = None
                for i in range(first, final + 1):
                    t, size, _ = conn.samples[i]
                    if size and prev_t is not None:
                        gaps.append((t - prev_t, moved[i]))
                    if size:
                        prev_t = t
        out: dict[str, Any] = {
            "retransmits": sent + dups + ooo,
            "lost": episodes,
            "rtt_ms": round(last.rtt_us / 1000, 3),
            "rtt_var_ms": round(last.rttvar_us / 1000, 3),
            "sent_retransmits": sent,
            "received_out_of_order": ooo,
            "received_duplicates": dups,
            "connections": len(watched),
        }
        out.update(_tail(gaps))
        return out


def _tail(gaps: list[tuple[float, bool]]) -> dict[str, Any]:
    all_ms = [g * 1000 for g, _ in gaps]
    clean_ms = [g * 1000 for g, moved in gaps if not moved]
    flagged = len(all_ms) - len(clean_ms)
    p99 = percentile(all_ms, 99) if all_ms else None
    p99_clean = percentile(clean_ms, 99) if clean_ms else None
    explained: float | None = None
    if p99 is not None and p99 > 0 and p99_clean is not None:
        explained = round(max(0.0, p99 - p99_clean) / p99, 3)
    tail = [moved for g, moved in gaps if p99 is not None and g * 1000 >= p99]
    # Named as the cause when removing them moves the p99 by a fifth, or when they fill a
    # third of the tail (they are a few percent of all gaps: that is no coincidence).
    enriched = bool(tail) and sum(tail) * 3 >= len(tail)
    if not gaps:
        cause = None
    elif flagged and ((explained or 0) >= 0.2 or enriched):
        cause = "retransmissions"
    else:
        cause = "not retransmissions"
    return {
        "gaps": len(gaps),
        "retransmit_gaps": flagged,
        "itl_p99_ms": None if p99 is None else round(p99, 3),
        "itl_p99_without_retransmit_gaps_ms": None if p99_clean is None else round(p99_clean, 3),
        "tail_explained": explained,
        "tail_gaps": len(tail),
        "tail_gaps_with_retransmits": sum(tail),
        "tail_cause": cause,
    }


def describe(tcp: dict[str, Any] | None) -> str:
    """One line for the terminal."""
    if tcp is None:
        return "tcp: no TCP_INFO on this platform"
    line = (
        f"tcp: {tcp['retransmits']} retransmits ({tcp['received_out_of_order']} out of order, "
        f"{tcp['received_duplicates']} duplicate, {tcp['sent_retransmits']} sent), "
        f"{tcp['lost']} loss episodes, rtt {tcp['rtt_ms']} ms ± {tcp['rtt_var_ms']}"
    )
    if tcp["tail_explained"] is not None:
        line += (
            f"; inter-chunk p99 {tcp['itl_p99_ms']} ms, {tcp['itl_p99_without_retransmit_gaps_ms']}"
            f" ms without the {tcp['retransmit_gaps']} retransmission gaps: retransmissions "
            f"explain {round(tcp['tail_explained'] * 100)}% of the tail ({tcp['tail_cause']})"
        )
    return line


# -- the watching network backend ------------------------------------------------------------


class _WatchedStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream, conn: _Connection) -> None:
        self._inner = inner
        self._conn = conn
        self._sock: socket.socket | None = inner.get_extra_info("socket")
        if self._sock is not None and conn.start is None:
            conn.start = read_tcp_info(self._sock)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = await self._inner.read(max_bytes, timeout)
        if self._sock is not None and self._conn.start is not None:
            info = read_tcp_info(self._sock)
            if info is not None:
                self._conn.samples.append((time.perf_counter(), len(data), info))
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        inner = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        return _WatchedStream(inner, self._conn)

    def get_extra_info(self, info: str) -> Any:
        if info == _MARKER:
            return self._conn.note_content
        return self._inner.get_extra_info(info)


class _WatchedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, watch: TcpWatch) -> None:
        self._inner = httpcore.AnyIOBackend()
        self._watch = watch

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        inner = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        conn = _Connection()
        self._watch.connections.append(conn)
        return _WatchedStream(inner, conn)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def watched_transport(
    watch: TcpWatch,
    limits: httpx.Limits,
    verify: bool = True,
    http1: bool = True,
    http2: bool = False,
) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose connections report to `watch`; the versions as in
    `_load.HttpVersions`."""
    transport = httpx.AsyncHTTPTransport(limits=limits, verify=verify, http1=http1, http2=http2)
    # httpx builds its httpcore pool without a backend argument; the pool reads this one
    # field for every new connection.
    transport._pool._network_backend = _WatchedBackend(watch)  # type: ignore[attr-defined]
    return transport
