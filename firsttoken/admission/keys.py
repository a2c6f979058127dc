"""API keys: a TOML file of named keys, each with optional limits."""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ApiKey", "KeyRing"]


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    max_streams: int | None = None  # None: the server's --max-streams-per-key
    tokens_per_minute: int | None = None  # None: no token budget
    resume_max_bytes: int | None = None  # None: only the server's --resume-max-bytes


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
        """
        raw = tomllib.loads(Path(path).read_text())
        keys: dict[str, ApiKey] = {}
        where: dict[str, int] = {}
        for i, entry in enumerate(raw.get("keys", [])):
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
            if limit is not None and (not isinstance(limit, int) or limit < 1):
                raise ValueError(f"{path}: keys[{i}].max_streams must be a positive integer")
            budget = entry.get("tokens_per_minute")
            if budget is not None and (not isinstance(budget, int) or budget < 1):
                raise ValueError(f"{path}: keys[{i}].tokens_per_minute must be a positive integer")
            kept = entry.get("resume_max_bytes")
            if kept is not None and (not isinstance(kept, int) or kept < 1):
                raise ValueError(f"{path}: keys[{i}].resume_max_bytes must be a positive integer")
            keys[secret] = ApiKey(
                name=name, max_streams=limit, tokens_per_minute=budget, resume_max_bytes=kept
            )
        if not keys:
            raise ValueError(f"{path}: no [[keys]] entries")
        return cls(keys)

    def find(self, secret: str) -> ApiKey | None:
        return self._by_digest.get(_digest(secret))

    def resume_limits(self) -> dict[str, int]:
        """Each key's own bound on its finished streams' resume buffers, by key name."""
        return {
            k.name: k.resume_max_bytes
            for k in self._by_digest.values()
            if k.resume_max_bytes is not None
        }
