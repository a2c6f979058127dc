"""One tail of Redis for every mirror on this instance.

A mirror's producer catches up on its own (`RedisStore.tail`: `XRANGE` from where its reader
is), then hands its stream here as a `Follower`. A lane reads up to `LANE_KEYS` followed
streams with one `XREAD BLOCK`, on one connection at a time, and appends what comes to each
follower's log; one upkeep task writes every follower's presence and asks whether each
owner is alive in one pipeline a second. N remote readers cost a lane per thousand streams
and one short call a second, not a connection each (they held one each for a 1 s blocking
read, and a capped pool turned a burst of them into 503s).

A lane's read also follows its own wake stream (`ft:wake:{instance}:{lane}`): a follower
joining while the lane blocks adds an entry there, so its first event does not wait out
the block. At most one wake is sent per read.

On Redis Cluster a multi-key command must stay in one slot: a lane then reads the streams of
one key group only (`keys.py`: 16 tags, one slot each), and its wake stream carries the same
tag. So an instance blocks at most one connection per group it follows streams of (16), on
the group's master.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
from anyio.abc import TaskGroup, TaskStatus
from redis.typing import KeyT, StreamIdT

from firsttoken.eventlog import EventLog
from firsttoken.formats.errors import error_body
from firsttoken.formats.sse import encode_event
from firsttoken.redisclient import REDIS_DOWN, AnyRedis, RawEntries
from firsttoken.resume.redis_keys import tag_of
from firsttoken.resume.runs import decode_run, run_first
from firsttoken.resume.store import LOST_AHEAD, Resumed

__all__ = ["Follower", "Tailer", "apply_entries", "entry_id", "fail"]

LANE_KEYS = 1000  # streams per XREAD: a longer command is slower for Redis to parse and serve
BLOCK_MS = 1000
COUNT = 1000  # entries per stream per read: a follower far behind catches up over reads
UPKEEP_S = 1.0  # presence lives _PRESENCE_MS (3 s): refreshed twice or more in its life
# The owners' liveness keys are read this often: a dead owner's stream is taken over within
# this of its key lapsing (a pipeline of one EXISTS per owner instance, not per stream).
OWNER_CHECK_S = 0.25
WAKE_LEN = 100
ORPHANED = b"orphaned"  # the end of a dead instance's stream that a survivor swept
WAKE_TTL_MS = 60_000  # nothing of a gone instance lingers
WAKE_TIMEOUT_S = 1.0
RETRY_S = 0.2

EntryId = tuple[int, int]


def entry_id(raw: bytes | str) -> EntryId:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def fail(log: EventLog, code: str, message: str) -> None:
    log.append(encode_event(log.next_seq, error_body(code, message), "error"))
    log.close()


def _check_resumed(
    resumed: Resumed, raw_id: Any, fields: dict[bytes, bytes], log: EventLog
) -> bool:
    """Check a reader's resume point against an entry; True once the log is closed (it was
    not the store's event: `stream_lost`)."""
    if b"end" in fields:
        if entry_id(raw_id)[0] < resumed.seq:  # it ended before the reader's last event
            fail(log, "stream_lost", LOST_AHEAD)
            return True
        return False
    if run_first(fields) > resumed.seq:
        resumed.checked = True  # that event is trimmed: nothing to compare it with
        return False
    for _, wire, _ in decode_run(fields, resumed.seq - 1):
        if not resumed.matches(wire):
            fail(log, "stream_lost", LOST_AHEAD)
            return True
        break
    return False


def apply_entries(entries: list[Any], log: EventLog, resumed: Resumed | None = None) -> bool:
    """Append the events of entries (runs, `runs.py`) that `log` lacks; True once the log is
    closed: the end marker was seen, or a run starts past the log's next event (the store
    lost events in between: the reader gets `event: error`, never a silent hole), or the
    reader `resumed` with an event the store's differs from (`stream_lost` too)."""
    for raw_id, fields in entries:
        if (
            resumed is not None
            and not resumed.checked
            and _check_resumed(resumed, raw_id, fields, log)
        ):
            return True
        if b"end" in fields:
            if fields[b"end"] == ORPHANED:  # its owner died, and a survivor billed and ended it
                fail(log, "stream_lost", "the instance generating this stream is gone")
            else:
                log.close()
            return True
        first = run_first(fields)
        if first > log.next_seq:
            fail(
                log,
                "stream_lost",
                f"events {log.next_seq} to {first - 1} of this stream were lost by the shared "
                "store (Redis)",
            )
            return True
        for _, wire, tokens in decode_run(fields, log.last_seq):
            log.append(wire, tokens)
    return False


