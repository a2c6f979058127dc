"""Did something between the generator and this client hold the stream back?

Judged by what arrived, not by configuration: a proxy set to buffer may still pass slow, small
events on at once, and a "clean" config can still be defeated by a gzip filter. Reads are grouped
into bursts by whether data was already waiting when we asked for more (the read returned at
once) — robust to how long Python takes to parse a big read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from firsttoken.tools._measure import Event, StreamResult
from firsttoken.tools._stats import percentile

__all__ = ["Burst", "Verdict", "bursts", "judge"]

# A read that returns within this long after we finished the previous one found data waiting.
WAITING_EPS_S = 0.0005
MIN_EVENTS = 5
# Server timestamps: p90 extra delay (over the best-case delay) that counts as held back.
ADDED_DELAY_S = 0.025


@dataclass(slots=True)
class Burst:
    start_t: float
    end_t: float
    events: int
    bytes: int


@dataclass(slots=True)
class Verdict:
    buffered: bool | None
    label: str  # clean | buffered | inconclusive
    reason: str
    bursts: list[Burst] = field(default_factory=list)
    server_delay_ms: dict[str, Any] | None = None


def bursts(result: StreamResult, events: list[Event]) -> list[Burst]:
    """Group content events by the run of back-to-back reads they arrived in."""
    read_group: dict[float, int] = {}
    group = -1
    prev_done: float | None = None
    for r in result.reads:
        if prev_done is None or r.t - prev_done > WAITING_EPS_S:
            group += 1
        read_group.setdefault(r.t, group)
        prev_done = r.done_t
    out: list[Burst] = []
    last_group: int | None = None
    for ev in events:
        g = read_group.get(ev.t, -1 - len(out))
        if out and g == last_group:
            b = out[-1]
            b.end_t, b.events, b.bytes = ev.t, b.events + 1, b.bytes + ev.size
        else:
            out.append(Burst(ev.t, ev.t, 1, ev.size))
        last_group = g
    return out


def judge(result: StreamResult) -> Verdict:
    content = result.content
    n = len(content)
    if not result.is_stream:
        return Verdict(None, "inconclusive", "not an event stream: nothing to judge")
    if n < MIN_EVENTS:
        return Verdict(None, "inconclusive", f"only {n} content events: too few to judge")
    bs = bursts(result, content)
    stamped = [e for e in content if e.server_t is not None]
    if len(stamped) >= max(MIN_EVENTS, n // 2):
        return _judge_stamped(result, stamped, bs)
    return _judge_arrivals(result, content, bs)


def _judge_arrivals(result: StreamResult, content: list[Event], bs: list[Burst]) -> Verdict:
    n = len(content)
    largest = max(bs, key=lambda b: b.events)
    if largest is bs[-1] and largest.events >= 0.9 * n:
        return Verdict(True, "buffered", _all_at_end_reason(result, content), bs)
    shape = _bursty(bs, n)
    if shape is not None:
        return Verdict(True, "buffered", shape, bs)
    coalesced = sum(b.events for b in bs if b.events > 1)
    note = "" if not coalesced else f" ({coalesced} of {n} events shared a read: ordinary jitter)"
    return Verdict(False, "clean", "events arrived one by one as sent" + note, bs)


def _all_at_end_reason(result: StreamResult, content: list[Event]) -> str:
    wait_ms = (content[-1].t - result.sse_request_t) * 1000
    enc = result.headers.get("content-encoding", "")
    if enc and enc.lower() != "identity":
        return (
            f"nothing until the end: all {len(content)} events arrived at once after "
            f"{wait_ms:.0f} ms, and the body is compressed (Content-Encoding: {enc}); a gzip "
            "filter held it back: don't compress text/event-stream (nginx: leave it out of "
            "gzip_types, or honour X-Accel-Buffering: no)"
        )
    return (
        f"nothing until the end: all {len(content)} events arrived at once after {wait_ms:.0f} ms"
        ": compression or a buffering framework/proxy held the whole response "
        "(or the server really sends everything at once)"
    )


def _bursty(bs: list[Burst], n: int) -> str | None:
    """A reason when events came in consistent multi-event bursts, else None."""
    if len(bs) < 2:
        return None
    in_big = sum(b.events for b in bs if b.events >= 4)
    if in_big < 0.75 * n or n / len(bs) < 6:
        return None
    full = bs[:-1]  # the last burst is whatever was left when the stream ended
    sizes = [b.bytes for b in full]
    gaps = [b.start_t - a.end_t for a, b in itertools.pairwise(bs)]
    block = median(sizes) if sizes else 0.0
    size_kb = block / 1024
    every_ms = median(gaps) * 1000
    # A proxy buffer fills to one size; a slow reader may take two at once, so judge by how
    # many bursts sit near the typical size rather than by the spread.
    near = sum(1 for size in sizes if abs(size - block) <= 0.2 * block)
    regular = len(sizes) >= 2 and near >= 0.6 * len(sizes)
    if regular and block >= 2048:
        return (
            f"arrived in {len(bs)} bursts of ~{size_kb:.1f} KB (every ~{every_ms:.0f} ms): "
            "looks like proxy buffering (nginx proxy_buffering); set X-Accel-Buffering: no "
            "or proxy_buffering off"
        )
    if every_ms >= 30:
        return (
            f"arrived in {len(bs)} bursts of ~{n / len(bs):.0f} events (every ~{every_ms:.0f} "
            "ms): something batches the stream (a buffering proxy, or batching in the server)"
        )
    return None


def _judge_stamped(result: StreamResult, stamped: list[Event], bs: list[Burst]) -> Verdict:
    # Delay per event = receive time - send time; its minimum absorbs any clock offset, so the
    # excess over it is what the path added (queueing, buffering).
    delays = [result.started_at + e.t - (e.server_t or 0.0) for e in stamped]
    floor = min(delays)
    added = [d - floor for d in delays]
    stats = {
        "min": round(floor * 1000, 3),
        "p50": round((percentile(delays, 50) or 0) * 1000, 3),
        "p99": round((percentile(delays, 99) or 0) * 1000, 3),
        "max": round(max(delays) * 1000, 3),
        "added_p50": round((percentile(added, 50) or 0) * 1000, 3),
        "added_p90": round((percentile(added, 90) or 0) * 1000, 3),
        "added_max": round(max(added) * 1000, 3),
        "added_per_chunk": [round(a * 1000, 2) for a in added],
    }
    p90 = percentile(added, 90) or 0.0
    n = len(result.content)
    sent = [e.server_t or 0.0 for e in stamped]
    server_bursty = _bursty(_bursts_by_time(sent, stamped), len(stamped)) is not None
    arrival_shape = _bursty(bs, n)
    # Held back: events waited long, or arrived in bursts the server did not send them in.
    if p90 > ADDED_DELAY_S or (arrival_shape is not None and not server_bursty):
        shape = arrival_shape
        if shape is None and bs[-1].events >= 0.9 * n:
            shape = _all_at_end_reason(result, result.content)
        why = f"; {shape}" if shape else ""
        return Verdict(
            True,
            "buffered",
            f"events waited between server and client: added delay p90 {p90 * 1000:.0f} ms, "
            f"max {max(added) * 1000:.0f} ms (from the server's send timestamps){why}",
            bs,
            stats,
        )
    note = ": the server itself sends in bursts" if server_bursty else ""
    return Verdict(
        False,
        "clean",
        f"added delay p90 {p90 * 1000:.1f} ms over the server's send timestamps{note}",
        bs,
        stats,
    )


def _bursts_by_time(times: list[float], events: list[Event]) -> list[Burst]:
    out: list[Burst] = []
    for t, ev in zip(times, events, strict=True):
        if out and t - out[-1].end_t <= 0.001:
            b = out[-1]
            b.end_t, b.events, b.bytes = t, b.events + 1, b.bytes + ev.size
        else:
            out.append(Burst(t, t, 1, ev.size))
    return out
