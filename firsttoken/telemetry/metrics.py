"""Metrics. Stages call into this module; it calls only the log (`telemetry/log.py`).

Per-token metrics are plain integer arithmetic (no locks, no label lookups): the event loop is
single-threaded, and prometheus-client's own Histogram walks its buckets linearly under a lock.
The exposition format still comes from prometheus-client, at scrape time.

Under `--workers N` each worker shares what its registry collects through a directory
(`share_across_workers`, `WorkerShare`) and the worker a scrape lands on merges every worker's:
one scrape is the whole server. That is a snapshot of the same ints taken at scrape time (and
once a second), never work per token.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from firsttoken.telemetry.log import add_log_field

__all__ = [
    "KEY_TOKEN_KINDS",
    "OUTCOMES",
    "Histogram",
    "Metrics",
    "WorkerShare",
    "fold_worker",
    "key_label",
    "share_across_workers",
]

OUTCOMES = ("completed", "cancelled", "disconnected", "error", "rejected")
KEY_TOKEN_KINDS = ("prompt", "completion", "reasoning", "cached", "cache_write")
MAX_ROUTE_LABELS = 64
OTHER_ROUTE = "other"
OPEN_KEY = "open"  # the caller of a server without a keys file, in metrics and logs


def key_label(name: str) -> str:
    """A key's name as metrics and `stream.*` log lines show it (`open` without a keys file):
    names come from the keys file only, so the label set stays bounded."""
    return name or OPEN_KEY


def _steps(start: float, stop: float, step: float) -> list[float]:
    n = round((stop - start) / step)
    return [round(start + step * i, 6) for i in range(1, n + 1)]


# Fine where people notice (a p50/p99 read off these is within 5%), coarse beyond.
TTFT_BUCKETS = (
    _steps(0.0, 0.1, 0.002)
    + _steps(0.1, 0.5, 0.005)
    + [0.6, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0]
)
INTER_CHUNK_BUCKETS = (
    _steps(0.0, 0.01, 0.0005)
    + _steps(0.01, 0.03, 0.001)
    + _steps(0.03, 0.1, 0.002)
    + [0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 15.0, 60.0]
)

# How late the event loop runs what it scheduled: 1 ms is uvloop's timer resolution.
LOOP_LAG_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5]
LOOP_LAG_SAMPLE_S = 0.05  # how often the registry's schedule samples it


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """(upper bound, count at or below it) as Prometheus exposes buckets."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            out.append((repr(bound), total))
        total += self.counts[-1]
        out.append(("+Inf", total))
        return out

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        return HistogramMetricFamily(name, doc, buckets=self.cumulative(), sum_value=self.sum)


