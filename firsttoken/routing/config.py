"""The routes file: which engines (targets) stand behind which model names (routes).

A TOML file read at start and on each reload (firsttoken/reload.py). Every mistake is refused
as one line naming the file, the table and the field, because a route that silently falls
back to something else sends a user's prompt to a model they did not choose.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from firsttoken.pricing import Price, parse_money

__all__ = [
    "CONTINUATIONS",
    "KINDS",
    "SERVES",
    "Handoff",
    "ModelRoute",
    "RouteTable",
    "RoutesError",
    "ShortPrompts",
    "TargetConfig",
    "load_routes",
    "parse_routes",
]

KINDS = ("openai", "anthropic", "llamacpp", "synthetic")
# How a target continues a cut answer. Our own engines (synthetic, llamacpp) continue
# natively; "none" is never spliced onto.
CONTINUATIONS = ("vllm", "anthropic", "completions", "none", "native")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/-")


class RoutesError(ValueError):
    """The routes file is wrong; `str()` is the one line a person reads."""


@dataclass(frozen=True, slots=True)
class TargetConfig:
    """One engine the gateway can send to."""

    name: str
    kind: str
    url: str | None = None
    model: str | None = None  # the name the target knows; None: the route's name
    api_key_env: str | None = None
    continuation: str = "none"
    connect_timeout_s: float = 5.0
    first_token_timeout_s: float = 30.0
    idle_timeout_s: float = 30.0  # longest silence between two chunks once the answer began
    total_timeout_s: float = 600.0
    max_concurrency: int | None = None  # None: no limit
    queue_timeout_s: float = 30.0
    # Passive health (as Envoy's outlier detection): ejected after this many failures in a
    # row, for eject_s (longer each time it is ejected again), then one real request probes.
    eject_after: int = 3
    eject_s: float = 10.0
    health_check_interval_s: float = 0.0  # active: GET {url}/models this often (0: off)
    # kind synthetic: the engine's pace (None: the server's --synthetic-* settings)
    ttft_ms: float | None = None
    itl_ms: float | None = None
    price: Price | None = None  # None: no price given, its tokens cost 0
    # kind openai: OpenAI's other endpoints it answers (`SERVES`); one it does not name is
    # refused here, never sent to an upstream that would 404 it (docs/endpoints.md).
    serves: tuple[str, ...] = ("embeddings",)

    def api_key(self, env: Mapping[str, str]) -> str | None:
        return env.get(self.api_key_env) if self.api_key_env else None


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """What clients send as `model`: an ordered list of targets."""

    name: str
    targets: tuple[str, ...]
    max_splices: int = 1
    # "order": the first healthy target takes every request (failover); "least_busy": the
    # one with the fewest streams in flight (the --upstream shorthand's balancing).
    balance: str = "order"
    # Also route these names here (the shorthand: whatever models its upstreams list).
    aliases: tuple[str, ...] = ()
    passthrough: bool = False  # the client's model name goes to the targets as it is
    handoff: Handoff | None = None
    short_prompts: ShortPrompts | None = None
    # A continuation slower to its first token than 3x its target's usual (at least 200 ms)
    # is asked of the next target too; the first to answer carries on.
    hedge: bool = True


@dataclass(frozen=True, slots=True)
class Handoff:
    """`handoff = { from = "edge", after_tokens = N }`: a small, fast target starts the
    answer; after N tokens the route's own targets continue it (a splice that does not use up
    `max_splices`)."""

    source: str  # the `from` target
    after_tokens: int
    at: str = "tokens"  # "tokens": right after N; "sentence": at the first sentence end after N
    fallback: bool = True  # the center cannot take it: the `from` target finishes the answer
    # The center asked for the conversation at the start (one token, thrown away): its prefix
    # cache warmed, and its answer says when it is ready (routing/seam.py).
    prefill: bool = True
    # The edge's text leaves at most one token every pace_ms until the center's text comes;
    # what it holds back covers the center's delay at the seam (0: off).
    pace_ms: float = 50.0


@dataclass(frozen=True, slots=True)
class ShortPrompts:
    """`short_prompts = { target = "edge", max_prompt_tokens = N }`: a prompt of at most N
    tokens (counted here) goes to `target` first, the route's targets after it."""

    target: str
    max_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RouteTable:
    targets: Mapping[str, TargetConfig]
    routes: Mapping[str, ModelRoute]  # in the file's order: the first is the default
    currency: str = "USD"  # of every target's price

    @property
    def default(self) -> ModelRoute:
        return next(iter(self.routes.values()))


