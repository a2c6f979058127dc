"""API keys: a TOML file of named keys, each with optional limits, routes and a lifetime.

Each `[[keys]]` field is one line of `_FIELDS` (its parser and default), so a new field is one
more line. A key's secret is given as `key` (the secret itself) or `key_sha256` (its SHA-256,
hex: the file then holds no secret); either way the ring keeps only digests, and a lookup
never compares secrets byte by byte.
"""

from __future__ import annotations

import datetime
import fnmatch
import functools
import hashlib
import json
import math
import os
import re
import secrets
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from firsttoken.admission.spend import Budget, parse_budget

__all__ = [
    "ANONYMOUS",
    "ApiKey",
    "KeyRing",
    "digest_hex",
    "new_secret",
    "pattern_problem",
    "rotate",
]

# `firsttoken keys new`: 32 random bytes (256 bits) as URL-safe text.
SECRET_BYTES = 32


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
    requests_per_minute: int | None = None  # None: no request rate of its own
    routes: tuple[str, ...] | None = None  # names or globs of the routes it may use; None: all
    expires_at: float | None = None  # Unix time from which it is refused; None: never
    disabled: bool = False
    budget: Budget | None = None  # money per UTC day, month or in total (spend.py)
    # The secret's SHA-256: which secret a stream was admitted with (a name may have two
    # while it is rotated; a reload that drops one ends that one's streams only).
    digest: bytes = field(default=b"", compare=False, repr=False)

    def may_use(self, model: str) -> bool:
        """Whether the key's `routes` let it use the route (model name) `model`."""
        return self.routes is None or _matcher(self.routes).match(model) is not None

    def refusal(self, now: float) -> str | None:
        """Why the key may not be used at `now` (Unix time): `key_disabled`, `key_expired`;
        None when it may."""
        if self.disabled:
            return "key_disabled"
        if self.expires_at is not None and now >= self.expires_at:
            return "key_expired"
        return None


ANONYMOUS = ApiKey(name="")  # no keys file: everyone is the same anonymous caller, unlimited


@functools.lru_cache(maxsize=1024)
def _matcher(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One regular expression for a key's `routes` (fnmatch's, case-sensitive): a request
    checks its model against it once."""
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns) or "(?!)")


class _Bad(ValueError):
    """A field's value is wrong: what a person reads after `keys[i].field`."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # TOML true is no number


