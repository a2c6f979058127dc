"""Turn the figures into ratios, targets and a printed table.

Absolute times on a shared 2-core machine are noise-prone; every absolute figure is printed
beside its ratio to the raw floor and to the tutorial stack, measured minutes apart in one run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["compute_ratios", "compute_targets", "render", "saturation_point", "within_itl"]

SUBJECT, FLOOR, TUTORIAL = "firsttoken", "raw_floor", "tutorial"
GIB_MIB = 1024.0

Row = dict[str, Any]
_RATIO_KEYS = ("added_ttft_ms_p50", "added_ttft_ms_p99", "gap_ms_p99", "gap_ms_max")


def _find(rows: Sequence[Row], server: str, concurrency: int) -> Row | None:
    for r in rows:
        if r["server"] == server and r["concurrency"] == concurrency:
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "—"
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


def within_itl(row: Row, itl_ms: float) -> bool:
    p99 = row.get("gap_ms_p99")
    return p99 is not None and p99 <= 2 * itl_ms and row["exact"] == row["streams"]


def common_step(rows: Sequence[Row], servers: Sequence[str]) -> int | None:
    """The highest saturation step every server ran (same offered load for the ratio)."""
    steps = [{r["concurrency"] for r in rows if r["server"] == s} for s in servers]
    shared = set.intersection(*steps) if steps else set()
    return max(shared) if shared else None


def compute_ratios(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"overhead": {}, "saturation": {}, "idle": {}}
    itl = res["meta"]["sizes"]["itl_ms"]
    for level in res["meta"]["sizes"]["levels"]:
        me = _find(res["overhead"], SUBJECT, level)
        entry: dict[str, Any] = {}
        for other in (FLOOR, TUTORIAL):
            them = _find(res["overhead"], other, level)
            if me and them:
                entry[f"vs_{other}"] = {k: _ratio(me[k], them[k]) for k in _RATIO_KEYS}
        out["overhead"][str(level)] = entry
    sat = res["saturation"]
    servers = sorted({r["server"] for r in sat})
    step = common_step(sat, servers)
    if step is not None:
        me = _find(sat, SUBJECT, step)
        for other in (FLOOR, TUTORIAL):
            them = _find(sat, other, step)
            if me and them:
                out["saturation"][f"vs_{other}"] = {
                    "at_streams": step,
                    "tokens_per_cpu_s": _ratio(me["tokens_per_cpu_s"], them["tokens_per_cpu_s"]),
                    "tokens_per_s": _ratio(me["tokens_per_s"], them["tokens_per_s"]),
                }
    points = {s: saturation_point(sat, s, itl) for s in servers}
    out["saturation"]["points"] = {
        s: None
        if p is None
        else {k: p[k] for k in ("concurrency", "tokens_per_s", "tokens_per_cpu_s")}
        for s, p in points.items()
    }
    idle = {r["server"]: r for r in res["idle"]}
    if SUBJECT in idle:
        for other in (FLOOR, TUTORIAL):
            if other in idle:
                out["idle"][f"vs_{other}"] = _ratio(
                    idle[SUBJECT]["kib_per_stream"], idle[other]["kib_per_stream"]
                )
    return out


def compute_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: str, ok: bool | None, note: str = "") -> None:
        targets.append({"target": name, "value": value, "limit": limit, "passed": ok, "note": note})

    sizes = res["meta"]["sizes"]
    top = max(sizes["levels"])
    me = _find(res["overhead"], SUBJECT, top)
    p50 = me["added_ttft_ms_p50"] if me else None
    p99 = me["added_ttft_ms_p99"] if me else None
    add(f"added TTFT p50 at {top} streams (ms)", p50, "≤ 1", None if p50 is None else p50 <= 1)
    add(f"added TTFT p99 at {top} streams (ms)", p99, "≤ 10", None if p99 is None else p99 <= 10)
    sat = res["ratios"]["saturation"]
    for other, limit in ((TUTORIAL, 3.0), (FLOOR, 0.6)):
        entry = sat.get(f"vs_{other}")
        value = entry["tokens_per_cpu_s"] if entry else None
        note = f"at {entry['at_streams']} streams" if entry else "not measured"
        add(
            f"tokens per server CPU-second ÷ {other}",
            value,
            f"≥ {limit}",
            None if value is None else value >= limit,
            note,
        )
    idle = next((r for r in res["idle"] if r["server"] == SUBJECT), None)
    if idle is not None:
        nominal = res["meta"]["idle_nominal"]
        value = idle["projected_mib"]
        note = "measured" if idle["opened"] >= nominal else f"projected from {idle['opened']}"
        add(
            f"RSS with {nominal:,} waiting streams (MiB)",
            value,
            f"< {GIB_MIB:.0f}",
            None if value is None else value < GIB_MIB,
            note,
        )
    ab = res["abandonment"].get(SUBJECT)
    if ab is not None:
        add(
            "tokens generated after disconnect, per stream",
            ab["excess_per_stream"],
            "≤ 1",
            ab["passed"],
            f"{ab['excess_tokens']:.0f} over {ab['streams']} streams",
        )
    return targets


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


def _overhead(res: dict[str, Any]) -> str:
    s = res["meta"]["sizes"]
    rows = []
    for r in res["overhead"]:
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
    out = [
        f"OVERHEAD — engine TTFT {s['ttft_ms']:.0f} ms, ITL {s['itl_ms']:.0f} ms, "
        f"{s['tokens']} tokens; added TTFT = measured − {s['ttft_ms']:.0f} ms",
        _table(
            [
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
            ],
            rows,
        ),
        "",
        "ratios, firsttoken ÷ other (lower is better):",
    ]
    ratio_rows = []
    for level, entry in res["ratios"]["overhead"].items():
        for key, vals in entry.items():
            ratio_rows.append([level, key.removeprefix("vs_")] + [_x(vals[k]) for k in _RATIO_KEYS])
    out.append(
        _table(["streams", "vs", "+TTFT p50", "+TTFT p99", "gap p99", "gap max"], ratio_rows)
    )
    return "\n".join(out)


def _saturation(res: dict[str, Any]) -> str:
    itl = res["meta"]["sizes"]["itl_ms"]
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
        "of the engine's pace or fails a stream",
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
    for other in (TUTORIAL, FLOOR):
        e = sat.get(f"vs_{other}")
        if e:
            out.append(
                f"firsttoken ÷ {other} at {e['at_streams']} streams: tokens per CPU-second "
                f"{_x(e['tokens_per_cpu_s'])}, delivered tokens/s {_x(e['tokens_per_s'])}"
            )
    for server, p in sat.get("points", {}).items():
        if p:
            out.append(
                f"{server}: highest step within 2×ITL = {p['concurrency']} streams, "
                f"{_fmt(p['tokens_per_s'], 0)} tokens/s, {_fmt(p['tokens_per_cpu_s'], 0)} per CPU-s"
            )
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
        out.append(f"firsttoken ÷ {key.removeprefix('vs_')}: memory per stream {_x(val)}")
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
    out.append(
        f"the target is judged at {res['meta']['sizes']['abandon_streams']} streams; "
        "raw floor and tutorial: not measured (they have no /metrics token counter)"
    )
    return "\n".join(out)


def _targets(res: dict[str, Any]) -> str:
    rows = []
    for t in res["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["passed"]]
        rows.append([t["target"], _fmt(t["value"]), t["limit"], verdict, t["note"]])
    return "TARGETS\n" + _table(["target", "value", "limit", "result", "note"], rows)


def render(res: dict[str, Any]) -> str:
    m = res["meta"]
    head = (
        f"firsttoken bench — {m['date']} — {m['cpus']} CPUs (shared), load avg at start "
        f"{m['loadavg_start']}, at end {m['loadavg_end']}; {m['mode']} sizes"
    )
    parts: list[str] = [head, ""]
    sections: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("overhead", _overhead),
        ("saturation", _saturation),
        ("idle", _idle),
        ("abandonment", _abandonment),
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
