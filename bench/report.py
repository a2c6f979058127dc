"""Turn the figures into ratios, targets and a printed table.

Absolute times on a shared 2-core machine are noise-prone; every absolute figure is printed
beside its ratio to firsttoken before the rewrite (`firsttoken_v1`), to the raw floor, to issue
12's bare uvicorn experiment (`uvicorn_floor`, whose own ratios are printed too) and to
the tutorial stack, measured minutes apart in one run. The targets are issue 12's, as issue 31
changed them: the raw floor has a shared ticker and a higher bar, per-stream work is judged
against the experiment, and two targets are retired (still reported, not judged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench.servers import BASELINE, REDIS, SUBJECT, WORKERS2

__all__ = [
    "compute_ratios",
    "compute_targets",
    "highest_within_itl",
    "kept_pace",
    "render",
    "saturation_point",
    "within_itl",
]

FLOOR, TUTORIAL, EXPERIMENT = "raw_floor", "tutorial", "uvicorn_floor"
OTHERS = (BASELINE, EXPERIMENT, FLOOR, TUTORIAL)  # firsttoken ÷ each of these
# ... and issue 12's experiment ÷ the floor and the tutorial: what a server on uvicorn reaches.
PAIRS = (
    *((SUBJECT, other) for other in OTHERS),
    (EXPERIMENT, FLOOR),
    (EXPERIMENT, TUTORIAL),
    (REDIS, SUBJECT),  # issue 27: the scale-out mode ÷ memory mode
)

# Issue 12's targets (the stream counts come from the sizes: 500, 100 and 1,000 at full size).
CPU_VS_FLOOR_MIN = 0.75  # tokens per server CPU-second ÷ raw floor (issue 31: shared ticker)
CPU_VS_TUTORIAL_MIN = 3.0  # ... ÷ tutorial: retired by issue 31 (it measures the tutorial)
TTFT_P99_VS_FLOOR_MAX = 1.3  # added TTFT p99 at the target step ÷ the floor's
BURST_P50_VS_FLOOR_MAX = 2.0  # added TTFT p50, a burst requested at once ÷ the floor's
W2_TTFT_P99_MAX_MS = 300.0  # TTFT p99 (absolute), 1,000 streams over 1 s, --workers 2
IDLE_KIB_MAX = 12.0  # RSS per waiting stream, heartbeats on
ABANDON_EXCESS_MAX = 0.5  # tokens generated after disconnect, per stream
WORKERS_SPEEDUP_MIN = 1.7  # --workers 2 ÷ 1, capacity: retired by issue 31 on 2 shared cores
# Issue 31: a new stream's work against the experiment's (same uvicorn, none of our features).
SETUP_VS_EXPERIMENT_MAX = 1.3  # server CPU per new stream (setup workload) ÷ the experiment's
BURST_VS_EXPERIMENT_MAX = 1.4  # burst: added TTFT p50 ÷ the experiment's
TOP_TTFT_P99_MAX_MS = 300.0  # TTFT p99, the top saturation step (2,000 over 1 s), one process
# Issue 27: --redis ÷ memory mode, same run.
REDIS_CPU_MIN = 0.7  # tokens per server CPU-second at the target step
REDIS_TTFT_P50_MAX = 1.5  # added TTFT p50 at the target step
KEEPS_PACE = 0.9  # a saturation step counts as kept up if ≥ 90% of the engine's pace arrived

Row = dict[str, Any]
_RATIO_KEYS = ("added_ttft_ms_p50", "added_ttft_ms_p99", "gap_ms_p99", "gap_ms_max")


def _find(rows: Sequence[Row], server: str, concurrency: int) -> Row | None:
    for r in rows:
        if r["server"] == server and r["concurrency"] == concurrency:
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "—"
    if isinstance(x, int):
        return f"{x:,}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _x(r: float | None) -> str:
    return "—" if r is None else f"×{r:.2f}"


def saturation_point(rows: Sequence[Row], server: str, itl_ms: float) -> Row | None:
    """The highest step whose p99 inter-chunk gap stayed within 2×ITL (else the first step)."""
    mine = [r for r in rows if r["server"] == server]
    ok = [r for r in mine if within_itl(r, itl_ms)]
    if ok:
        return max(ok, key=lambda r: r["concurrency"])
    return min(mine, key=lambda r: r["concurrency"]) if mine else None


def highest_within_itl(rows: Sequence[Row], server: str, itl_ms: float) -> int | None:
    """Streams at the highest step within 2×ITL; 0 if none was; None if the server never ran."""
    mine = [r for r in rows if r["server"] == server]
    if not mine:
        return None
    return max((r["concurrency"] for r in mine if within_itl(r, itl_ms)), default=0)


def within_itl(row: Row, itl_ms: float) -> bool:
    p99 = row.get("gap_ms_p99")
    return p99 is not None and p99 <= 2 * itl_ms and row["exact"] == row["streams"]


def kept_pace(row: Row) -> bool:
    return row["delivery"] >= KEEPS_PACE and row["exact"] == row["streams"]


def pair_step(rows: Sequence[Row], a: str, b: str, wanted: int) -> int | None:
    """`wanted` if both servers ran that step, else the highest step both ran."""
    steps = [{r["concurrency"] for r in rows if r["server"] == s} for s in (a, b)]
    shared = steps[0] & steps[1]
    if wanted in shared:
        return wanted
    return max(shared) if shared else None


def _key(me: str, other: str) -> str:
    """A ratio's key: `vs_OTHER` for firsttoken's, `ME_vs_OTHER` for another server's."""
    return f"vs_{other}" if me == SUBJECT else f"{me}_vs_{other}"


