"""API keys: a TOML file of named keys, each with optional limits."""

from __future__ import annotations

import hashlib
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from firsttoken.admission.spend import Budget, parse_budget

__all__ = ["ApiKey", "KeyRing"]


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    max_streams: int | None = None  # None: the server's --max-streams-per-key
    tokens_per_minute: int | None = None  # None: no token budget
    resume_max_bytes: int | None = None  # None: only the server's --resume-max-bytes
    # The key's place in a full target's queue: a higher priority goes first; within one,
    # keys share the target's turns in proportion to their weight (counted in tokens).
    priority: int = 0
    weight: float = 1.0
    budget: Budget | None = None  # money per UTC day, month or in total (spend.py)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # TOML true is no number


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Every field a [[keys]] entry may have: anything else is a typo that would otherwise leave
# the key on a default limit without a word.
_FIELDS = (
    "name",
    "key",
    "max_streams",
    "tokens_per_minute",
    "resume_max_bytes",
    "priority",
    "weight",
    "budget",
)
_SHAPE = '[[keys]] entries (name = "...", key = "...")'


def _entries(raw: dict[str, Any], path: str | Path) -> list[dict[str, Any]]:
    """The file's `[[keys]]` array, or ValueError saying what shape it has instead."""
    unknown = sorted(set(raw) - {"keys"})
    if unknown:
        raise ValueError(f"{path}: unknown table or field {unknown[0]!r} (expected {_SHAPE})")
    entries = raw.get("keys", [])
    if isinstance(entries, dict):  # [keys] or [keys.alice]
        raise ValueError(f"{path}: keys is a table; write each key as {_SHAPE}")
    if not isinstance(entries, list):
        raise ValueError(f"{path}: keys is not a list of tables; write each key as {_SHAPE}")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):  # keys = ["sk-..."]: never echo what may be a secret
            raise ValueError(f"{path}: keys[{i}] is not a table; write each key as {_SHAPE}")
        extra = [field for field in entry if field not in _FIELDS]
        if extra:
            raise ValueError(
                f"{path}: keys[{i}].{extra[0]}: unknown field (known: {', '.join(_FIELDS)})"
            )
    return entries


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class KeyRing:
    """Keys by the digest of their secret: lookups never compare secrets byte by byte."""

    def __init__(self, keys: dict[str, ApiKey]) -> None:
        self._by_digest = {_digest(secret): key for secret, key in keys.items()}

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        """
        [[keys]]
        name = "alice"
        key = "sk-alice-..."
        max_streams = 5      # optional
        tokens_per_minute = 20000   # optional
        resume_max_bytes = 33554432   # optional
        priority = 1         # optional, default 0: higher goes first in a full target's queue
        weight = 2.0         # optional, default 1: its share of a full target, in tokens
        budget = { amount = 25.00, per = "day" }   # optional: money per day, month or total
        """
        raw = tomllib.loads(Path(path).read_text())
        keys: dict[str, ApiKey] = {}
        where: dict[str, int] = {}
        for i, entry in enumerate(_entries(raw, path)):
            secret, name = entry.get("key"), entry.get("name")
            if not isinstance(secret, str) or not secret or not isinstance(name, str):
                raise ValueError(f"{path}: keys[{i}] needs a string 'name' and 'key'")
            if secret in keys:  # one secret, two names: which limits would apply?
                first = where[secret]
                raise ValueError(
                    f"{path}: keys[{i}] ({name!r}) has the same key as keys[{first}] "
                    f"({keys[secret].name!r}); each key must be listed once"
                )
            where[secret] = i
            limit = entry.get("max_streams")
            if limit is not None and (not _is_int(limit) or limit < 1):
                raise ValueError(f"{path}: keys[{i}].max_streams must be a positive integer")
            budget = entry.get("tokens_per_minute")
            if budget is not None and (not _is_int(budget) or budget < 1):
                raise ValueError(f"{path}: keys[{i}].tokens_per_minute must be a positive integer")
            kept = entry.get("resume_max_bytes")
            if kept is not None and (not _is_int(kept) or kept < 1):
                raise ValueError(f"{path}: keys[{i}].resume_max_bytes must be a positive integer")
            priority = entry.get("priority", 0)
            if not _is_int(priority):
                raise ValueError(f"{path}: keys[{i}].priority must be an integer")
            weight = entry.get("weight", 1)
            if not _is_number(weight) or not 0 < weight < math.inf:
                raise ValueError(f"{path}: keys[{i}].weight must be a positive number")
            money = entry.get("budget")
            if money is not None:
                money = parse_budget(money, f"{path}: keys[{i}].budget")
            keys[secret] = ApiKey(
                name=name,
                max_streams=limit,
                tokens_per_minute=budget,
                resume_max_bytes=kept,
                priority=priority,
                weight=float(weight),
                budget=money,
            )
        if not keys:
            raise ValueError(f"{path}: no [[keys]] entries")
        return cls(keys)

    def find(self, secret: str) -> ApiKey | None:
        return self._by_digest.get(_digest(secret))

    def named(self, name: str) -> ApiKey | None:
        """The key of that name (a stream taken over carries its key's name, not its secret)."""
        return next((k for k in self._by_digest.values() if k.name == name), None)

    def names(self) -> list[str]:
        """Every key's name, once each, in the file's order (the bounded label set)."""
        return list(dict.fromkeys(k.name for k in self._by_digest.values()))

    def resume_limits(self) -> dict[str, int]:
        """Each key's own bound on its finished streams' resume buffers, by key name."""
        return {
            k.name: k.resume_max_bytes
            for k in self._by_digest.values()
            if k.resume_max_bytes is not None
        }