@dataclass(slots=True, eq=False)
class Follower:
    """A mirror's log, fed from one stream key from `last` on."""

    key: str  # the stream's events
    presence_key: str  # set while it is followed here, so the owner keeps the stream
    owner_key: str | None  # the owner's liveness key; None: unknown, taken as alive
    log: EventLog
    last: EntryId
    takeover: bool = False  # its stream may be taken over when its owner is gone
    resumed: Resumed | None = None  # its reader's resume point, until the store's is seen
    heard: bool = False  # events came since the last liveness check
    missing_since: float | None = None  # monotonic: the owner's key first found missing
    orphaned: bool = False  # ended because its owner is gone, for a takeover
    done: anyio.Event = field(default_factory=anyio.Event)
    error: BaseException | None = None  # raised in the follower's own task


@dataclass(slots=True, eq=False)
class _Lane:
    wake_key: str
    group: str  # the key group (hash tag) of every key it reads; "" where any goes
    followers: dict[str, list[Follower]] = field(default_factory=dict)  # key -> followers
    joined: anyio.Event = field(default_factory=anyio.Event)  # set for an idle lane
    idle: bool = True
    woken: bool = False  # a wake entry went out for the read in progress
    wake_last: str = "0-0"


class Tailer:
    """Every follower of this instance, read by lanes of one blocking `XREAD` each."""

    def __init__(
        self,
        redis: AnyRedis,
        instance: str,
        *,
        cluster: bool = False,
        on_error: Callable[[BaseException], None],
        presence_ms: int,
        owner_gone_s: float,
    ) -> None:
        self.redis = redis
        self.instance = instance
        self.cluster = cluster  # lanes hold one key group each
        self.on_error = on_error  # Redis unreachable: the store's degraded state
        self.presence_ms = presence_ms
        self.owner_gone_s = owner_gone_s
        # Until then a missing owner key is not taken for a dead owner: Redis just failed a
        # read of ours, and may have failed the owner's writes too (a cluster's failover
        # loses the last writes not yet copied; an owner's key lapses while it cannot write).
        self._owners_unsure_until = 0.0
        self._lanes: list[_Lane] = []
        self._lane_of: dict[str, _Lane] = {}
        self._fresh: list[Follower] = []  # presence not written yet
        self._joined = anyio.Event()
        self._tg: TaskGroup | None = None

    def count(self) -> int:
        """Followers now (a stream read by two readers here counts twice)."""
        return sum(len(group) for lane in self._lanes for group in lane.followers.values())

    def _all(self) -> Iterator[Follower]:
        for lane in self._lanes:
            for group in lane.followers.values():
                yield from group

    def keys(self) -> set[str]:
        """The stream keys read now."""
        return set(self._lane_of)

    async def run(self, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._upkeep)
            task_status.started()

    async def follow(self, follower: Follower) -> None:
        """Feed `follower` until its stream ends there (end marker, or owner gone); the
        caller's cancellation drops it."""
        lane = self._join(follower)
        try:
            if not lane.idle and not lane.woken:
                lane.woken = True
                # Shielded: a reader leaving now must not cut the command off mid-reply.
                with anyio.move_on_after(WAKE_TIMEOUT_S, shield=True):
                    await self._wake(lane)
            await follower.done.wait()
        finally:
            self._leave(follower)
            follower.done.set()  # gone: an upkeep in flight must not write to its log
        if follower.error is not None:
            raise follower.error

    # -- joining and leaving --------------------------------------------------------------

    def _join(self, follower: Follower) -> _Lane:
        lane = self._lane_of.get(follower.key)
        if lane is None:
            group = tag_of(follower.key) if self.cluster else ""
            lane = next(
                (ln for ln in self._lanes if ln.group == group and len(ln.followers) < LANE_KEYS),
                None,
            )
            if lane is None:
                lane = self._add_lane(group)
            self._lane_of[follower.key] = lane
        lane.followers.setdefault(follower.key, []).append(follower)
        self._fresh.append(follower)
        self._joined.set()
        lane.joined.set()
        return lane

    def _add_lane(self, group: str) -> _Lane:
        assert self._tg is not None, "the tailer is not running"
        n = len(self._lanes)
        tag = f"{{{group}}}:" if group else ""  # in its lane's slot
        lane = _Lane(f"ft:{tag}wake:{self.instance}:{n}", group)
        self._lanes.append(lane)
        self._tg.start_soon(self._read, lane)
        return lane

    def _leave(self, follower: Follower) -> None:
        lane = self._lane_of.get(follower.key)
        if lane is None:
            return
        group = lane.followers.get(follower.key, [])
        if follower in group:
            group.remove(follower)
        if not group:
            lane.followers.pop(follower.key, None)
            del self._lane_of[follower.key]

    def _end(self, follower: Follower) -> None:
        self._leave(follower)
        follower.done.set()

    async def _wake(self, lane: _Lane) -> None:
        sent = False
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(lane.wake_key, {"v": 1}, maxlen=WAKE_LEN, approximate=True)
                pipe.pexpire(lane.wake_key, WAKE_TTL_MS)
                await pipe.execute()
            sent = True
        except REDIS_DOWN:
            pass  # the lane's own read fails too and says so; its next one has this follower
        finally:
            if not sent:
                lane.woken = False  # the next joiner tries again

    # -- a lane ----------------------------------------------------------------------------

    async def _read(self, lane: _Lane) -> None:
        while True:
            if not lane.followers:
                lane.idle = True
                lane.joined = anyio.Event()
                await lane.joined.wait()
            lane.idle = False
            streams: dict[KeyT, StreamIdT] = {lane.wake_key: lane.wake_last}
            for key, group in lane.followers.items():
                ms, seq = min(f.last for f in group)
                streams[key] = f"{ms}-{seq}"
            lane.woken = False  # who joins from now on is not in this read
            try:
                # RESP2, raw: [[key, entries], ...] (redis-py's type allows every mode's).
                found = cast(
                    "list[tuple[bytes, RawEntries]]",
                    await self.redis.xread(streams, block=BLOCK_MS, count=COUNT),
                )
            except Exception as exc:  # not only REDIS_DOWN: a client bug in a failover too
                self._failed(exc, time.monotonic())
                await anyio.sleep(RETRY_S)
                continue
            for raw_key, entries in found or ():
                key = raw_key.decode()
                if key == lane.wake_key:
                    last = entries[-1][0]
                    lane.wake_last = last.decode() if isinstance(last, bytes) else last
                    continue
                for follower in list(lane.followers.get(key, ())):
                    self._deliver(follower, entries)

    def _deliver(self, follower: Follower, entries: list[Any]) -> None:
        # Entries at or before its last were read for another follower further behind.
        new = [e for e in entries if entry_id(e[0]) > follower.last]
        if not new:
            return
        follower.last = entry_id(new[-1][0])
        follower.heard = True
        try:
            ended = apply_entries(new, follower.log, follower.resumed)
        except Exception as exc:  # one follower's failure is its own, not its lane's
            follower.error = exc
            ended = True
        if ended:
            self._end(follower)

    # -- presence and the owners' liveness -------------------------------------------------

    async def _upkeep(self) -> None:
        next_presence = next_check = time.monotonic() + OWNER_CHECK_S
        while True:
            with anyio.move_on_after(max(0.0, next_check - time.monotonic())):
                await self._joined.wait()
            self._joined = anyio.Event()
            now = time.monotonic()
            check = now >= next_check
            fresh, self._fresh = self._fresh, []
            if check:
                next_check = now + OWNER_CHECK_S
                followers = list(self._all())
            else:  # joiners only: the owner hears of them at once, not within a second
                followers = [f for f in fresh if not f.done.is_set()]
            if not followers:
                continue
            if now >= next_presence:
                next_presence = now + UPKEEP_S
                presence = {f.presence_key for f in followers}
            else:
                presence = {f.presence_key for f in fresh}
            # A joiner's owner too: a reader back after its instance died is taken over at
            # once, not at the next round.
            owners = sorted({f.owner_key for f in followers if f.owner_key})
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key in presence:
                        pipe.set(key, self.instance, px=self.presence_ms)
                    for key in owners:
                        pipe.exists(key)
                    results = await pipe.execute()
            except REDIS_DOWN as exc:
                self._failed(exc, now)
                self._fresh[:0] = fresh
                # Through an outage the owner's key cannot be seen: no follower is lost.
                for f in self._all():
                    f.missing_since = None
                continue
            alive = dict(zip(owners, results[len(presence) :], strict=True))
            self._judge(followers, alive, now)

    def _failed(self, exc: BaseException, now: float) -> None:
        """A read of ours failed: the store hears of it, and owners' keys are not judged
        for `owner_gone_s` (see `_owners_unsure_until`)."""
        self.on_error(exc)
        self._owners_unsure_until = now + self.owner_gone_s

    def _judge(self, followers: list[Follower], alive: dict[str, Any], now: float) -> None:
        for f in followers:
            if f.done.is_set():
                continue
            if f.heard or f.owner_key is None or alive.get(f.owner_key):
                f.heard = False
                f.missing_since = None
                continue
            if f.takeover:
                if now < self._owners_unsure_until:
                    continue  # judged once the owner has had the time to write its key again
                # Its key lapsed (1.2 s unwritten) or was deleted by a hand-over: the claim
                # decides, once (a paused owner that comes back finds its writes fenced).
                f.orphaned = True
                self._end(f)
                continue
            # The owner refreshes its key every second; after a Redis restart it may take
            # that long to come back, so only a key missing for its whole lifetime counts.
            f.missing_since = f.missing_since or now
            if now - f.missing_since >= self.owner_gone_s:
                try:
                    fail(f.log, "stream_lost", "the instance generating this stream is gone")
                except Exception as exc:
                    f.error = exc
                self._end(f)