def _pair(key: str) -> str:
    """`ME ÷ OTHER` for a ratio's key."""
    me, _, other = key.rpartition("vs_")
    return f"{me.removesuffix('_') or SUBJECT} ÷ {other}"


def _vs(me: Row | None, them: Row | None, keys: Sequence[str]) -> dict[str, float | None] | None:
    if me is None or them is None:
        return None
    return {k: _ratio(me[k], them[k]) for k in keys}


def _cpu_ratio(sat: Sequence[Row], me: str, other: str, wanted: int) -> dict[str, Any] | None:
    step = pair_step(sat, me, other, wanted)
    if step is None:
        return None
    a, b = _find(sat, me, step), _find(sat, other, step)
    assert a is not None and b is not None
    return {
        "at_streams": step,
        "tokens_per_cpu_s": _ratio(a["tokens_per_cpu_s"], b["tokens_per_cpu_s"]),
        "tokens_per_s": _ratio(a["tokens_per_s"], b["tokens_per_s"]),
    }


def _peak(sat: Sequence[Row], server: str) -> tuple[Row | None, bool]:
    """`server`'s step with the most delivered tokens/s, and whether it fell behind at any step.

    Capacity is the most a server delivers as load climbs; it is only measured once the server
    has fallen behind somewhere (below that, delivery is the offered load, not the limit)."""
    mine = [r for r in sat if r["server"] == server]
    peak = max(mine, key=lambda r: r["tokens_per_s"], default=None)
    return peak, any(not kept_pace(r) for r in mine)


def _workers(sat: Sequence[Row]) -> dict[str, Any] | None:
    """--workers 2 ÷ --workers 1 at saturation: each one's capacity (its highest delivered
    tokens/s over the steps it ran), ÷. Comparing at one step would not do: at a step where
    `--workers 2` keeps pace it is not saturated, so the ratio there only says how far one
    process falls short. A server that never fell behind has only a lower bound for capacity:
    the flags say so (`w2_saturated` false: the ratio is a lower bound; `w1_saturated` false:
    it is not meaningful)."""
    w2, w2_saturated = _peak(sat, WORKERS2)
    w1, w1_saturated = _peak(sat, SUBJECT)
    if w2 is None or w1 is None:
        return None
    return {
        "at_streams": w2["concurrency"],
        "w1_at_streams": w1["concurrency"],
        "w2_kept_pace": kept_pace(w2),
        "w2_saturated": w2_saturated,
        "w1_saturated": w1_saturated,
        "w2_tokens_per_s": w2["tokens_per_s"],
        "w1_tokens_per_s": w1["tokens_per_s"],
        "tokens_per_s": _ratio(w2["tokens_per_s"], w1["tokens_per_s"]),
    }


