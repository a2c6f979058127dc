"""How big each workload is: the default (minutes) and `--quick` (seconds, for the smoke test)."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Sizes"]


@dataclass(frozen=True, slots=True)
class Sizes:
    ttft_ms: float = 200.0
    itl_ms: float = 20.0
    tokens: int = 300
    levels: tuple[int, ...] = (1, 100, 500, 1000)  # overhead: concurrent streams
    single_stream_rounds: int = 3  # at 1 stream, run a few in a row for more TTFT samples
    ramp_s: float = 1.0  # streams start evenly over this (no accept-queue stampede)
    saturation: tuple[int, ...] = (250, 500, 1000, 2000)
    # Where issue 12's targets are judged: CPU ratios (saturation) and added TTFT p99 (overhead)
    # at this many streams; every server climbs the saturation steps at least this far.
    target_streams: int = 500
    burst_streams: int = 100  # requested at the same instant (no ramp)
    burst_tokens: int = 50  # only the TTFT counts; short streams keep the rounds cheap
    burst_rounds: int = 3
    # Set-up cost: CPU per new stream, bursts of short streams (only set-up and close count).
    setup_streams: int = 100
    setup_tokens: int = 2
    setup_rounds: int = 20
    idle_streams: int = 10_000
    idle_heartbeat_s: float = 2.0
    idle_ttft_ms: float = 120_000.0  # long enough that no idle stream ever starts its answer
    idle_hold_s: float = 4.0  # streams held open (after all have pinged) to time heartbeat CPU
    abandon_streams: int = 1000
    abandon_light_streams: int = 100  # also at a load every server keeps pace with (diagnosis)
    per_token: tuple[int, int] = (2000, 15)  # per-token cost table: tokens per batch, batches

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            ttft_ms=50.0,
            itl_ms=5.0,
            tokens=20,
            levels=(1, 20),
            single_stream_rounds=1,
            ramp_s=0.1,
            saturation=(20, 40),
            target_streams=20,
            burst_streams=20,
            burst_tokens=10,
            burst_rounds=1,
            setup_streams=20,
            setup_rounds=2,
            idle_streams=100,
            idle_heartbeat_s=0.3,
            idle_hold_s=0.5,
            abandon_streams=30,
            abandon_light_streams=10,
            per_token=(200, 3),
        )

    def scaled_idle(self, streams: int) -> Sizes:
        return replace(self, idle_streams=streams)

    @property
    def stream_s(self) -> float:
        """A whole stream's natural length."""
        return (self.ttft_ms + self.tokens * self.itl_ms) / 1000
