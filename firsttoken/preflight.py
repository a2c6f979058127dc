"""Before the server binds: what the settings point at must answer — files parse, Redis
answers PING, some upstream answers GET /models — so a mistake is one line at start, not a
traceback or a server that fails on its first request.

Settings themselves (ranges, choices, files that exist) are checked in `config`; this module
is what needs the world.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import fields
from urllib.parse import urlsplit, urlunsplit

from firsttoken.config import Settings, flag

__all__ = ["StartupError", "describe", "preflight", "redact"]


class StartupError(Exception):
    """The server cannot start; `str()` is the line a person reads."""


def preflight(settings: Settings) -> None:
    """Raise StartupError with one line when something the settings name does not work."""
    if settings.ssl_certfile and settings.ssl_keyfile:
        _tls(settings.ssl_certfile, settings.ssl_keyfile)
    if settings.api_keys:
        _keys(settings.api_keys)
    if settings.canned_answers:
        _canned(settings.canned_answers)
    if settings.routes:
        _routes(settings, settings.routes)
    if settings.redis:
        _redis(settings.redis, cluster=settings.redis_cluster)
    if settings.usage_db:
        _usage_db(settings.usage_db)
    if settings.engine == "openai" and settings.upstream:
        _upstreams(settings)


def _tls(certfile: str, keyfile: str) -> None:
    """The pair must load as uvicorn will load it, once per worker; an encrypted key is
    refused here rather than left to OpenSSL, which would ask for its password on the terminal."""
    import ssl

    def no_password() -> bytes:
        raise StartupError(f"--ssl-keyfile {keyfile}: the key is encrypted; give it unencrypted")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=no_password)
    except ssl.SSLError as exc:
        why = exc.reason or "not PEM"  # OpenSSL names a mismatch; a wrong file is "PEM lib"
        raise StartupError(
            f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot load them ({why}); "
            "both must be PEM, and the key the certificate's"
        ) from exc
    except OSError as exc:
        raise StartupError(f"--ssl-certfile {certfile}: {_file_error(exc, certfile)}") from exc


def _keys(path: str) -> None:
    from firsttoken.admission.keys import KeyRing

    try:
        KeyRing.load(path)
    except (OSError, ValueError) as exc:  # TOMLDecodeError is a ValueError
        raise StartupError(f"--api-keys {path}: {_file_error(exc, path)}") from exc


def _canned(path: str) -> None:
    from firsttoken.engines.cache import load_canned

    try:
        load_canned(path)
    except (OSError, ValueError) as exc:
        raise StartupError(f"--canned-answers {path}: {_file_error(exc, path)}") from exc


def _routes(settings: Settings, path: str) -> None:
    from firsttoken.reload import unset_key_variable
    from firsttoken.routing.config import RoutesError, load_routes

    try:
        table = load_routes(path)
    except RoutesError as exc:
        raise StartupError(f"--routes {exc}") from exc
    unset = unset_key_variable(table, path)
    if unset is not None:  # as a reload and `firsttoken check` refuse it
        raise StartupError(f"--routes {unset}")
    # Beside --routes the --synthetic-* settings reach only the file's synthetic targets, and
    # a pace only those that set none of their own: given where nothing reads them, refused.
    # (Told by value: a flag typed equal to its default cannot be told from none.)
    synthetic = [t for t in table.targets.values() if t.kind == "synthetic"]
    for f in fields(Settings):
        if f.name not in _SYNTHETIC_OWN or getattr(settings, f.name) == f.default:
            continue
        own = _SYNTHETIC_OWN[f.name]
        if any(own is None or getattr(t, own) is None for t in synthetic):
            continue
        which = "a synthetic target" + (f" without its own {own}" if own else "")
        raise StartupError(
            f"{flag(f.name)}: takes effect only on {which} of --routes; {path} has none"
        )


# The server's settings a routed synthetic target reads: each with the target's own field
# that overrides it (None: none does).
_SYNTHETIC_OWN: dict[str, str | None] = {
    "synthetic_ttft_ms": "ttft_ms",
    "synthetic_itl_ms": "itl_ms",
    "synthetic_style": None,
}


def _file_error(exc: Exception, path: str) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, tomllib.TOMLDecodeError):
        return f"not valid TOML ({exc})"
    return str(exc).removeprefix(f"{path}: ")


def _redis(url: str, *, cluster: bool = False) -> None:
    import redis
    import redis.exceptions

    shown = redact(url)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        try:
            client.ping()
            info = client.info()
            version = str(info.get("redis_version", "0"))
            clustered = bool(info.get("cluster_enabled", 0))
        finally:
            client.close()
    except ValueError as exc:  # from_url: a URL redis-py cannot use
        raise StartupError(f"--redis {shown}: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        why = _redis_why(exc)
        raise StartupError(f"--redis {shown}: Redis did not answer PING: {why}") from exc
    major = int(version.split(".", 1)[0]) if version.split(".", 1)[0].isdigit() else 0
    if major < 5:
        # Streams (XADD, XREAD) arrived in Redis 5.
        raise StartupError(f"--redis {shown}: Redis {version} is too old, 5.0 or later needed")
    # Each client would fail on every call the other way: MOVED, or CLUSTER commands refused.
    if cluster and not clustered:
        raise StartupError(f"--redis {shown}: not a Redis Cluster node (--redis-cluster is on)")
    if clustered and not cluster:
        raise StartupError(
            f"--redis {shown}: this node is part of a Redis Cluster; add --redis-cluster"
        )


def _usage_db(url: str) -> None:
    """The ledger must open (its schema created or migrated) before the server listens: a
    server that cannot record usage would serve, bill nothing, and queue records forever."""
    import anyio

    from firsttoken.ledger.stores import open_store

    store = open_store(url)

    async def probe() -> None:
        try:
            with anyio.fail_after(10):
                await store.open()
        finally:
            await store.close()

    try:
        anyio.run(probe)
    except Exception as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise StartupError(f"--usage-db {store.shown}: the ledger did not open: {why}") from exc


def _redis_why(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    # redis-py says "Error 111 connecting to host:port. Connection refused."
    said = re.fullmatch(r"Error -?\d+ connecting to \S+?\. (.*)", text)
    text = (said.group(1) if said else text).rstrip(".")
    return text + " (is it a Redis server?)" if "protocol error" in text.lower() else text


def _upstreams(settings: Settings) -> None:
    import httpx

    from firsttoken.engines.remote import upstream_base

    assert settings.upstream is not None
    headers = {"accept-encoding": "identity"}
    if settings.upstream_api_key:
        headers["authorization"] = f"Bearer {settings.upstream_api_key}"
    timeout = httpx.Timeout(
        settings.upstream_read_timeout_s, connect=settings.upstream_connect_timeout_s
    )
    errors: list[str] = []
    for url in (u for u in settings.upstream.split(",") if u.strip()):
        base = upstream_base(url)
        try:
            resp = httpx.get(base + "/models", headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            errors.append(f"{redact(base)}: {_http_why(exc)}")
            continue
        if resp.status_code == 200:
            return  # the relay reads the models itself when it starts
        errors.append(f"{redact(base)}: HTTP {resp.status_code}")
    raise StartupError("--upstream: no upstream answered GET /models (" + "; ".join(errors) + ")")


def _http_why(exc: Exception) -> str:
    import httpx

    if isinstance(exc, httpx.ConnectTimeout):
        return "connect timed out"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    text = re.sub(r"^\[Errno -?\d+\] ", "", str(exc).strip())
    return text or type(exc).__name__


def describe(exc: BaseException) -> str:
    """One line for an exception: the innermost cause that says something."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, StartupError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return exc.strerror + where
    cause = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    if not text and cause is not None:
        return describe(cause)
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))
