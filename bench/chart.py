"""The PNG: TTFT and inter-chunk distributions per server and level, plus the saturation curve."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import Samples

__all__ = ["draw"]

COLORS = {
    "firsttoken": "#d62728",
    "firsttoken_v1": "#ff9896",
    "firsttoken_w2": "#9467bd",
    "raw_floor": "#7f7f7f",
    "tutorial": "#1f77b4",
    "uvicorn_floor": "#2ca02c",
}


def _ecdf(ax: Any, values: np.ndarray, label: str, color: str) -> None:
    if values.size == 0:
        return
    ax.ecdf(values, label=label, color=color, linewidth=1.4)
    if values.size < 20:  # a few samples: show the points themselves
        xs = np.sort(values)
        ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, "o", color=color, markersize=4)


def draw(
    path: Path,
    samples: Mapping[tuple[str, int], Samples],
    levels: Sequence[int],
    saturation: Sequence[Mapping[str, Any]],
    itl_ms: float,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(1, len(levels))
    fig, axes = plt.subplots(3, cols, figsize=(4.6 * cols, 11), squeeze=False)
    servers = sorted({s for s, _ in samples})
    for j, level in enumerate(levels):
        ttft_ax, gap_ax = axes[0][j], axes[1][j]
        for server in servers:
            s = samples.get((server, level))
            if s is None:
                continue
            color = COLORS.get(server, "black")
            _ecdf(ttft_ax, s.added_ttft_ms, server, color)
            _ecdf(gap_ax, s.gaps_ms, server, color)
        ttft_ax.set_title(f"{level} stream{'s' if level != 1 else ''}: added TTFT")
        ttft_ax.set_xlabel("measured TTFT − engine TTFT (ms)")
        gap_ax.set_title(f"{level} stream{'s' if level != 1 else ''}: inter-chunk gap")
        gap_ax.set_xlabel(f"gap between content events (ms; clipped at {5 * itl_ms:g})")
        gap_ax.axvline(itl_ms, color="black", linestyle=":", linewidth=0.8)
        gap_ax.axvline(2 * itl_ms, color="black", linestyle="--", linewidth=0.8)
        for ax in (ttft_ax, gap_ax):
            ax.set_ylabel("fraction of samples")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        ttft_ax.set_xscale("symlog", linthresh=1.0)
        gap_ax.set_xlim(0, 5 * itl_ms)
    tput_ax, eff_ax = axes[2][0], axes[2][min(1, cols - 1)]
    for server in servers:
        rows = sorted(
            (r for r in saturation if r["server"] == server), key=lambda r: r["concurrency"]
        )
        if not rows:
            continue
        xs = [r["concurrency"] for r in rows]
        color = COLORS.get(server, "black")
        tput_ax.plot(xs, [r["tokens_per_s"] for r in rows], "o-", color=color, label=server)
        eff_ax.plot(
            xs, [r["tokens_per_cpu_s"] or 0 for r in rows], "s--", color=color, label=server
        )
    tput_ax.set_title("saturation: delivered tokens/s")
    eff_ax.set_title("saturation: tokens per server CPU-second")
    steps = sorted({r["concurrency"] for r in saturation})
    for ax in {tput_ax, eff_ax}:
        ax.set_xlabel("concurrent streams")
        ax.set_xscale("log")
        ax.set_xticks(steps, [str(x) for x in steps])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[2][2:]:
        ax.axis("off")
    fig.suptitle("firsttoken bench (shared 2-core machine: compare servers, not absolutes)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