def _workers_note(w: dict[str, Any]) -> str:
    """The targets table's note for the workers ratio: both capacities, and what a server that
    never fell behind leaves of the ratio (still judged, as every target is)."""
    note = (
        f"capacity ÷ capacity: {_fmt(w['w2_tokens_per_s'], 0)} tokens/s at "
        f"{w['at_streams']} streams vs {_fmt(w['w1_tokens_per_s'], 0)} at {w['w1_at_streams']}"
    )
    if not w["w1_saturated"]:
        return note + " (one process was never saturated: the ratio is not meaningful)"
    if not w["w2_saturated"]:
        note += (
            f" ({WORKERS2} kept pace at every step: its capacity is at least "
            f"{_fmt(w['w2_tokens_per_s'], 0)} tokens/s; the ratio is a lower bound)"
        )
    return note


def compute_ratios(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"overhead": {}, "burst": {}, "saturation": {}, "idle": {}}
    sizes = res["meta"]["sizes"]
    itl = sizes["itl_ms"]
    out["setup"] = _setup_ratios(res.get("setup", []))
    for level in sizes["levels"]:
        out["overhead"][str(level)] = _pairs(res["overhead"], level)
    out["burst"] = _pairs(res.get("burst", []), sizes["burst_streams"])
    sat = res["saturation"]
    for me, other in PAIRS:
        entry = _cpu_ratio(sat, me, other, sizes["target_streams"])
        if entry:
            out["saturation"][_key(me, other)] = entry
    servers = list(dict.fromkeys(r["server"] for r in sat))
    points = {s: saturation_point(sat, s, itl) for s in servers}
    out["saturation"]["points"] = {
        s: None
        if p is None or not within_itl(p, itl)
        else {k: p[k] for k in ("concurrency", "tokens_per_s", "tokens_per_cpu_s")}
        for s, p in points.items()
    }
    out["saturation"]["workers"] = _workers(sat)
    idle = {r["server"]: r for r in res["idle"]}
    for me, other in PAIRS:
        if me in idle and other in idle:
            out["idle"][_key(me, other)] = _ratio(
                idle[me]["kib_per_stream"], idle[other]["kib_per_stream"]
            )
    ab = res["abandonment"]
    if SUBJECT in ab and BASELINE in ab:
        out["abandonment"] = {
            f"vs_{BASELINE}": _ratio(
                ab[SUBJECT]["excess_per_stream"], ab[BASELINE]["excess_per_stream"]
            )
        }
    return out


def _setup_cost(rows: Sequence[Row], server: str) -> float | None:
    """µs of server CPU per new stream (the setup workload), or None if not run."""
    row = next((r for r in rows if r["server"] == server), None)
    return row["extra"].get("cpu_us_per_stream") if row else None


def _setup_ratios(rows: Sequence[Row]) -> dict[str, float | None]:
    """Each pair's ratio of CPU per new stream."""
    out: dict[str, float | None] = {}
    for me, other in PAIRS:
        mine, theirs = _setup_cost(rows, me), _setup_cost(rows, other)
        if mine is not None and theirs is not None:
            out[_key(me, other)] = _ratio(mine, theirs)
    return out


def _pairs(rows: Sequence[Row], at: int) -> dict[str, dict[str, float | None]]:
    """Every pair's latency ratios at `at` streams, for the pairs that both ran."""
    out: dict[str, dict[str, float | None]] = {}
    for me, other in PAIRS:
        vs = _vs(_find(rows, me, at), _find(rows, other, at), _RATIO_KEYS)
        if vs:
            out[_key(me, other)] = vs
    return out


