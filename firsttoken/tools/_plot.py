"""--plot: per-chunk arrival timeline and latency histograms (matplotlib, imported lazily)."""

from __future__ import annotations

from pathlib import Path

from firsttoken.tools._measure import StreamResult

__all__ = ["NEEDS", "plot"]

NEEDS = "--plot needs matplotlib: pip install -c constraints.txt matplotlib"  # pinned there


def plot(results: list[StreamResult], path: str | Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError as exc:  # an optional extra, not a dependency
        raise SystemExit(NEEDS) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_ttft, ax_itl) = plt.subplots(3, 1, figsize=(10, 11))
    # A buffered stream shows up as vertical steps: many chunks at one instant.
    for i, r in enumerate(results):
        ts = [e.t * 1000 for e in r.content]
        if ts:
            ax_t.step(
                ts,
                range(1, len(ts) + 1),
                where="post",
                lw=1,
                label=f"stream {i}" if len(results) <= 10 else None,
            )
    ax_t.set_title(f"chunk arrivals  {title}")
    ax_t.set_xlabel("ms since each request started")
    ax_t.set_ylabel("chunks received")
    if 1 < len(results) <= 10:
        ax_t.legend(fontsize="small")

    ttfts = [r.ttft * 1000 for r in results if r.ttft is not None]
    ax_ttft.hist(ttfts, bins=min(50, max(5, len(ttfts))), color="tab:blue")
    ax_ttft.set_title(f"TTFT (n={len(ttfts)})")
    ax_ttft.set_xlabel("ms")

    itls = [i * 1000 for r in results for i in r.intervals]
    ax_itl.hist(itls, bins=60, color="tab:orange")
    ax_itl.set_title(f"inter-chunk interval (n={len(itls)})")
    ax_itl.set_xlabel("ms")
    ax_itl.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
