"""From settings to the engine the server runs: one engine, or routes over many. Every kind
of engine is built here, by `engine_of`, whether the server runs it alone or a route does."""

from __future__ import annotations

import os
from collections.abc import Mapping

from firsttoken.config import Settings
from firsttoken.engines import Engine
from firsttoken.routing.config import ModelRoute, RouteTable, TargetConfig, load_routes
from firsttoken.routing.engine import RoutedEngine
from firsttoken.routing.live import LiveRoutes
from firsttoken.routing.target import Target

__all__ = ["build_engine", "build_routes", "engine_of", "live_routes", "routes_in", "shorthand"]

# The shorthand has no total deadline (a relay never had one): a day stands for none.
_NO_TOTAL_S = 86_400.0
# How long past the router's own deadlines the upstream client waits for bytes: a backstop
# only (the router cancels a leg at its phase deadline).
_READ_SLACK_S = 5.0


def build_engine(settings: Settings) -> Engine:
    """The server's engine: routes (`--routes`, or `--engine openai --upstream` as a
    one-route shorthand), else the one engine `--engine` names; the prompt cache around it."""
    engine: Engine
    if settings.routes:  # a file a reload may change: swappable routes
        engine = live_routes(load_routes(settings.routes), settings)
    elif settings.engine == "openai":
        engine = build_routes(shorthand(settings), settings)
    else:
        engine = engine_of(settings.engine, settings)
    if settings.cache_ttl_s > 0 or settings.canned_answers:
        from firsttoken.engines.cache import CachedEngine

        engine = CachedEngine(engine, settings)
    return engine


def routes_in(engine: Engine) -> RoutedEngine | LiveRoutes | None:
    """The routes the server's engine holds (under the answer cache, when there is one): the
    app registers their metrics and hands them its tracer. None: a single engine."""
    from firsttoken.engines.cache import CachedEngine

    inner = engine.inner if isinstance(engine, CachedEngine) else engine
    return inner if isinstance(inner, RoutedEngine | LiveRoutes) else None


def shorthand(settings: Settings) -> RouteTable:
    """`--engine openai --upstream A,B`: one route over `upstream-1`, `upstream-2`, … that
    serves whatever models they list, balanced by streams in flight."""
    assert settings.upstream
    urls = [u.strip() for u in settings.upstream.split(",") if u.strip()]
    targets = {
        f"upstream-{i}": TargetConfig(
            name=f"upstream-{i}",
            kind="openai",
            url=url,
            connect_timeout_s=settings.upstream_connect_timeout_s,
            first_token_timeout_s=settings.upstream_read_timeout_s,
            idle_timeout_s=settings.upstream_read_timeout_s,
            total_timeout_s=_NO_TOTAL_S,
            eject_s=5.0,
        )
        for i, url in enumerate(urls, 1)
    }
    name = "default"
    route = ModelRoute(
        name=name,
        targets=tuple(targets),
        max_splices=0,
        balance="least_busy",
        passthrough=True,
    )
    return RouteTable(targets=targets, routes={name: route})


def build_routes(
    table: RouteTable, settings: Settings, env: Mapping[str, str] | None = None
) -> RoutedEngine:
    env = os.environ if env is None else env
    targets = {
        name: Target(cfg, engine_of(cfg.kind, settings, cfg, env))
        for name, cfg in table.targets.items()
    }
    return RoutedEngine(table, targets)


def live_routes(
    table: RouteTable, settings: Settings, env: Mapping[str, str] | None = None
) -> LiveRoutes:
    """`build_routes`, in a holder that a reload swaps new routes into (`LiveRoutes`)."""
    env = os.environ if env is None else env
    return LiveRoutes(
        build_routes(table, settings, env),
        lambda cfg: Target(cfg, engine_of(cfg.kind, settings, cfg, env)),
    )


def engine_of(
    kind: str,
    settings: Settings,
    cfg: TargetConfig | None = None,
    env: Mapping[str, str] | None = None,
) -> Engine:
    """One engine of `kind`: a route's target (`cfg`: its URL, model and pace, its key read
    from `env`), or, without `cfg`, the one engine `--engine` names (the settings say all)."""
    if kind == "synthetic":
        from firsttoken.engines.synthetic import SyntheticEngine

        if cfg is not None:  # a target: its own pace, else the server's
            return SyntheticEngine(
                ttft_ms=settings.synthetic_ttft_ms if cfg.ttft_ms is None else cfg.ttft_ms,
                itl_ms=settings.synthetic_itl_ms if cfg.itl_ms is None else cfg.itl_ms,
                style=settings.synthetic_style,
            )
        if settings.batch_max > 0:
            from firsttoken.engines.batching import BatchingEngine

            return BatchingEngine(settings)
        return SyntheticEngine(
            ttft_ms=settings.synthetic_ttft_ms,
            itl_ms=settings.synthetic_itl_ms,
            style=settings.synthetic_style,
            fail_rate=settings.synthetic_fail_rate,
        )
    if kind == "llamacpp":
        from firsttoken.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(settings, path=None if cfg is None else cfg.model)
    if cfg is None or cfg.url is None or kind not in ("openai", "anthropic"):
        raise ValueError(f"unknown engine {kind!r}")  # a relay is a route's target
    env = os.environ if env is None else env
    read_timeout = max(cfg.first_token_timeout_s, cfg.idle_timeout_s) + _READ_SLACK_S
    if kind == "openai":
        from firsttoken.engines.relay import RelayEngine

        return RelayEngine(
            cfg.url,
            api_key=cfg.api_key(env) or settings.upstream_api_key,
            model=cfg.model,
            connect_timeout_s=cfg.connect_timeout_s,
            read_timeout_s=read_timeout,
            completions_template="chatml" if cfg.continuation == "completions" else None,
            errors=settings.upstream_errors,
            serves=cfg.serves,
        )
    from firsttoken.engines.anthropic_relay import AnthropicRelay

    return AnthropicRelay(
        cfg.url,
        api_key=cfg.api_key(env),
        model=cfg.model,
        connect_timeout_s=cfg.connect_timeout_s,
        read_timeout_s=read_timeout,
        errors=settings.upstream_errors,
    )