def compute_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 12's targets, each for firsttoken and (where it applies) for the baseline and
    for issue 12's experiment (`uvicorn_floor`), shown beside it, not judged: it is an
    upper bound for a server on uvicorn, so a target it misses is likely out of reach there."""
    targets: list[dict[str, Any]] = []
    sizes = res["meta"]["sizes"]
    itl, n = sizes["itl_ms"], sizes["target_streams"]
    sat, over, burst = res["saturation"], res["overhead"], res.get("burst", [])

    def add(
        name: str,
        value: float | None,
        baseline: float | None,
        op: str,
        limit: float,
        note: str = "",
        experiment: float | None = None,
        retired: bool = False,
    ) -> None:
        ok = None
        if value is not None and not retired:
            ok = {"≥": value >= limit, "≤": value <= limit, "<": value < limit}[op]
        targets.append(
            {
                "target": name,
                "value": value,
                "baseline": baseline,
                EXPERIMENT: experiment,
                "limit": f"{op} {limit:g}",
                "passed": ok,
                "retired": retired,
                "note": note,
            }
        )

    # Tokens per server CPU-second at the target step (else the highest step both ran).
    for other, limit in ((FLOOR, CPU_VS_FLOOR_MIN), (TUTORIAL, CPU_VS_TUTORIAL_MIN)):
        mine = _cpu_ratio(sat, SUBJECT, other, n)
        base = _cpu_ratio(sat, BASELINE, other, n)
        exp = _cpu_ratio(sat, EXPERIMENT, other, n)
        note = "not measured"
        if mine:
            note = f"at {mine['at_streams']} streams"
            if mine["at_streams"] != n:
                stopped = [s for s in (SUBJECT, other) if _find(sat, s, n) is None and _ran(sat, s)]
                note += f" ({', '.join(stopped) or 'a server'} stopped climbing before {n})"
        add(
            f"tokens per server CPU-second ÷ {other}, {n} streams",
            mine["tokens_per_cpu_s"] if mine else None,
            base["tokens_per_cpu_s"] if base else None,
            "≥",
            limit,
            note,
            exp["tokens_per_cpu_s"] if exp else None,
            retired=other == TUTORIAL,  # issue 31: it measures the tutorial's collapse
        )
    # Capacity: the highest saturation step within 2×ITL.
    for server, label, limit in ((SUBJECT, "one process", n), (WORKERS2, "--workers 2", 2 * n)):
        value = highest_within_itl(sat, server, itl)
        if value is None:
            continue
        last = max(r["concurrency"] for r in sat if r["server"] == server)
        note = f"p99 inter-chunk ≤ {2 * itl:g} ms; climbed to {last}"
        if value == last:
            note += " (never exceeded it)"
        base = highest_within_itl(sat, BASELINE, itl) if server == SUBJECT else None
        exp = highest_within_itl(sat, EXPERIMENT, itl) if server == SUBJECT else None
        add(f"highest step within 2×ITL, {label} (streams)", value, base, "≥", limit, note, exp)
    # Added TTFT p99 at the target step, and a burst's p50, ÷ the floor's.

    def vs_floor(server: str, rows: Sequence[Row], at: int, key: str) -> float | None:
        me, them = _find(rows, server, at), _find(rows, FLOOR, at)
        return _ratio(me[key], them[key]) if me and them else None

    def floor_row(title: str, rows: Sequence[Row], at: int, key: str, limit: float) -> None:
        """firsttoken's figure ÷ the floor's, both builds, with the two figures as the note."""
        me, them = _find(rows, SUBJECT, at), _find(rows, FLOOR, at)
        note = f"{_fmt(me[key], 1)} vs {_fmt(them[key], 1)} ms" if me and them else "not measured"
        add(
            title,
            vs_floor(SUBJECT, rows, at, key),
            vs_floor(BASELINE, rows, at, key),
            "≤",
            limit,
            note,
            vs_floor(EXPERIMENT, rows, at, key),
        )

    floor_row(
        f"added TTFT p99, {n} streams ÷ {FLOOR}'s",
        over,
        n,
        "added_ttft_ms_p99",
        TTFT_P99_VS_FLOOR_MAX,
    )
    # Burst: streams requested at the same instant.
    b = sizes["burst_streams"]
    floor_row(
        f"burst: added TTFT p50, {b} streams at once ÷ {FLOOR}'s",
        burst,
        b,
        "added_ttft_ms_p50",
        BURST_P50_VS_FLOOR_MAX,
    )
    # The service level with two workers: TTFT p99 (absolute) at the top overhead level.
    top = max(sizes["levels"])
    w2 = _find(over, WORKERS2, top)
    if w2 is not None:
        one = _find(over, SUBJECT, top)

        def ttft_p99(r: Row | None) -> float | None:
            p99 = r["added_ttft_ms_p99"] if r else None
            return None if p99 is None else p99 + sizes["ttft_ms"]

        add(
            f"TTFT p99, {top} streams over {sizes['ramp_s']:g} s, --workers 2 (ms)",
            ttft_p99(w2),
            None,
            "<",
            W2_TTFT_P99_MAX_MS,
            f"one process: {_fmt(ttft_p99(one), 0)} ms" if one else "",
        )
    # Issue 31: a new stream's cost against the experiment's, and TTFT at the top step.
    setup = res.get("setup", [])
    mine, theirs = _setup_cost(setup, SUBJECT), _setup_cost(setup, EXPERIMENT)
    if mine is not None:
        add(
            f"server CPU per new stream ÷ {EXPERIMENT}'s, {sizes['setup_streams']} at once "
            f"({sizes['setup_tokens']} tokens each)",
            _ratio(mine, theirs) if theirs is not None else None,
            _ratio(_setup_cost(setup, BASELINE), theirs) if theirs is not None else None,
            "≤",
            SETUP_VS_EXPERIMENT_MAX,
            f"{_fmt(mine, 0)} vs {_fmt(theirs, 0)} µs",
        )
    me, them = _find(burst, SUBJECT, b), _find(burst, EXPERIMENT, b)
    if me and them:
        key = "added_ttft_ms_p50"
        base = _find(burst, BASELINE, b)
        add(
            f"burst: added TTFT p50, {b} streams at once ÷ {EXPERIMENT}'s",
            _ratio(me[key], them[key]),
            _ratio(base[key], them[key]) if base else None,
            "≤",
            BURST_VS_EXPERIMENT_MAX,
            f"{_fmt(me[key], 1)} vs {_fmt(them[key], 1)} ms",
        )
    top_step = max(sizes["saturation"])
    row = _find(sat, SUBJECT, top_step)
    if row is not None and row["added_ttft_ms_p99"] is not None:
        exp_row = _find(sat, EXPERIMENT, top_step)
        exp_p99 = exp_row["added_ttft_ms_p99"] if exp_row else None
        add(
            f"TTFT p99, {top_step} streams over {sizes['ramp_s']:g} s, one process (ms)",
            row["added_ttft_ms_p99"] + sizes["ttft_ms"],
            None,
            "<",
            TOP_TTFT_P99_MAX_MS,
            f"{row['delivery']:.0%} of pace",
            None if exp_p99 is None else exp_p99 + sizes["ttft_ms"],
        )
    # Memory per waiting stream.
    idle = {r["server"]: r for r in res["idle"]}
    if SUBJECT in idle:
        nominal = res["meta"]["idle_nominal"]
        r = idle[SUBJECT]
        note = "measured" if r["opened"] >= nominal else f"measured at {r['opened']} open"
        base, exp = idle.get(BASELINE), idle.get(EXPERIMENT)
        add(
            f"RSS per waiting stream, {nominal:,} streams, heartbeats on (KiB)",
            r["kib_per_stream"],
            base["kib_per_stream"] if base else None,
            "≤",
            IDLE_KIB_MAX,
            note,
            exp["kib_per_stream"] if exp else None,
        )
    # Abandonment.
    ab = res["abandonment"]
    if SUBJECT in ab:
        a = ab[SUBJECT]
        base = ab.get(BASELINE)
        add(
            f"tokens generated after disconnect, {a['streams']} streams, per stream",
            a["excess_per_stream"],
            base["excess_per_stream"] if base else None,
            "≤",
            ABANDON_EXCESS_MAX,
            f"{a['excess_tokens']:.0f} over {a['streams']} streams",
        )
    # Redis mode against memory mode (issue 27).
    redis_cpu = _cpu_ratio(sat, REDIS, SUBJECT, n)
    if redis_cpu:
        add(
            f"--redis ÷ memory, tokens per server CPU-second, {n} streams",
            redis_cpu["tokens_per_cpu_s"],
            None,
            "≥",
            REDIS_CPU_MIN,
            f"at {redis_cpu['at_streams']} streams",
        )
    mine, memory = _find(over, REDIS, n), _find(over, SUBJECT, n)
    if mine and memory:
        key = "added_ttft_ms_p50"
        add(
            f"--redis ÷ memory, added TTFT p50, {n} streams",
            _ratio(mine[key], memory[key]),
            None,
            "≤",
            REDIS_TTFT_P50_MAX,
            f"{_fmt(mine[key], 1)} vs {_fmt(memory[key], 1)} ms",
        )
    # Workers: delivered tokens/s at saturation, each server's capacity.
    w = res["ratios"]["saturation"].get("workers")
    if w:
        add(
            "--workers 2 ÷ --workers 1, delivered tokens/s at saturation",
            w["tokens_per_s"],
            None,
            "≥",
            WORKERS_SPEEDUP_MIN,
            _workers_note(w),
            retired=True,  # issue 31: 2 shared cores with the client on one cannot show it
        )
    return targets


def _ran(rows: Sequence[Row], server: str) -> bool:
    return any(r["server"] == server for r in rows)


# ---------------------------------------------------------------- rendering


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded)

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


_RUN_HEADERS = [
    "streams",
    "server",
    "+TTFT p50",
    "+TTFT p99",
    "gap p50",
    "gap p99",
    "gap max",
    "exact",
    "srv CPU",
    "client CPU",
    "client lag",
    "others(cores)",
]


def _runs(rows_in: Sequence[Row]) -> str:
    rows = []
    for r in rows_in:
        rows.append(
            [
                str(r["concurrency"]),
                r["server"],
                _fmt(r["added_ttft_ms_p50"]),
                _fmt(r["added_ttft_ms_p99"]),
                _fmt(r["gap_ms_p50"]),
                _fmt(r["gap_ms_p99"]),
                _fmt(r["gap_ms_max"]),
                f"{r['exact']}/{r['streams']}",
                _pct(r["server_cpu_share"]),
                _pct(r["client_cpu_share"]) + ("!" if r["client_saturated"] else ""),
                _fmt(r["client_lag_ms_max"], 1),
                f"{r['others_cpu_share']:.2f}",
            ]
        )
    return _table(_RUN_HEADERS, rows)


_RATIOS_HEAD = (
    f"ratios, firsttoken ÷ other, and {EXPERIMENT} (issue 12's experiment) ÷ {FLOOR} and "
    f"{TUTORIAL} (lower is better):"
)


def _ratio_table(entries: dict[str, dict[str, Any]]) -> str:
    ratio_rows = []
    for level, entry in entries.items():
        for key, vals in entry.items():
            ratio_rows.append([level, _pair(key)] + [_x(vals[k]) for k in _RATIO_KEYS])
    return _table(["streams", "ratio", "+TTFT p50", "+TTFT p99", "gap p99", "gap max"], ratio_rows)


def _overhead(res: dict[str, Any]) -> str:
    s = res["meta"]["sizes"]
    out = [
        f"OVERHEAD — engine TTFT {s['ttft_ms']:.0f} ms, ITL {s['itl_ms']:.0f} ms, "
        f"{s['tokens']} tokens, streams started over {s['ramp_s']:g} s; added TTFT = measured − "
        f"{s['ttft_ms']:.0f} ms; {WORKERS2} runs the top level only",
        _runs(res["overhead"]),
        "",
        _RATIOS_HEAD,
        _ratio_table(res["ratios"]["overhead"]),
    ]
    return "\n".join(out)


def _burst(res: dict[str, Any]) -> str:
    s = res["meta"]["sizes"]
    rounds = s["burst_rounds"]
    return "\n".join(
        [
            f"BURST — {s['burst_streams']} streams requested at the same instant (no ramp: every "
            f"connect and request at once), {s['burst_tokens']} tokens, "
            f"{rounds} burst{'s' if rounds != 1 else ''} in a row per server",
            _runs(res["burst"]),
            "",
            _RATIOS_HEAD,
            _ratio_table({str(s["burst_streams"]): res["ratios"].get("burst", {})}),
        ]
    )


def _setup(res: dict[str, Any]) -> str:
    s = res["meta"]["sizes"]
    rows = [
        [r["server"], _fmt(r["extra"].get("cpu_us_per_stream"), 0), f"{r['exact']}/{r['streams']}"]
        for r in res["setup"]
    ]
    ratios = [
        [f"{SUBJECT} ÷ {k[3:]}" if k.startswith("vs_") else k.replace("_vs_", " ÷ "), _x(v)]
        for k, v in res["ratios"].get("setup", {}).items()
    ]
    return "\n".join(
        [
            f"SET-UP — server CPU per new stream: {s['setup_streams']} streams requested at "
            f"once, {s['setup_tokens']} tokens each, {s['setup_rounds']} bursts in a row; "
            "server CPU over the bursts ÷ the streams",
            _table(["server", "µs per stream", "exact"], rows),
            "",
            _table(["pair", "ratio"], ratios),
        ]
    )


def _saturation(res: dict[str, Any]) -> str:
    itl = res["meta"]["sizes"]["itl_ms"]
    target = res["meta"]["sizes"]["target_streams"]
    rows = []
    for r in res["saturation"]:
        rows.append(
            [
                str(r["concurrency"]),
                r["server"],
                _fmt(r["tokens_per_s"], 0),
                _pct(r["delivery"]),
                _fmt(r["tokens_per_cpu_s"], 0),
                _pct(r["server_cpu_share"]),
                _fmt(r["gap_ms_p99"]),
                "yes" if within_itl(r, itl) else "NO",
                f"{r['exact']}/{r['streams']}",
                _pct(r["client_cpu_share"]) + ("!" if r["client_saturated"] else ""),
                _fmt(r["client_lag_ms_max"], 1),
                f"{r['others_cpu_share']:.2f}",
            ]
        )
    out = [
        f"SATURATION — concurrency doubles; the saturation point is the last step with p99 "
        f"inter-chunk ≤ 2×ITL ({2 * itl:.0f} ms); a server climbs until it delivers < 90% "
        f"of the engine's pace or fails a stream, but at least to {target} streams (the "
        f"targets' step); firsttoken climbs as long as {WORKERS2} does",
        _table(
            [
                "streams",
                "server",
                "tokens/s",
                "of pace",
                "tok/CPU-s",
                "srv CPU",
                "gap p99",
                "≤2×ITL",
                "exact",
                "client CPU",
                "client lag",
                "others(cores)",
            ],
            rows,
        ),
        "",
    ]
    sat = res["ratios"]["saturation"]
    for me, other in PAIRS:
        e = sat.get(_key(me, other))
        if e:
            out.append(
                f"{me} ÷ {other} at {e['at_streams']} streams: tokens per CPU-second "
                f"{_x(e['tokens_per_cpu_s'])}, delivered tokens/s {_x(e['tokens_per_s'])}"
            )
    w = sat.get("workers")
    if w:

        def peak(server: str, streams: int, saturated: bool) -> str:
            return f"{server} at {streams} streams, " + (
                "saturated" if saturated else "never fell behind: a lower bound"
            )

        out.append(
            f"{WORKERS2} ÷ firsttoken, delivered tokens/s at saturation (each one's highest): "
            f"{_x(w['tokens_per_s'])} ({peak(WORKERS2, w['at_streams'], w['w2_saturated'])}; "
            f"{peak(SUBJECT, w['w1_at_streams'], w['w1_saturated'])})"
        )
    for server, p in sat.get("points", {}).items():
        if p:
            out.append(
                f"{server}: highest step within 2×ITL = {p['concurrency']} streams, "
                f"{_fmt(p['tokens_per_s'], 0)} tokens/s, {_fmt(p['tokens_per_cpu_s'], 0)} per CPU-s"
            )
        else:
            out.append(f"{server}: no step within 2×ITL")
    return "\n".join(out)


def _idle(res: dict[str, Any]) -> str:
    rows = [
        [
            r["server"],
            f"{r['opened']}/{r['streams']}",
            str(r["pinged"]),
            _fmt(r["rss_base_mib"], 1),
            _fmt(r["rss_open_mib"], 1),
            _fmt(r["kib_per_stream"], 1),
            _fmt(r["projected_mib"], 0),
            _pct(r["heartbeat_cpu_share"]),
            f"{r['open_s']:.1f}",
        ]
        for r in res["idle"]
    ]
    nominal = res["meta"]["idle_nominal"]
    out = [
        f"IDLE CAPACITY — streams waiting on a {res['meta']['sizes']['idle_ttft_ms'] / 1000:.0f} s "
        f"TTFT, heartbeat every {res['meta']['sizes']['idle_heartbeat_s']:g} s",
        _table(
            [
                "server",
                "open",
                "pinged",
                "RSS base MiB",
                "RSS open MiB",
                "KiB/stream",
                f"@{nominal:,} MiB",
                "hb CPU",
                "open s",
            ],
            rows,
        ),
    ]
    for key, val in res["ratios"]["idle"].items():
        out.append(f"{_pair(key)}: memory per stream {_x(val)}")
    for r in res["idle"]:
        out.extend(f"note ({r['server']}): {n}" for n in r["notes"])
    return "\n".join(out)


def _abandonment(res: dict[str, Any]) -> str:
    out = ["ABANDONMENT — every client disconnects at a random point"]
    runs = [*res.get("abandonment_light", {}).items(), *res["abandonment"].items()]
    for server, a in runs:
        out.append(
            f"{server}, {a['streams']} streams: tokens generated {a['tokens_generated']:.0f}, "
            f"sent {a['tokens_sent']:.0f}, received {a['tokens_received']}; "
            f"generated after disconnect {a['excess_tokens']:.0f} "
            f"({a['excess_per_stream']:.2f} per stream); "
            f"active after: {a['active_streams_after']}; outcomes {a['outcomes']}"
        )
        out.append(
            f"  of which generated but never written to the socket: "
            f"{a['generated_not_sent']:.0f}; written but never read: "
            f"{a['tokens_sent'] - a['tokens_received']:.0f} (in flight when the client closed, "
            f"written after it closed but before the server noticed, or unread because the "
            f"client lagged: max lag {_fmt(a['client_lag_ms_max'], 0)} ms)"
        )
    if not runs:
        out.append("(not run)")
    for key, val in res["ratios"].get("abandonment", {}).items():
        out.append(
            f"firsttoken ÷ {key.removeprefix('vs_')}: tokens generated after disconnect "
            f"per stream {_x(val)}"
        )
    out.append(
        f"the target is judged at {res['meta']['sizes']['abandon_streams']} streams; "
        "raw floor, tutorial and --workers 2: not measured (no single /metrics token counter)"
    )
    return "\n".join(out)


def _targets(res: dict[str, Any]) -> str:
    rows = []
    for t in res["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["passed"]]
        if t.get("retired"):
            verdict = "retired"
        rows.append(
            [
                t["target"],
                _fmt(t["value"]),
                _fmt(t["baseline"]),
                _fmt(t.get(EXPERIMENT)),
                t["limit"],
                verdict,
                t["note"],
            ]
        )
    rev = res["meta"].get("baseline_rev")
    base = f"{BASELINE} ({rev})" if rev else BASELINE
    return (
        "TARGETS (issues 12 and 31) — firsttoken's value judged (a retired one is reported, "
        "not judged); the baseline's shown for before/after; "
        f"{EXPERIMENT}'s (issue 12's experiment, measured the same way) for scale, not judged: "
        "an upper bound on uvicorn\n"
        + _table(["target", "firsttoken", base, EXPERIMENT, "limit", "result", "note"], rows)
    )


def _per_token(res: dict[str, Any]) -> str:
    from bench.per_token import render_table

    return render_table(res["per_token"])


def render(res: dict[str, Any]) -> str:
    m = res["meta"]
    head = (
        f"firsttoken bench — {m['date']} — {m['cpus']} CPUs (shared), load avg at start "
        f"{m['loadavg_start']}, at end {m['loadavg_end']}; {m['mode']} sizes"
    )
    parts: list[str] = [head, ""]
    sections: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("overhead", _overhead),
        ("burst", _burst),
        ("setup", _setup),
        ("saturation", _saturation),
        ("idle", _idle),
        ("abandonment", _abandonment),
        ("per_token", _per_token),
    ]
    for key, fn in sections:
        if res.get(key):
            parts += [fn(res), ""]
    parts += [_targets(res), ""]
    if res["notes"]:
        parts.append("NOTES")
        parts += [f"- {n}" for n in res["notes"]]
    parts.append(
        "columns: times in ms; srv/client CPU = share of one core during the run; "
        "others = cores busy with everything else on the machine; '!' = client saturated; "
        "client lag = worst wake-up delay of the load client's own event loop (ms)"
    )
    return "\n".join(parts)