# field: (type, check) — a check answers None or what is wrong
_NUMBER = (int, float)


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _at_least_1(v: Any) -> str | None:
    return None if v >= 1 else "must be >= 1"


def _url(v: str) -> str | None:
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http(s)://HOST[:PORT][/PATH] URL"
    try:
        parts.port  # noqa: B018  (raises on a port out of range)
    except ValueError:
        return "has a bad port"
    return None


def _one_of(*allowed: str) -> Any:
    def check(v: str) -> str | None:
        return None if v in allowed else "must be one of " + ", ".join(allowed)

    return check


_TARGET_FIELDS: dict[str, tuple[Any, Any]] = {
    "kind": (str, _one_of(*KINDS)),
    "url": (str, _url),
    "model": (str, None),
    "api_key_env": (str, None),
    "continuation": (str, _one_of("vllm", "anthropic", "completions", "none")),
    "connect_timeout_s": (_NUMBER, _positive),
    "first_token_timeout_s": (_NUMBER, _positive),
    "idle_timeout_s": (_NUMBER, _positive),
    "total_timeout_s": (_NUMBER, _positive),
    "max_concurrency": (int, _at_least_1),
    "queue_timeout_s": (_NUMBER, _non_negative),
    "eject_after": (int, _at_least_1),
    "eject_s": (_NUMBER, _positive),
    "health_check_interval_s": (_NUMBER, _non_negative),
    "ttft_ms": (_NUMBER, _non_negative),
    "itl_ms": (_NUMBER, _non_negative),
    "price": (dict, None),
    "serves": (list, None),
}
SERVES = ("embeddings", "moderations", "images")
_ROUTE_FIELDS: dict[str, tuple[Any, Any]] = {
    "targets": (list, None),
    "max_splices": (int, _non_negative),
    "balance": (str, _one_of("order", "least_busy", "session")),
    "handoff": (dict, None),
    "short_prompts": (dict, None),
    "hedge": (bool, None),
}
_HANDOFF_FIELDS: dict[str, tuple[Any, Any]] = {
    "from": (str, None),
    "after_tokens": (int, _at_least_1),
    "at": (str, _one_of("tokens", "sentence")),
    "fallback": (bool, None),
    "prefill": (bool, None),
    "pace_ms": (_NUMBER, _non_negative),
}
_SHORT_FIELDS: dict[str, tuple[Any, Any]] = {
    "target": (str, None),
    "max_prompt_tokens": (int, _at_least_1),
}


