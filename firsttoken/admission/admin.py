"""The admin surface's own key: --admin-key-env names the variable that holds it (read at
start), or --admin-key-file the file (read at start and on every reload: `reload.py`).

Admin endpoints take this key and no API key; without one configured they answer 404, as
if they were not there (an operator's view must not be found by probing)."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from starlette.requests import Request

from firsttoken.formats.errors import APIError

__all__ = ["AdminKey"]


class AdminKey:
    """The admin secret's digest; `check` compares digests in constant time."""

    def __init__(self, secret: str | None) -> None:
        self._digest = hashlib.sha256(secret.encode()).digest() if secret else None

    @classmethod
    def from_env(cls, variable: str | None) -> AdminKey:
        """The secret in environment variable `variable`; ValueError naming it when set but
        empty or missing (a typo must not leave the admin surface off without a word)."""
        if variable is None:
            return cls(None)
        secret = os.environ.get(variable, "").strip()
        if not secret:
            raise ValueError(f"environment variable {variable} is empty or not set")
        return cls(secret)

    @classmethod
    def from_file(cls, path: str) -> AdminKey:
        """The secret on the first line of the file at `path`; ValueError naming it when the
        file is empty (OSError when it cannot be read)."""
        lines = Path(path).expanduser().read_text().strip().splitlines()
        secret = lines[0].strip() if lines else ""
        if not secret:
            raise ValueError(f"{path}: is empty: it must hold the admin key")
        return cls(secret)

    @classmethod
    def of(cls, env: str | None, file: str | None) -> AdminKey:
        """The admin key as the settings name it: a variable, a file, or none."""
        return cls.from_file(file) if file else cls.from_env(env)

    def same_as(self, other: AdminKey) -> bool:
        return self._digest == other._digest

    @property
    def configured(self) -> bool:
        return self._digest is not None

    def allows(self, request: Request) -> bool:
        if self._digest is None:
            return False
        auth = request.headers.get("authorization", "")
        secret = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        given = hashlib.sha256(secret.encode()).digest()
        return bool(secret) and hmac.compare_digest(given, self._digest)

    def check(self, request: Request) -> None:
        """404 `not_found` unless `request` carries the admin key."""
        if not self.allows(request):
            raise APIError(404, "not_found", "Not Found")