class Metrics:
    """The server's counters and histograms, exported under the INTERFACE.md names."""

    def __init__(
        self,
        tokens_generated: Callable[[], int] = lambda: 0,
        engine_counter: Callable[[str], int] = lambda name: 0,
    ) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.inter_chunk = Histogram(INTER_CHUNK_BUCKETS)
        self.loop_lag = Histogram(LOOP_LAG_BUCKETS)
        self.tokens_sent = 0
        self.active_streams = 0
        self.streams = dict.fromkeys(OUTCOMES, 0)
        self.shedding = dict.fromkeys(("ttft", "memory"), 0)  # the breaker has its own state
        self.breaker_state = "closed"
        self.memory_rss_bytes = 0
        self.readers_paused = 0  # writers whose socket is full (the transport paused them)
        self.readers_stalled = 0  # readers cut off for taking no bytes for --send-timeout-s
        # Redis mode: streams of gone instances continued here, or not (and why).
        self.takeovers = dict.fromkeys(("continued", "lost", "refused"), 0)
        self.streams_moved = 0  # streams this instance let another continue
        # Tokens by (key name, kind): bounded, since names come from the keys file only.
        self.key_tokens: dict[tuple[str, str], int] = {}
        # Streams by route (the model asked for) and key: started, and running now.
        self.route_streams: dict[str, int] = {}
        self.route_active: dict[str, int] = {}
        self.key_active: dict[str, int] = {}
        self.tokens_generated = tokens_generated
        self.engine_counter = engine_counter  # e.g. "failovers" of the relay, "cache_hits"
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.share = WorkerShare(*_share_as, self.registry) if _share_as is not None else None

    def collect(self) -> Iterator[Metric]:
        yield from self._timings()
        yield from self._tokens()
        yield from self._streams()
        yield from self._readers()
        yield from self._shares()

    def _timings(self) -> Iterator[Metric]:
        yield self.ttft.family("firsttoken_ttft_seconds", "Request accepted to first token sent.")
        yield self.inter_chunk.family(
            "firsttoken_inter_chunk_seconds", "Gap between consecutive content events sent."
        )
        yield self.loop_lag.family(
            "firsttoken_loop_lag_seconds",
            "How late the event loop ran work scheduled for a given time (sampled every "
            f"{LOOP_LAG_SAMPLE_S * 1000:g} ms): requests wait about as long to be read.",
        )

    def _tokens(self) -> Iterator[Metric]:
        yield _one(
            CounterMetricFamily,
            "firsttoken_tokens_generated",
            "Tokens the engine produced.",
            self.tokens_generated(),
        )
        yield _one(
            CounterMetricFamily,
            "firsttoken_tokens_sent",
            "Tokens written to clients.",
            self.tokens_sent,
        )
        for attr, name, doc in (
            ("failovers", "firsttoken_relay_failovers", "Streams moved to another upstream."),
            ("cache_hits", "firsttoken_cache_hits", "Answers served from the prompt cache."),
            ("canned_hits", "firsttoken_canned_answers", "Greetings served canned answers."),
        ):
            yield _one(CounterMetricFamily, name, doc, self.engine_counter(attr))

    def _streams(self) -> Iterator[Metric]:
        """Streams by outcome, and the state that decides whether new ones are taken."""
        yield _labelled(
            CounterMetricFamily,
            "firsttoken_streams",
            "Streams by outcome.",
            "outcome",
            self.streams,
        )
        yield _one(
            GaugeMetricFamily,
            "firsttoken_active_streams",
            "Streams generating now.",
            self.active_streams,
        )
        shedding = {**self.shedding, "breaker": int(self.breaker_state != "closed")}
        yield _labelled(
            GaugeMetricFamily,
            "firsttoken_shedding",
            "1 while new streams are refused, by trigger.",
            "reason",
            shedding,
        )
        states = {s: int(s == self.breaker_state) for s in ("closed", "open", "half_open")}
        yield _labelled(
            GaugeMetricFamily,
            "firsttoken_breaker_state",
            "Circuit breaker: 1 for the current state.",
            "state",
            states,
        )
        yield _one(
            GaugeMetricFamily,
            "firsttoken_memory_rss_bytes",
            "Resident memory of the process.",
            self.memory_rss_bytes,
        )

    def _readers(self) -> Iterator[Metric]:
        """Readers held back or cut off, and streams that moved between instances."""
        yield _one(
            GaugeMetricFamily,
            "firsttoken_readers_paused",
            "Readers whose socket takes no more bytes now (their writer waits).",
            self.readers_paused,
        )
        yield _one(
            CounterMetricFamily,
            "firsttoken_readers_stalled",
            "Readers cut off for taking no bytes for --send-timeout-s.",
            self.readers_stalled,
        )
        yield _labelled(
            CounterMetricFamily,
            "firsttoken_takeovers",
            "Streams of gone instances read here: continued here, lost (a reader had seen "
            "more than the store held), refused (not to be taken over).",
            "outcome",
            self.takeovers,
        )
        yield _one(
            CounterMetricFamily,
            "firsttoken_streams_moved",
            "Streams this instance stopped generating for another to continue (a hand-over "
            "at shutdown, or a takeover of a stream it still generated).",
            self.streams_moved,
        )

    def _shares(self) -> Iterator[Metric]:
        """Per API key and per route: tokens billed, streams started and running."""
        per_key = CounterMetricFamily(
            "firsttoken_key_tokens",
            "Tokens billed to each API key, by kind (completion includes reasoning; cached and "
            "cache_write are the parts of prompt an upstream read from and wrote to its cache).",
            labels=["key", "kind"],
        )
        for (key, kind), tokens in self.key_tokens.items():
            per_key.add_metric([key, kind], tokens)
        yield per_key
        yield _labelled(
            CounterMetricFamily,
            "firsttoken_route_streams",
            f"Streams started, by route (the model asked for; past {MAX_ROUTE_LABELS} names: "
            f"{OTHER_ROUTE!r}).",
            "route",
            self.route_streams,
        )
        yield _labelled(
            GaugeMetricFamily,
            "firsttoken_route_active_streams",
            "Streams generating now, by route.",
            "route",
            self.route_active,
        )
        yield _labelled(
            GaugeMetricFamily,
            "firsttoken_key_active_streams",
            "Streams generating now, by API key.",
            "key",
            self.key_active,
        )

    def stream_started(self, route: str, key: str) -> None:
        """A stream began generating: its route's and key's counts (a few dict updates)."""
        if route not in self.route_streams and len(self.route_streams) >= MAX_ROUTE_LABELS:
            route = OTHER_ROUTE  # without a routes file the model name is the client's word
        self.route_streams[route] = self.route_streams.get(route, 0) + 1
        self.route_active[route] = self.route_active.get(route, 0) + 1
        self.key_active[key] = self.key_active.get(key, 0) + 1

    def stream_ended(self, route: str, key: str) -> None:
        if route not in self.route_active:
            route = OTHER_ROUTE
        self.route_active[route] = self.route_active.get(route, 0) - 1
        self.key_active[key] = self.key_active.get(key, 0) - 1

    def count_key_tokens(self, key: str, usage: Sequence[int]) -> None:
        """An ended answer's usage (`pricing.Usage`: prompt, completion, reasoning, cached,
        cache_write), added to its key's counters. Spelled out, not a loop over the kinds:
        it runs once a stream, and most kinds are 0 for most answers."""
        counts = self.key_tokens
        if (key, "cache_write") not in counts:  # its first: every series exists from now on
            for kind in KEY_TOKEN_KINDS:
                counts.setdefault((key, kind), 0)
        prompt, completion, reasoning, cached, cache_write = usage
        if prompt:
            counts[key, "prompt"] += prompt
        if completion:
            counts[key, "completion"] += completion
        if reasoning:
            counts[key, "reasoning"] += reasoning
        if cached:
            counts[key, "cached"] += cached
        if cache_write:
            counts[key, "cache_write"] += cache_write

    def render(self) -> bytes:
        if self.share is not None:
            return self.share.render()
        return generate_latest(self.registry)


