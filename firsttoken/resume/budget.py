"""How many bytes of finished streams' resume buffers this process keeps, in all and per key.

A finished stream keeps its events for `--resume-ttl-s` so that a reader can come back for
them. Each buffer is bounded (`--resume-max-events`), but their number is not: one key that
creates streams and never reads them would otherwise fill the process for the whole TTL. The
budget counts each buffer once, when its stream ends (a live stream is bounded by its window,
its grace and the key's concurrency), and past a bound names the buffers to drop: past a key's
own bound, that key's oldest; past the server-wide bound, the oldest of the key that holds the
most (max-min fair share: a key that fills the budget pushes out its own buffers first, and
another key's only once it holds no more than they do). A dropped buffer's stream stays known
(a resume of it gets `resume_expired`, as an expired one does), but holds no events.

Cost: nothing per token or per stream until a bound is passed; then, per buffer dropped, one
pass over the keys that hold buffers (a keys file's worth; one key, `open`, without one).

With Redis, a live stream's request is stored with it (`StreamRecord.handover`, up to
`--takeover-max-bytes`) so that another instance can take it over, and deleted when it ends.
Those bytes count here too while the stream runs (`store_request`): they push finished
buffers out first, and a request that would not fit beside the other live ones, server-wide
or in its key's bound, is not stored (that stream cannot be taken over). One key making
streams of 1 MB prompts could otherwise hold the bound's worth in Redis per second of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from firsttoken.telemetry.metrics import key_label

__all__ = ["ResumeBudget"]


class ResumeBudget:
    """Bytes of kept buffers, oldest first: in all (`max_bytes`) and per key (`per_key`)."""

    def __init__(self, max_bytes: int, per_key: Mapping[str, int] | None = None) -> None:
        self.max_bytes = max_bytes
        self.per_key = dict(per_key or {})  # a key's own bound (keys file: resume_max_bytes)
        self.held = 0  # finished buffers and stored requests
        self.dropped = 0  # buffers dropped for the bound, ever
        self.requests = 0  # bytes of live streams' requests stored for a takeover
        self.unstored = 0  # requests not stored for the bound, ever
        self.dropped_of: dict[str, int] = {}  # the same, by the key whose buffers they were
        self._kept: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (key, bytes)
        self._by_key: dict[str, OrderedDict[str, int]] = {}
        self._key_held: dict[str, int] = {}
        self._stored: dict[str, tuple[str, int]] = {}  # live stream id -> (key, bytes)
        self._key_requests: dict[str, int] = {}

    def held_by(self, key: str) -> int:
        return self._key_held.get(key, 0)

    def add(self, stream_id: str, key: str, size: int) -> list[str]:
        """A finished stream's buffer of `size` bytes, kept from now: returns the ids of the
        buffers to drop to stay within the bounds, oldest first (it may be among them)."""
        if stream_id in self._kept:
            self.forget(stream_id)
        self._kept[stream_id] = (key, size)
        own = self._by_key.setdefault(key, OrderedDict())
        own[stream_id] = size
        self._count(key, size)
        drop: list[str] = []
        limit = self.per_key.get(key)
        if limit is not None:
            while own and self._key_held[key] > limit:
                drop.append(self._drop(next(iter(own))))
        while self.held > self.max_bytes and self._kept:
            drop.append(self._drop(next(iter(self._by_key[self._largest()]))))
        return drop

    def _largest(self) -> str:
        """Of the keys with a finished buffer to drop, the one holding the most bytes (its
        stored requests included); of keys holding as much, the one whose oldest buffer is
        oldest (one key alone: the oldest first, as without keys)."""
        held = self._key_held
        most = max(held[k] for k in self._by_key)
        tied = [k for k in self._by_key if held[k] == most]
        if len(tied) == 1:
            return tied[0]
        return next(key for key, _ in self._kept.values() if key in tied)

    def forget(self, stream_id: str) -> None:
        """The stream expired (or its buffer went another way): it counts no more."""
        entry = self._kept.pop(stream_id, None)
        if entry is None:
            return
        key, size = entry
        own = self._by_key[key]
        del own[stream_id]
        if not own:
            del self._by_key[key]
        self._count(key, -size)

    def store_request(self, stream_id: str, key: str, size: int) -> bool:
        """A live stream's request of `size` bytes, to be stored in Redis until it ends
        (`end_request`). False when it does not fit beside the live ones, server-wide or in
        the key's bound: the stream is stored without it. Finished buffers make room at the
        next `add` (they go first: a live stream's request cannot be dropped)."""
        limit = self.per_key.get(key)
        own = self._key_requests.get(key, 0)
        if self.requests + size > self.max_bytes or (limit is not None and own + size > limit):
            self.unstored += 1
            return False
        self._stored[stream_id] = (key, size)
        self._key_requests[key] = own + size
        self.requests += size
        self._count(key, size)
        return True

    def end_request(self, stream_id: str) -> None:
        """The stream ended (its request is deleted from Redis) or left this instance."""
        entry = self._stored.pop(stream_id, None)
        if entry is None:
            return
        key, size = entry
        self.requests -= size
        left = self._key_requests[key] - size
        if left:
            self._key_requests[key] = left
        else:
            del self._key_requests[key]
        self._count(key, -size)

    def _count(self, key: str, size: int) -> None:
        self.held += size
        held = self._key_held.get(key, 0) + size
        if held:
            self._key_held[key] = held
        else:
            self._key_held.pop(key, None)

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "firsttoken_resume_buffer_bytes",
            "Bytes of finished streams' resume buffers kept, and of live streams' requests "
            "stored in Redis for a takeover (--resume-max-bytes bounds their sum).",
        )
        held.add_metric([], self.held)
        yield held
        requests = GaugeMetricFamily(
            "firsttoken_resume_request_bytes",
            "Bytes of live streams' requests stored in Redis for a takeover (in the above).",
        )
        requests.add_metric([], self.requests)
        yield requests
        unstored = CounterMetricFamily(
            "firsttoken_resume_requests_unstored",
            "Streams whose request was not stored for a takeover: it would not fit in "
            "--resume-max-bytes (or the key's resume_max_bytes) beside the live ones.",
        )
        unstored.add_metric([], self.unstored)
        yield unstored
        dropped = CounterMetricFamily(
            "firsttoken_resume_buffers_dropped",
            "Finished streams' resume buffers dropped before their TTL (--resume-max-bytes, a "
            "key's resume_max_bytes), by the key whose buffers they were.",
            labels=["key"],
        )
        for key, n in self.dropped_of.items():
            dropped.add_metric([key_label(key)], n)
        yield dropped

    def _drop(self, stream_id: str) -> str:
        key = self._kept[stream_id][0]
        self.forget(stream_id)
        self.dropped += 1
        self.dropped_of[key] = self.dropped_of.get(key, 0) + 1
        return stream_id
