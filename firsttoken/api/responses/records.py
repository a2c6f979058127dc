"""What a stored Response keeps beside its events: its input items (the previous response's
conversation prepended, with ids) and, for a whole answer, the Response itself (a stream's
is its log). `GET /v1/responses/{id}/input_items` lists the first; `previous_response_id`
continues from both; a whole answer is read back by id from the second.

A record lives in memory, or with `--redis` in Redis (`ft:resp:<id>`, one string with its
expiry: any instance reads it). It expires with its stream: `--responses-ttl-s` +
`--resume-ttl-s` from the start at most, `--resume-ttl-s` after a whole answer's end.

Bounded per key: `--responses-max-per-key` records and `--responses-max-bytes-per-key` bytes
of them at once, counted by the instance that stored them (a record deleted through another
instance still counts here until it expires). Admission asks before anything is stored;
one over either cap is refused whole.

Cost: one orjson dump of the input per stored response, a dict entry and a heap push (and
one `SET` with `--redis`); nothing per token.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request

from firsttoken.api.gateway import gateway
from firsttoken.formats.errors import APIError
from firsttoken.resume.redis import RedisStore

__all__ = ["Kept", "ResponseRecords", "response_records"]

_REDIS_PREFIX = "ft:resp:"


@dataclass(slots=True)
class Kept:
    """One stored response: the key that created it, its input items, and a whole answer's
    Response once it is folded (None: a stream, read from its log)."""

    tenant: str
    items: list[dict[str, Any]]
    response: dict[str, Any] | None = None

    def encode(self) -> bytes:
        return orjson.dumps({"t": self.tenant, "i": self.items, "r": self.response})

    @staticmethod
    def decode(raw: bytes) -> Kept:
        data = orjson.loads(raw)
        return Kept(data["t"], data["i"], data.get("r"))


@dataclass(slots=True)
class _Held:
    tenant: str
    size: int
    expires_at: float


@dataclass(slots=True)
class _Tally:
    count: int = 0
    size: int = 0


@dataclass
class ResponseRecords:
    """The stored responses' records, and each key's share of them."""

    max_per_key: int
    max_bytes_per_key: int
    clock: Callable[[], float] = time.monotonic
    redis: Any = None  # a `redis.asyncio` client (`--redis`); None: kept here
    _held: dict[str, _Held] = field(default_factory=dict)
    _tallies: dict[str, _Tally] = field(default_factory=dict)
    _expiries: list[tuple[float, str]] = field(default_factory=list)
    _kept: dict[str, bytes] = field(default_factory=dict)  # memory: the records themselves

    def admit(self, tenant: str, size: int) -> None:
        """Refuse (a 4xx naming the cap) a new record of `size` bytes for `tenant` that would
        take it over either cap."""
        self._expire()
        if size > self.max_bytes_per_key:
            raise APIError(
                400,
                "stored_response_too_large",
                f"this response's stored input is {size} bytes; a key keeps at most "
                f"{self.max_bytes_per_key} (--responses-max-bytes-per-key): send it with "
                "store false, or a shorter input",
                param="input",
            )
        tally = self._tallies.get(tenant)
        if tally is None:
            return
        if tally.count >= self.max_per_key or tally.size + size > self.max_bytes_per_key:
            raise APIError(
                429,
                "stored_responses_exceeded",
                f"this key keeps {tally.count} stored responses ({tally.size} bytes); at most "
                f"{self.max_per_key} and {self.max_bytes_per_key} bytes "
                "(--responses-max-per-key, --responses-max-bytes-per-key): delete some, wait "
                "for them to expire, or send store false",
                param="store",
            )

    async def keep(self, response_id: str, kept: Kept, ttl_s: float) -> None:
        """Store `kept` for `ttl_s` (again: replaced, and its size counted anew)."""
        raw = kept.encode()
        expires_at = self.clock() + ttl_s
        if self.redis is not None:
            try:
                await self.redis.set(_REDIS_PREFIX + response_id, raw, px=max(int(ttl_s * 1000), 1))
            except RedisError as exc:
                raise _unavailable() from exc
        else:
            self._kept[response_id] = raw
        self._count_out(response_id)
        self._held[response_id] = _Held(kept.tenant, len(raw), expires_at)
        tally = self._tallies.setdefault(kept.tenant, _Tally())
        tally.count += 1
        tally.size += len(raw)
        heapq.heappush(self._expiries, (expires_at, response_id))

    async def find(self, response_id: str) -> Kept | None:
        """The record, while it is kept (None: unknown, expired or deleted)."""
        self._expire()
        if self.redis is not None:
            try:
                raw = await self.redis.get(_REDIS_PREFIX + response_id)
            except RedisError as exc:
                raise _unavailable() from exc
        else:
            raw = self._kept.get(response_id)
        return None if raw is None else Kept.decode(raw)

    async def forget(self, response_id: str) -> None:
        if self.redis is not None:
            try:
                await self.redis.delete(_REDIS_PREFIX + response_id)
            except RedisError as exc:
                raise _unavailable() from exc
        self._kept.pop(response_id, None)
        self._count_out(response_id)

    def held(self, tenant: str) -> tuple[int, int]:
        """`tenant`'s records kept now, and their bytes."""
        self._expire()
        tally = self._tallies.get(tenant)
        return (tally.count, tally.size) if tally is not None else (0, 0)

    def _count_out(self, response_id: str) -> None:
        held = self._held.pop(response_id, None)
        if held is None:
            return
        tally = self._tallies[held.tenant]
        tally.count -= 1
        tally.size -= held.size
        if tally.count == 0:
            del self._tallies[held.tenant]

    def _expire(self) -> None:
        now = self.clock()
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expires_at, response_id = heapq.heappop(expiries)
            held = self._held.get(response_id)
            if held is not None and held.expires_at == expires_at:  # not kept again since
                self._kept.pop(response_id, None)
                self._count_out(response_id)


def response_records(request: Request) -> ResponseRecords:
    """This app's stored responses' records (made at the first use: nothing is kept by a
    server that serves no Responses)."""
    state = request.app.state
    kept: ResponseRecords | None = getattr(state, "response_records", None)
    if kept is None:
        gw = gateway(request)
        settings = gw.settings
        store = gw.registry.store
        kept = ResponseRecords(
            settings.responses_max_per_key,
            settings.responses_max_bytes_per_key,
            redis=store.redis if isinstance(store, RedisStore) else None,
        )
        state.response_records = kept
    return kept


def _unavailable() -> APIError:
    return APIError(
        503,
        "store_unavailable",
        "the shared store (Redis) did not answer for stored responses; try again",
        headers={"retry-after": "1"},
    )
