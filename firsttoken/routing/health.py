"""A target's health, as the gateway sees it from the requests it sends there.

Passive, like Envoy's outlier detection: after `eject_after` failures in a row the target is
ejected for `eject_s` (times the number of ejections in a row, up to `MAX_EJECT_S`); then one
real request goes there as a probe (half-open) and its outcome decides. An upstream's
`Retry-After` (on 429 or 503) holds the target back for that long without counting as a
failure. Time is passed in (`now`), so the rules run on a fake clock in tests.

A failure may be tied to one key's requests (`failure(now, key)`: the request carried fields
the gateway passes through unread, which the upstream may fail on): those count against the
target only once failures in the same run come from two keys or more. One key alone ejects
the target for itself only (`eject_after` of its tied failures in a row; its requests go to
the next target for `eject_s`), so it cannot move every other key to the fallback. Envoy's
consecutive-5xx detection counts every request alike, and has that weakness.
"""

from __future__ import annotations

__all__ = ["MAX_EJECT_S", "MAX_RETRY_AFTER_S", "TargetHealth"]

MAX_EJECT_S = 300.0  # Envoy's max_ejection_time default
MAX_RETRY_AFTER_S = 600.0  # a Retry-After beyond this is taken as this


class TargetHealth:
    UP = "up"
    EJECTED = "ejected"
    HALF_OPEN = "half_open"

    __slots__ = (
        "_failures",
        "_keys_out",
        "_probing",
        "_tied",
        "_until",
        "eject_after",
        "eject_s",
        "ejections",
        "held_until",
        "state",
    )

    def __init__(self, *, eject_after: int = 3, eject_s: float = 10.0) -> None:
        self.eject_after = eject_after
        self.eject_s = eject_s
        self.state = self.UP
        self.ejections = 0  # in a row: each lengthens the next cool-down
        self.held_until = 0.0  # Retry-After
        self._failures = 0
        self._until = 0.0
        self._probing = False
        self._tied: dict[str, int] = {}  # key -> its tied failures in the current run
        self._keys_out: dict[str, float] = {}  # key -> until when it is ejected for that key

    @property
    def failures(self) -> int:
        """Failures in a row so far (0 after any success)."""
        return self._failures

    @property
    def up(self) -> bool:
        """For `firsttoken_target_up`: not ejected (a Retry-After hold is not down)."""
        return self.state == self.UP

    @property
    def probe_at(self) -> float | None:
        """When (loop time) an ejected target's next request goes there as its probe; None
        unless ejected. Until a request comes, it stays ejected (`up` false) past this."""
        return self._until if self.state == self.EJECTED else None

    def available(self, now: float, key: str | None = None) -> bool:
        """Whether a request (of `key`) may go there now (without taking the half-open
        probe)."""
        if now < self.held_until:
            return False
        if key is not None and self._keys_out and now < self._keys_out.get(key, 0.0):
            return False
        if self.state == self.UP:
            return True
        if self.state == self.EJECTED:
            return now >= self._until
        return not self._probing

    def acquire(self, now: float, key: str | None = None) -> bool:
        """Take the target for one request (of `key`); in half-open only one request at a
        time (the probe). False: it may not be used now."""
        if not self.available(now, key):
            return False
        if self.state == self.EJECTED:
            self.state = self.HALF_OPEN
        if self.state == self.HALF_OPEN:
            self._probing = True
        return True

    def success(self) -> None:
        """A request there got its answer going (its first token): the target works."""
        self._failures = 0
        self._tied.clear()
        self.ejections = 0
        self._probing = False
        self.state = self.UP

    def failure(self, now: float, key: str | None = None) -> None:
        """A failure that says something about the target (not the request's own fault);
        `key`: tied to that key's request (see the module's docstring)."""
        if key is not None:
            tied = self._tied
            tied[key] = tied.get(key, 0) + 1
            if len(tied) < 2:  # one key's alone so far: nothing said about the target yet
                self._probing = False
                if tied[key] >= self.eject_after:
                    del tied[key]
                    self._forget_keys(now)
                    self._keys_out[key] = now + self.eject_s
                return
            self._failures += sum(tied.values()) - 1
            tied.clear()
        self._failures += 1
        if self.state == self.HALF_OPEN or self._failures >= self.eject_after:
            self._eject(now)

    def _forget_keys(self, now: float) -> None:
        # Bounded by the keys file; a key whose time is over needs no entry.
        for key in [k for k, until in self._keys_out.items() if until <= now]:
            del self._keys_out[key]

    def release(self) -> None:
        """A request ended without saying anything about the target (the client left, or
        the request was refused as its own fault): a probe goes back untaken."""
        self._probing = False

    def hold(self, now: float, seconds: float) -> None:
        """The upstream asked for a pause (Retry-After): no requests until then."""
        seconds = min(max(seconds, 0.0), MAX_RETRY_AFTER_S)
        self.held_until = max(self.held_until, now + seconds)
        self._probing = False

    def _eject(self, now: float) -> None:
        self.ejections += 1
        self.state = self.EJECTED
        self._until = now + min(self.eject_s * self.ejections, MAX_EJECT_S)
        self._failures = 0
        self._tied.clear()
        self._probing = False