def _positive_int(value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise _Bad("must be a positive integer")
    return int(value)


def _integer(value: Any) -> int:
    if not _is_int(value):
        raise _Bad("must be an integer")
    return int(value)


def _positive_number(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
        raise _Bad("must be a positive number")
    return float(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad("must be true or false")
    return value


def _secret(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Bad("must be a non-empty string")
    return value


def _budget(value: Any) -> Budget:
    try:
        return parse_budget(value, "")
    except ValueError as exc:
        raise _Bad(str(exc).lstrip()) from None


_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


def _sha256(value: Any) -> str:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise _Bad("must be 64 hex digits (`firsttoken keys hash` prints it)")
    return value.lower()


# Route names are 1-128 of these (routing/config.py); a pattern adds fnmatch's * ? [ ] !.
_ROUTE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/-")
_GLOB = re.compile(r"^(?:[^\[\]]|\[!?[^\[\]]+\])+$")  # brackets only as whole [...] sets


def pattern_problem(pattern: object) -> str | None:
    """What is wrong with one entry of a key's `routes` (a route name or a glob); None if
    nothing."""
    if not isinstance(pattern, str) or not pattern or len(pattern) > 128:
        return "must be route names or globs (1-128 characters)"
    if not set(pattern) <= _ROUTE_CHARS | set("*?[]!"):
        return f"{pattern!r}: a route name or glob is made of A-Z a-z 0-9 . _ : / - * ? [ ] !"
    if not _GLOB.match(pattern):
        return f"{pattern!r}: a bad glob (a [ without its ], or one inside another)"
    return None


def _routes(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _Bad('must be a list of route names or globs (routes = ["chat", "edge-*"])')
    for item in value:
        problem = pattern_problem(item)
        if problem is not None:
            raise _Bad(problem)
    return tuple(value)


def _when(value: Any) -> float:
    """A TOML date or date-time as Unix time; one without an offset is UTC."""
    if isinstance(value, datetime.datetime):
        when: datetime.datetime = value
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        return when.timestamp()
    if isinstance(value, datetime.date):
        return datetime.datetime(
            value.year, value.month, value.day, tzinfo=datetime.UTC
        ).timestamp()
    raise _Bad("must be a TOML date-time (expires_at = 2026-12-31T23:59:59Z)")


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Bad("must be a non-empty string")
    return value


# Every field a [[keys]] entry may have, with its parser: anything else is a typo that would
# otherwise leave the key on a default limit without a word. `key` and `key_sha256` are the
# secret's (one of the two), the rest become ApiKey's fields of the same name.
_FIELDS: dict[str, Callable[[Any], Any]] = {
    "name": _name,
    "key": _secret,
    "key_sha256": _sha256,
    "max_streams": _positive_int,
    "tokens_per_minute": _positive_int,
    "requests_per_minute": _positive_int,
    "resume_max_bytes": _positive_int,
    "priority": _integer,
    "weight": _positive_number,
    "routes": _routes,
    "expires_at": _when,
    "disabled": _flag,
    "budget": _budget,
}
_SECRETS = ("key", "key_sha256")
# A name's streams, minute counts and budget are counted once for all its secrets, so its
# limits are one set too: every entry of one name must agree on every field but these, which
# belong to one secret (rotation: the old secret expires or is disabled, the new one runs on).
_PER_SECRET = frozenset({"name", *_SECRETS, "expires_at", "disabled"})
_LIMITS = tuple(f for f in _FIELDS if f not in _PER_SECRET)
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


def digest_hex(secret: str) -> str:
    """What a keys file's `key_sha256` holds for `secret`."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    """A fresh API key: 256 random bits."""
    return "sk-" + secrets.token_urlsafe(SECRET_BYTES)


def _parse(entry: dict[str, Any], i: int, path: str | Path) -> tuple[bytes, ApiKey]:
    values: dict[str, Any] = {}
    for name, raw in entry.items():
        try:
            values[name] = _FIELDS[name](raw)
        except _Bad as bad:
            sep = "" if str(bad).startswith(".") else " "  # a field of the field: budget.per
            raise ValueError(f"{path}: keys[{i}].{name}{sep}{bad}") from None
    given = [s for s in _SECRETS if s in values]
    if "name" not in values or len(given) != 1:
        raise ValueError(
            f"{path}: keys[{i}] needs a string 'name' and one of 'key' or 'key_sha256'"
        )
    secret = values.pop("key", None)
    digest = _digest(secret) if secret is not None else bytes.fromhex(values.pop("key_sha256"))
    return digest, ApiKey(**values, digest=digest)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml(value: Any) -> str:
    """A value read by tomllib, written back as TOML (the types a keys file's fields hold)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML basic string escapes
    if isinstance(value, datetime.date | datetime.datetime):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        fields = (
            f"{k if _BARE_KEY.match(k) else json.dumps(k)} = {_toml(v)}" for k, v in value.items()
        )
        return "{ " + ", ".join(fields) + " }"
    raise TypeError(f"no TOML for {type(value).__name__}")


def rotate(path: str | Path, name: str) -> tuple[str, int]:
    """Add a new secret to the key `name` in the keys file at `path`: a `[[keys]]` entry with
    its digest and the name's limits (copied from its first entry; not its lifetime), appended
    to the file, which is replaced in one step and checked as a start would check it. Returns
    the secret (shown once) and the new entry's index; ValueError when the file is not valid
    or has no key of that name."""
    path = Path(path)
    KeyRing.load(path)  # a valid file, or the line that says what is wrong with it
    text = path.read_text(encoding="utf-8")
    entries = tomllib.loads(text).get("keys", [])
    old = next((e for e in entries if e.get("name") == name), None)
    if old is None:
        raise ValueError(f"{path}: no key named {name!r} (`firsttoken keys new` makes one)")
    secret = new_secret()
    lines = ["[[keys]]", f"name = {_toml(name)}", f'key_sha256 = "{digest_hex(secret)}"']
    lines += [f"{f} = {_toml(old[f])}" for f in _LIMITS if f in old]
    new_text = text + ("" if text.endswith("\n") or not text else "\n") + "\n" + "\n".join(lines)
    fresh = path.with_name(f".{path.name}.rotate")
    fresh.write_text(new_text + "\n", encoding="utf-8")
    try:
        fresh.chmod(path.stat().st_mode & 0o7777)
        KeyRing.load(fresh)
        os.replace(fresh, path)
    finally:
        fresh.unlink(missing_ok=True)
    return secret, len(entries)


class KeyRing:
    """Keys by the digest of their secret: lookups never compare secrets byte by byte."""

    def __init__(self, keys: dict[str, ApiKey]) -> None:
        self._by_digest = {
            (d := _digest(secret)): replace(key, digest=d) for secret, key in keys.items()
        }

    @classmethod
    def of_digests(cls, keys: Iterable[tuple[bytes, ApiKey]]) -> KeyRing:
        ring = cls({})
        ring._by_digest = {d: key if key.digest else replace(key, digest=d) for d, key in keys}
        return ring

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        """
        [[keys]]
        name = "alice"
        key = "sk-alice-..."          # or key_sha256 = "<hex>" (`firsttoken keys hash`)
        max_streams = 5               # optional
        tokens_per_minute = 20000     # optional
        requests_per_minute = 600     # optional
        resume_max_bytes = 33554432   # optional
        priority = 1         # optional, default 0: higher goes first in a full target's queue
        weight = 2.0         # optional, default 1: its share of a full target, in tokens
        routes = ["chat", "edge-*"]   # optional, default: every route
        expires_at = 2026-12-31T00:00:00Z   # optional
        disabled = true               # optional, default false
        budget = { amount = 25.00, per = "day" }   # optional: money per day, month or total
        """
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not valid TOML ({exc})") from None
        keys: dict[bytes, ApiKey] = {}
        where: dict[bytes, int] = {}
        first_of: dict[str, tuple[int, ApiKey]] = {}  # a name's first entry
        for i, entry in enumerate(_entries(raw, path)):
            digest, key = _parse(entry, i, path)
            if digest in keys:  # one secret, two names: which limits would apply?
                first = where[digest]
                raise ValueError(
                    f"{path}: keys[{i}] ({key.name!r}) has the same key as keys[{first}] "
                    f"({keys[digest].name!r}); each key must be listed once"
                )
            j, other = first_of.setdefault(key.name, (i, key))
            differs = next((f for f in _LIMITS if getattr(key, f) != getattr(other, f)), None)
            if differs is not None:
                raise ValueError(
                    f"{path}: keys[{i}].{differs} differs from keys[{j}].{differs}, the same "
                    f"name {key.name!r}: the entries of one name share one set of limits "
                    f"(`firsttoken keys rotate {key.name}` adds a secret with them)"
                )
            where[digest] = i
            keys[digest] = key
        if not keys:
            raise ValueError(f"{path}: no [[keys]] entries")
        return cls.of_digests(keys.items())

    def find(self, secret: str) -> ApiKey | None:
        return self._by_digest.get(_digest(secret))

    def named(self, name: str) -> ApiKey | None:
        """The key of that name (a stream taken over carries its key's name, not its secret)."""
        return next((k for k in self._by_digest.values() if k.name == name), None)

    def names(self) -> list[str]:
        """Every key's name, once each, in the file's order (the bounded label set)."""
        return list(dict.fromkeys(k.name for k in self._by_digest.values()))

    def keys(self) -> list[ApiKey]:
        return list(self._by_digest.values())

    def holds(self, key: ApiKey) -> ApiKey | None:
        """This ring's entry for `key`'s secret (what a reload made of it), or None when the
        secret is gone."""
        return self._by_digest.get(key.digest)

    def resume_limits(self) -> dict[str, int]:
        """Each key's own bound on its finished streams' resume buffers, by key name."""
        return {
            k.name: k.resume_max_bytes
            for k in self._by_digest.values()
            if k.resume_max_bytes is not None
        }
