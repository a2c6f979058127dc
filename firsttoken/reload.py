"""Reload without a restart: the keys file, the routes file, the canned answers and the admin
key's file (`--admin-key-file`), on SIGHUP or when their contents change (`--watch-config`,
checked once a second).

A reload reads every file the server started with and validates them whole (`load_files`)
before anything changes; the first problem is one `config.reload_failed` line naming the
file, the table and the field, and the running configuration stays. Then the new routes are
built beside the old (`LiveRoutes.prepare`: new targets started, unchanged ones carried over
with their health, queues and counts) and everything is swapped in one step, with no await
in between: keys, routes, canned answers. Streams keep the key and targets they started
with; the streams of a key that is gone, or now disabled, end at once with `event: error`
`key_revoked` (a leaked key must stop spending), while any other change to a key applies to
its next request. A request whose body was still arriving is checked again once it is read
(`Admission.recheck`), and a stream admitted just before the swap, not yet running, as it
starts (`Admission.revoked`).

`firsttoken check` runs the same validation offline (`check_files`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from firsttoken.admission import ApiKey, KeyRing, key_revoked
from firsttoken.admission.admin import AdminKey
from firsttoken.api.gateway import Gateway
from firsttoken.core.stream import Stream, Usage
from firsttoken.engines.cache import CachedEngine, load_canned
from firsttoken.pricing import money_text
from firsttoken.routing import RouteTable, load_routes
from firsttoken.routing.live import LiveRoutes
from firsttoken.telemetry.log import log_event
from firsttoken.telemetry.metrics import key_label

__all__ = [
    "ConfigFiles",
    "Configuration",
    "Reloader",
    "check_files",
    "load_files",
    "unmatched_routes",
]

WATCH_S = 1.0  # --watch-config: how often the files' contents are compared


@dataclass(frozen=True, slots=True)
class ConfigFiles:
    """The files a reload reads (None: not given, nothing to reload)."""

    api_keys: str | None = None
    routes: str | None = None
    canned_answers: str | None = None
    admin_key: str | None = None  # --admin-key-file

    def paths(self) -> list[str]:
        return [p for p in (self.api_keys, self.routes, self.canned_answers, self.admin_key) if p]


@dataclass(frozen=True, slots=True)
class Configuration:
    """What the files say, each validated."""

    keys: KeyRing | None = None
    routes: RouteTable | None = None
    canned: dict[str, str] | None = None
    admin: AdminKey | None = None


def _named(path: str, exc: BaseException) -> str:
    """One line naming the file (the loaders' own messages mostly start with it)."""
    line = " ".join(str(exc).split())
    return line if line.startswith(str(path)) else f"{path}: {line}"


def _load_keys(path: str) -> KeyRing:
    return KeyRing.load(path)


def _load_canned(path: str) -> dict[str, str]:
    return load_canned(path)


def unset_key_variable(table: RouteTable, path: str) -> str | None:
    """A target's `api_key_env` that names no set variable (it would send no key: every
    request refused upstream, the client blamed), as one line; None when all are set."""
    for target in table.targets.values():
        variable = target.api_key_env
        if variable and not os.environ.get(variable):
            return (
                f"{path}: [targets.{target.name}] api_key_env: {variable} is not set (or empty) "
                "in the environment"
            )
    return None


def _problems(files: ConfigFiles) -> tuple[Configuration, list[str]]:
    keys = routes = canned = admin = None
    problems: list[str] = []
    if files.api_keys:
        try:
            keys = _load_keys(files.api_keys)
        except (OSError, ValueError) as exc:
            problems.append(_named(files.api_keys, exc))
    if files.routes:
        try:
            routes = load_routes(files.routes)
        except (OSError, ValueError) as exc:
            problems.append(_named(files.routes, exc))
        unset = unset_key_variable(routes, files.routes) if routes is not None else None
        if unset is not None:
            problems.append(unset)
            routes = None
    if files.canned_answers:
        try:
            canned = _load_canned(files.canned_answers)
        except (OSError, ValueError) as exc:
            problems.append(_named(files.canned_answers, exc))
    if files.admin_key:
        try:
            admin = AdminKey.from_file(files.admin_key)
        except ValueError as exc:
            problems.append(str(exc))
        except OSError as exc:
            problems.append(_named(files.admin_key, exc))
    return Configuration(keys, routes, canned, admin), problems


def load_files(files: ConfigFiles) -> Configuration:
    """Every file, validated; ValueError (the first problem, one line) if any is wrong."""
    config, problems = _problems(files)
    if problems:
        raise ValueError(problems[0])
    return config


def check_files(files: ConfigFiles) -> list[str]:
    """Every problem in the files, one line each (`firsttoken check`); [] when all are valid."""
    return _problems(files)[1]


def unmatched_routes(files: ConfigFiles) -> list[str]:
    """A key's `routes` entry that matches no route of the routes file: most likely a typo
    (the key is then refused that route), said as a warning; [] unless both files are valid."""
    config = _problems(files)[0]
    if config.keys is None or config.routes is None:
        return []
    names = list(config.routes.routes)
    warnings = []
    for key in config.keys.keys():
        for pattern in key.routes or ():
            if not any(ApiKey(key.name, routes=(pattern,)).may_use(n) for n in names):
                warnings.append(
                    f"{files.api_keys}: key {key.name!r}: routes entry {pattern!r} matches no "
                    f"route of {files.routes} ({', '.join(names)})"
                )
    return warnings


def ineffective(config: Configuration, models: list[str], now: float) -> list[str]:
    """Settings that load but cannot take effect, one line each, for a warning at start and
    at each reload (`config.ineffective`): a key's `routes` entry that matches no route, a
    `budget` where no target has a price, a `handoff` onto targets that cannot continue, a
    key already expired. `models`: the routes (model names) served, from the routes file or
    the engine."""
    lines = []
    table = config.routes
    if table is not None:
        models = list(table.routes)
        for route in table.routes.values():
            if route.handoff is None:
                continue
            if all(table.targets[t].continuation == "none" for t in route.targets):
                lines.append(
                    f"[models.{route.name}] handoff: every target of the route has "
                    'continuation = "none", so none can take the answer over: '
                    f"{route.handoff.source!r} answers alone"
                )
    priced = table is not None and any(t.price is not None for t in table.targets.values())
    for key in config.keys.keys() if config.keys is not None else ():
        where = f"key {key.name!r}"
        for pattern in key.routes or ():
            if not any(ApiKey(key.name, routes=(pattern,)).may_use(n) for n in models):
                lines.append(
                    f"{where}: routes entry {pattern!r} matches no route ({', '.join(models)})"
                )
        if key.budget is not None and not priced:
            lines.append(f"{where}: budget: no target has a price, so nothing is ever spent")
        if key.expires_at is not None and key.expires_at <= now:
            lines.append(f"{where}: expires_at is past: every request gets 401 key_expired")
    return list(dict.fromkeys(lines))  # a name's two secrets say it once


def unpriced_targets(files: ConfigFiles) -> list[str]:
    """What the routes file leaves free: each target without a `price` (its tokens cost 0),
    or one line when no target has a price; [] when every target has one, or the file is bad."""
    config = _problems(files)[0]
    if config.routes is None:
        return []
    free = [n for n, t in config.routes.targets.items() if t.price is None]
    if len(free) == len(config.routes.targets):
        return [f"{files.routes}: no target has a price: every answer costs 0"]
    return [f"{files.routes}: [targets.{n}] has no price: its tokens cost 0" for n in free]


def _fingerprint(paths: list[str]) -> tuple[bytes | None, ...]:
    """The files' contents, as digests (None: unreadable now)."""
    prints: list[bytes | None] = []
    for path in paths:
        try:
            prints.append(hashlib.sha256(Path(path).read_bytes()).digest())
        except OSError:
            prints.append(None)
    return tuple(prints)


class Reloader:
    """Swaps a new configuration into a running gateway (see the module's docstring)."""

    def __init__(
        self,
        files: ConfigFiles,
        gateway: Gateway,
        *,
        watch: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.files = files
        self.gateway = gateway
        self.watch = watch
        self.clock = clock  # Unix time, for the loaded timestamp
        engine = gateway.engine
        self.canned = engine if isinstance(engine, CachedEngine) and engine.canned else None
        inner = engine.inner if isinstance(engine, CachedEngine) else engine
        self.routes = inner if isinstance(inner, LiveRoutes) and files.routes else None
        self.results = {"ok": 0, "failed": 0}
        self.loaded_at = clock()
        self._seen = _fingerprint(files.paths())
        self._asked = anyio.Event()

    def request(self) -> None:
        """Reload soon (SIGHUP: called by the loop's signal handler, in the loop's thread)."""
        self._asked.set()

    def warn_ineffective(self, config: Configuration) -> None:
        """One `config.ineffective` warning per setting that cannot take effect."""
        models = list(getattr(self.gateway.engine, "models", ()))
        lines = ineffective(config, models, self.clock())
        if self.watch and not self.files.paths():
            lines.insert(
                0, "--watch-config: no file to watch (--api-keys, --routes, --canned-answers)"
            )
        for line in lines:
            log_event("config.ineffective", logging.WARNING, note=line)

    def running(self) -> Configuration:
        """What the gateway runs now, as a Configuration."""
        table = self.routes.current.table if self.routes is not None else None
        return Configuration(self.gateway.admission.keys, table)

    async def run(self) -> None:
        """Reload when asked, or (with `watch`) when a file's contents change; close retired
        targets once idle. Until cancelled."""
        self.warn_ineffective(self.running())
        while True:
            with anyio.move_on_after(WATCH_S):
                await self._asked.wait()
            asked = self._asked.is_set()
            if asked:
                self._asked = anyio.Event()
            if asked or (self.watch and self.changed()):
                await self.reload("signal" if asked else "watch")
            if self.routes is not None:
                await self.routes.sweep()

    def changed(self) -> bool:
        """Whether a file's contents differ from those last loaded or tried (a bad file is
        said once, not every second)."""
        return _fingerprint(self.files.paths()) != self._seen

    async def reload(self, why: str = "signal") -> bool:
        """Load, validate and swap in the files' configuration; False (nothing changed, one
        `config.reload_failed` line) when any of it is wrong."""
        self._seen = _fingerprint(self.files.paths())
        started = time.perf_counter()
        try:
            config = load_files(self.files)
            self._refuse_currency_change(config)
            prepared = None
            if self.routes is not None and config.routes is not None:
                prepared = await self.routes.prepare(config.routes)
        except Exception as exc:
            self.results["failed"] += 1
            # Not a validation error: a new target that could not start (the routes file's).
            line = str(exc) if isinstance(exc, ValueError) else _named(self.files.routes or "", exc)
            log_event("config.reload_failed", logging.ERROR, trigger=why, error=line)
            return False
        said: dict[str, Any] = {"trigger": why}
        if config.keys is not None:
            # A budget's new period starts from what the ledger says was spent in it (its
            # count is kept apart from the old period's, so this may go first).
            carried = await self.gateway.admission.carry_spend(config.keys)
            if carried:
                said["budgets_carried"] = {name: money_text(p) for name, p in carried.items()}
        # One step from here: no await until every part is swapped.
        if config.keys is not None:
            said.update(self._swap_keys(config.keys))
        if prepared is not None and self.routes is not None:
            old = self.routes.current
            retired = self.routes.swap(prepared)
            # New prices from here: a request is priced when it ends, at its targets' prices.
            self.gateway.admission.ledger.price(prepared.table, prepared.routes)
            said["routes"] = list(prepared.models)
            added = [t for t in prepared.targets if old.targets.get(t) is not prepared.targets[t]]
            if added:
                said["targets_new"] = added
            if retired:
                said["targets_retired"] = retired
        if config.admin is not None:
            changed = not config.admin.same_as(self.gateway.admin)
            self.gateway.admin = config.admin
            if changed:
                said["admin_key"] = "changed"
        if config.canned is not None and self.canned is not None:
            self.canned.canned = config.canned
            said["canned_answers"] = len(config.canned)
        self.results["ok"] += 1
        self.loaded_at = self.clock()
        said["took_ms"] = round((time.perf_counter() - started) * 1000, 3)
        log_event("config.reloaded", **said)
        self.warn_ineffective(self.running())
        return True

    def _refuse_currency_change(self, config: Configuration) -> None:
        """ValueError when the routes file's `currency` changes while a key has a budget: its
        amount and what its period spent so far are in the old currency, and a count in two
        currencies means nothing. Such a change takes a restart (then each budget counts
        what was spent in the new currency alone)."""
        if config.routes is None or self.routes is None:
            return
        now, new = self.gateway.admission.ledger.currency, config.routes.currency
        if new == now:
            return
        ring = config.keys if config.keys is not None else self.gateway.admission.keys
        budgeted = [k.name for k in ring.keys() if k.budget is not None] if ring else []
        if budgeted:
            raise ValueError(
                f"{self.files.routes}: currency: {now} -> {new} while key {budgeted[0]!r} has "
                f"a budget counted in {now}; change the currency with a restart"
            )

    def _swap_keys(self, ring: KeyRing) -> dict[str, object]:
        gw = self.gateway
        old = gw.admission.keys
        gw.admission.keys = ring
        budget = gw.registry.budget
        if budget is not None:
            budget.per_key = ring.resume_limits()
        names = ring.names()
        for name in names:  # a new key's series from 0, as at start
            gw.metrics.count_key_tokens(key_label(name), Usage())

        def revoked(stream: Stream) -> bool:
            ticket = stream.ticket
            key = getattr(ticket, "key", None)
            if key is None or not key.digest:
                return False
            now = ring.holds(key)
            return now is None or now.disabled

        # Streams admitted but not yet registered are asked as they start (`registry.revoked`).
        ended = gw.registry.end_where(revoked, key_revoked())
        said: dict[str, object] = {"keys": len(ring.keys())}
        if old is not None:
            gone = sorted(set(old.names()) - set(names))
            if gone:
                said["keys_removed"] = gone
        if ended:
            said["streams_revoked"] = ended
        return said

    def collect(self) -> Iterator[Metric]:
        reloads = CounterMetricFamily(
            "firsttoken_config_reloads",
            "Reloads of the keys, routes and canned answers files, by result.",
            labels=["result"],
        )
        for result, count in self.results.items():
            reloads.add_metric([result], count)
        yield reloads
        yield GaugeMetricFamily(
            "firsttoken_config_loaded_timestamp_seconds",
            "When the running configuration was loaded (Unix time): at start or the last "
            "reload that took.",
            value=self.loaded_at,
        )