def load_routes(path: str | Path) -> RouteTable:
    """Read and check a routes file; raises RoutesError (one line, naming the file)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RoutesError(f"{path}: cannot read: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RoutesError(f"{path}: not TOML: {exc}") from None
    return parse_routes(data, str(path))


def parse_routes(data: Mapping[str, Any], source: str = "routes") -> RouteTable:
    def fail(where: str, message: str) -> RoutesError:
        return RoutesError(f"{source}: {where}: {message}")

    unknown = sorted(set(data) - {"targets", "models", "currency"})
    if unknown and not isinstance(data[unknown[0]], dict):  # a field: `curency = "EUR"`
        close = difflib.get_close_matches(unknown[0], ["currency"], n=1)
        hint = "; did you mean currency?" if close else ""
        raise fail(unknown[0], f"unknown field (known: currency, [targets.*], [models.*]){hint}")
    if unknown:
        raise fail(f"[{unknown[0]}]", "unknown table (expected [targets.*], [models.*])")
    raw_targets = _table(data, "targets", source)
    raw_routes = _table(data, "models", source)
    if not raw_targets:
        raise fail("[targets]", "at least one target is needed")
    if not raw_routes:
        raise fail("[models]", "at least one model route is needed")

    targets = {name: _target(name, raw, fail) for name, raw in raw_targets.items()}
    routes = {name: _route(name, raw, targets, fail) for name, raw in raw_routes.items()}
    return RouteTable(targets=targets, routes=routes, currency=_currency(data, fail))


# Where and what went wrong, as the error to raise (`parse_routes`'s `fail`).
_Fail = Callable[[str, str], RoutesError]


def _target(name: str, raw: Any, fail: _Fail) -> TargetConfig:
    """One `[targets.NAME]` table."""
    where = f"[targets.{name}]"
    _check_name(name, where, fail)
    if not isinstance(raw, dict):
        raise fail(where, "must be a table")
    values = _fields(raw, _TARGET_FIELDS, where, fail)
    if "price" in values:
        values["price"] = _price(values["price"], f"{where} price", fail)
    kind = values.get("kind")
    if kind is None:
        raise fail(f"{where} kind", "is required (" + " | ".join(KINDS) + ")")
    if kind in ("openai", "anthropic") and "url" not in values:
        raise fail(f"{where} url", f"is required for kind {kind!r}")
    if kind in ("llamacpp", "synthetic"):
        if "url" in values:
            raise fail(f"{where} url", f"kind {kind!r} runs in this process: no url")
        given = values.pop("continuation", "native")
        if given not in ("none", "native"):
            raise fail(
                f"{where} continuation",
                f"kind {kind!r} continues natively; only 'none' turns that off",
            )
        values["continuation"] = given
    elif "continuation" not in values:
        values["continuation"] = "anthropic" if kind == "anthropic" else "none"
    elif kind == "anthropic" and values["continuation"] not in ("anthropic", "none"):
        raise fail(f"{where} continuation", "kind 'anthropic' continues by 'anthropic' prefill")
    elif kind == "openai" and values["continuation"] == "anthropic":
        raise fail(
            f"{where} continuation",
            "kind 'openai' continues by 'vllm' or 'completions' (a prefill is 'anthropic's)",
        )
    if kind != "synthetic":
        for own in ("ttft_ms", "itl_ms"):
            if own in values:
                raise fail(f"{where} {own}", "applies to kind 'synthetic' only")
    if kind in ("llamacpp", "synthetic") and values.get("health_check_interval_s"):
        raise fail(f"{where} health_check_interval_s", f"kind {kind!r} has no URL to check")
    if "serves" in values:
        values["serves"] = _serves(values["serves"], kind, f"{where} serves", fail)
    if kind == "llamacpp" and "model" in values and not Path(values["model"]).is_file():
        raise fail(f"{where} model", f"no such GGUF file: {values['model']!r}")
    return TargetConfig(name=name, **values)


def _route(name: str, raw: Any, targets: Mapping[str, TargetConfig], fail: _Fail) -> ModelRoute:
    """One `[models.NAME]` table, over `targets`."""
    where = f"[models.{name}]"
    _check_name(name, where, fail)
    if not isinstance(raw, dict):
        raise fail(where, "must be a table")
    values = _fields(raw, _ROUTE_FIELDS, where, fail)
    listed = values.get("targets")
    if not listed:
        raise fail(f"{where} targets", "must list at least one target")
    for item in listed:
        if not isinstance(item, str):
            raise fail(f"{where} targets", "must be a list of target names")
        if item not in targets:
            known = ", ".join(targets)
            raise fail(f"{where} targets", f"no target named {item!r} (targets: {known})")
    if len(set(listed)) != len(listed):
        raise fail(f"{where} targets", "lists a target twice")
    values["targets"] = tuple(listed)
    if "handoff" in values:
        raw_handoff = _fields(values["handoff"], _HANDOFF_FIELDS, f"{where} handoff", fail)
        # Not `source`: that names the file in `fail`.
        edge = _known_target(raw_handoff.get("from"), targets, f"{where} handoff.from", fail)
        if "after_tokens" not in raw_handoff:
            raise fail(f"{where} handoff.after_tokens", "is required")
        if edge in listed:
            raise fail(f"{where} handoff.from", "hands off to the route's targets: not one")
        values["handoff"] = Handoff(
            source=edge,
            after_tokens=raw_handoff["after_tokens"],
            at=raw_handoff.get("at", "tokens"),
            fallback=raw_handoff.get("fallback", True),
            prefill=raw_handoff.get("prefill", True),
            pace_ms=raw_handoff.get("pace_ms", 50.0),
        )
    if "short_prompts" in values:
        raw_short = _fields(values["short_prompts"], _SHORT_FIELDS, f"{where} short_prompts", fail)
        _known_target(raw_short.get("target"), targets, f"{where} short_prompts.target", fail)
        if "max_prompt_tokens" not in raw_short:
            raise fail(f"{where} short_prompts.max_prompt_tokens", "is required")
        values["short_prompts"] = ShortPrompts(raw_short["target"], raw_short["max_prompt_tokens"])
    return ModelRoute(name=name, **values)


_PRICE_FIELDS = ("prompt", "completion", "cached_prompt", "cache_write", "reasoning")
# Per million tokens. Far above any model's, and low enough that a request's cost in picos
# stays a 64-bit integer (the ledger's BIGINT) up to ~900 million tokens.
MAX_PRICE = 10_000


def _price(raw: Mapping[str, Any], where: str, fail: Any) -> Price:
    """`price = { prompt = 0.50, completion = 1.50, ... }`, per million tokens, exact."""
    given = {}
    for name, value in raw.items():
        if name not in _PRICE_FIELDS:
            raise fail(f"{where}.{name}", "unknown price (known: " + ", ".join(_PRICE_FIELDS) + ")")
        try:
            given[name] = parse_money(value, "a price")
        except ValueError as exc:
            raise fail(f"{where}.{name}", f"{exc}, not {value!r}") from None
        if given[name] > MAX_PRICE:
            raise fail(
                f"{where}.{name}",
                f"a price per million tokens of at most {MAX_PRICE:,}, not {value!r}",
            )
    return Price.per_million(**given)


def _currency(data: Mapping[str, Any], fail: Any) -> str:
    currency = data.get("currency", "USD")
    if not isinstance(currency, str) or not 1 <= len(currency) <= 16 or not currency.isalnum():
        raise fail("currency", f'must be a currency code such as "USD", not {currency!r}')
    return currency


def _serves(listed: list[Any], kind: str, where: str, fail: Any) -> tuple[str, ...]:
    """`serves = ["embeddings", "moderations", "images"]`: an OpenAI-compatible upstream's
    endpoints (the synthetic engine answers them all itself; the others none)."""
    if kind != "openai":
        raise fail(where, "applies to kind 'openai' only")
    for item in listed:
        if item not in SERVES:
            raise fail(where, f"{item!r} is not one of " + ", ".join(SERVES))
    if len(set(listed)) != len(listed):
        raise fail(where, "names an endpoint twice")
    return tuple(listed)


def _known_target(name: Any, targets: Mapping[str, Any], where: str, fail: Any) -> str:
    if name is None:
        raise fail(where, "is required")
    if name not in targets:
        raise fail(where, f"no target named {name!r} (targets: {', '.join(targets)})")
    return str(name)


def _table(data: Mapping[str, Any], key: str, source: str) -> dict[str, Any]:
    table = data.get(key, {})
    if not isinstance(table, dict):
        raise RoutesError(f"{source}: [{key}]: must be a table of tables")
    return table


def _check_name(name: str, where: str, fail: Any) -> None:
    if not name or len(name) > 128 or not set(name) <= _NAME_CHARS:
        raise fail(where, "a name is 1-128 of A-Z a-z 0-9 . _ : / -")


def _fields(
    raw: Mapping[str, Any], known: Mapping[str, tuple[Any, Any]], where: str, fail: Any
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise fail(f"{where} {key}", "unknown field (known: " + ", ".join(known) + ")")
        kind, check = known[key]
        bad_bool = isinstance(value, bool) and kind is not bool
        if bad_bool or not isinstance(value, kind):
            expected = {
                int: "an integer",
                str: "a string",
                list: "a list",
                bool: "true or false",
                dict: "an inline table { ... }",
            }.get(kind, "a number")
            raise fail(f"{where} {key}", f"must be {expected}, not {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise fail(f"{where} {key}", "must be a finite number")
        complaint = check(value) if check else None
        if complaint:
            raise fail(f"{where} {key}", f"{complaint}, not {value!r}")
        values[key] = float(value) if kind is _NUMBER else value
    return values