def _one(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, doc: str, value: float
) -> Metric:
    family = kind(name, doc)
    family.add_metric([], value)
    return family


def _labelled(
    kind: type[Metric], name: str, doc: str, label: str, values: dict[str, int]
) -> Metric:
    family = kind(name, doc, labels=[label])  # type: ignore[call-arg]
    for key, value in values.items():
        family.add_metric([key], value)  # type: ignore[attr-defined]
    return family


_share_as: tuple[Path, str] | None = None

SHARE_INTERVAL_S = 1.0
ASK_TIMEOUT_S = 0.25
RETIRED = "retired.json"
CUMULATIVE = ("counter", "histogram", "summary")  # summed over every worker that ever ran

# A family as JSON: [name, type, help, [[sample name, labels, value], ...]].
Family = list[Any]


def share_across_workers(directory: Path, name: str) -> None:
    """In a worker process, before the app is built: the Metrics made afterwards share
    `directory` under `name`, and every log line carries this worker's pid."""
    global _share_as
    _share_as = (directory, name)
    add_log_field("pid", os.getpid())


class WorkerShare:
    """One worker's side of the shared metrics directory.

    Each worker answers snapshot requests on DIR/NAME.sock from a thread of its own (a busy event
    loop doesn't hold up a scrape) and keeps its latest snapshot in DIR/NAME.json, written once
    a second and before every answer: whatever a scrape ever saw of a worker outlives it, so a
    merged counter never goes back (Prometheus would read that as a reset). When a worker dies
    the supervisor folds its counters into DIR/retired.json (`fold_worker`). The worker a scrape
    lands on merges itself, the live siblings (asked now), the dead ones not yet folded (their
    file, counters only) and the retired total. Counters and histograms add up over every worker
    that ever ran, gauges over the live ones (`firsttoken_shedding` and
    `firsttoken_breaker_state` then count workers). Every collector on the registry is shared.
    """

    def __init__(self, directory: Path, name: str, registry: CollectorRegistry) -> None:
        self.directory = directory
        self.name = name
        self.registry = registry
        self.snapshot()  # siblings find a worker by its file
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = directory / f"{name}.sock"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._listener.bind(str(path))
        self._listener.listen(16)
        self._listener.settimeout(SHARE_INTERVAL_S)
        threading.Thread(target=self._serve, name="metrics-share", daemon=True).start()

    def snapshot(self) -> list[Family]:
        """This worker's families, saved before anyone sees them."""
        families = [
            [f.name, f.type, f.documentation, [[s.name, s.labels, s.value] for s in f.samples]]
            for f in self.registry.collect()
        ]
        with contextlib.suppress(OSError):  # the directory went away: still answer
            _write_json(self.directory / f"{self.name}.json", families)
        return families

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                self.snapshot()
                continue
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.sendall(orjson.dumps(self.snapshot()))

    def merged(self) -> list[Family]:
        parts: list[tuple[list[Family], bool]] = [(self.snapshot(), True)]
        # Worker files before retired.json: a worker folded in between is then in both, and
        # retired's "folded" list drops it from the first (read the other way round, it would
        # be in neither).
        names: list[str] = []
        for path in sorted(self.directory.glob("w*.json")):
            if path.stem == self.name:
                continue
            families, alive = _ask(self.directory / f"{path.stem}.sock")
            if families is None:
                families = _read_json(path)
            if families is not None:
                names.append(path.stem)
                parts.append((families, alive))
        retired = _read_json(self.directory / RETIRED) or {"families": [], "folded": []}
        folded = set(retired["folded"])
        parts = [parts[0], *(p for n, p in zip(names, parts[1:], strict=True) if n not in folded)]
        parts.append((retired["families"], False))
        return merge_families(parts)

    def render(self) -> bytes:
        return generate_latest(_Fixed(self.merged()))

    def close(self) -> None:
        """Stop answering (siblings then read this worker as dead)."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept
        self._listener.close()


class _Fixed:
    def __init__(self, families: list[Family]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for name, kind, doc, samples in self.families:
            family = Metric(name, doc, kind)
            for sample_name, labels, value in samples:
                family.add_sample(sample_name, labels, value)
            yield family


def merge_families(parts: Iterable[tuple[list[Family], bool]]) -> list[Family]:
    """Add up families sample by sample, in first-seen order; (families, alive) pairs: a dead
    worker's gauges don't count. `_created` samples keep the first value."""
    merged: dict[str, Family] = {}
    index: dict[tuple[str, str, tuple[tuple[str, str], ...]], list[Any]] = {}
    for families, alive in parts:
        for name, kind, doc, samples in families:
            if not alive and kind not in CUMULATIVE:
                continue
            family = merged.setdefault(name, [name, kind, doc, []])
            for sample_name, labels, value in samples:
                key = (name, sample_name, tuple(sorted(labels.items())))
                sample = index.get(key)
                if sample is None:
                    index[key] = sample = [sample_name, labels, value]
                    family[3].append(sample)
                elif sample_name.endswith("_timestamp_seconds"):
                    sample[2] = min(sample[2], value)  # the stalest worker's, not a sum
                elif kind in (*CUMULATIVE, "gauge") and not sample_name.endswith("_created"):
                    sample[2] += value
    return list(merged.values())


def fold_worker(directory: Path, name: str, *, restarted: bool) -> None:
    """Supervisor side: a dead worker's counters join retired.json and its files go. Called
    once with no worker (`name=""`) to start the restart counter at 0."""
    retired = _read_json(directory / RETIRED) or {"families": [], "folded": []}
    parts = [(retired["families"], False)]
    last = _read_json(directory / f"{name}.json") if name else None
    if last is not None:
        parts.append((last, False))
    restarts = [
        "firsttoken_worker_restarts",
        "counter",
        "Worker processes that died and were replaced (--workers).",
        [["firsttoken_worker_restarts_total", {}, int(restarted)]],
    ]
    parts.append(([restarts], False))
    retired["families"] = merge_families(parts)
    if name:
        retired["folded"] = [*retired["folded"][-63:], name]
    _write_json(directory / RETIRED, retired)
    for path in (directory / f"{name}.json", directory / f"{name}.sock") if name else ():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _ask(path: Path) -> tuple[list[Family] | None, bool]:
    """A sibling's families now; (None, False) when nobody listens (it died), (None, True)
    when it didn't answer in time (alive but stuck: its file stands in)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(ASK_TIMEOUT_S)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return None, False
        except OSError:
            return None, True
        chunks: list[bytes] = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
            return orjson.loads(b"".join(chunks)), True
        except (OSError, orjson.JSONDecodeError):
            return None, True


def _read_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None


def _write_json(path: Path, value: Any) -> None:
    """Atomically (a reader sees the old file or the new one), from any thread."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(orjson.dumps(value))
    os.replace(tmp, path)
