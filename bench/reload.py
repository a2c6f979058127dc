"""Reload under load: streams running across reloads that add and remove routes, targets and
keys, and what each reload cut, how soon it took effect, and whether memory stays flat.

    .venv/bin/python -m bench.reload [--streams 200] [--reloads 20] [--interval-s 1.5]
                                     [--workers 1] [--quick] [--out DIR]

One `firsttoken serve --api-keys --routes --canned-answers` (with `--workers N`, N workers
under the supervisor), the synthetic engine on every target (TTFT 5 ms, ITL 40 ms),
`--resume-ttl-s 2` (so RSS measures the reloads, not the resume buffers of thousands of
finished streams). Reload i writes all three files and sends SIGHUP to the server's process:
- keys: ten steady keys (one's weight changes every reload: a change that cuts nothing) and
  `temp-i`, new at reload i and removed at reload i+1;
- routes: `chat` on the steady target, always; `r-i` on its own new target `t-i`, added at
  reload i and removed (with its target) at reload i+1;
- canned answers: one greeting whose answer names i.

`--streams` readers run all the while, each starting its next Chat Completions stream (60
tokens, about 2.4 s) when one ends: 80% on a steady key and `chat` (unchanged: none of these may
be cut or fail), 10% on a steady key and the newest `r-i` (a route the next reload removes: its
running streams must run on), 10% on the newest temp key (removed by the next reload: its
running streams must end with `key_revoked`). A stream refused at its start because its key or
route was just removed is counted apart (that is the reload working).

Each reload's time to effect: from the signal until, on fresh connections (`--workers`: 8 in a
row, so every worker answered), `GET /v1/models` lists `r-i` and not `r-(i-1)`, the canned
greeting says i, `temp-i` is let in and `temp-(i-1)` refused. RSS (the server's processes,
summed) is read before each reload. Writes `bench/results/reload.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
CLOSE = {"connection": "close"}  # every probe on a fresh connection: any worker may take it
STEADY_KEYS = 10
TOKENS = 60
ITL_MS = 40  # a stream runs ~2.4 s: every reload has streams of each kind in flight


def keys_toml(i: int) -> str:
    lines = []
    for j in range(STEADY_KEYS):
        weight = 1 + (i % 3) if j == 0 else 1  # a change to a key that must cut nothing
        lines += [
            "[[keys]]",
            f'name = "steady-{j}"',
            f'key = "sk-steady-{j}"',
            f"weight = {weight}",
        ]
    lines += ["[[keys]]", f'name = "temp-{i}"', f'key = "sk-temp-{i}"', ""]
    return "\n".join(lines)


def routes_toml(i: int) -> str:
    return (
        f'[targets.steady]\nkind = "synthetic"\nttft_ms = 5\nitl_ms = {ITL_MS}\n\n'
        f'[targets.t-{i}]\nkind = "synthetic"\nttft_ms = 5\nitl_ms = {ITL_MS}\n\n'
        '[models.chat]\ntargets = ["steady"]\n\n'
        f'[models.r-{i}]\ntargets = ["t-{i}"]\n'
    )


def canned_toml(i: int) -> str:
    return f'[answers]\n"ping" = "pong {i}"\n'


@dataclass
class Tally:
    steady: int = 0  # streams on a steady key and chat, completed
    steady_failed: list[str] = field(default_factory=list)
    moving_route: int = 0  # on a route removed meanwhile or not: completed
    moving_route_failed: list[str] = field(default_factory=list)
    temp_done: int = 0  # temp key's streams that ended before their key was removed
    revoked: int = 0  # temp key's streams ended with key_revoked
    temp_failed: list[str] = field(default_factory=list)  # anything else
    refused_at_start: int = 0  # a key or route just removed: 401/404 at the start


class Readers:
    """The streams, in a process of their own (so the probes of the reloads' effect never
    wait behind their parsing): which temp key and route are newest is read from the
    `cycle` file at each stream's start; a `stop` file ends them; the tally goes to
    `tally.json`."""

    def __init__(self, url: str, directory: Path, streams: int) -> None:
        self.url, self.dir, self.streams = url, directory, streams
        self.tally = Tally()

    def cycle(self) -> int:
        try:
            return int((self.dir / "cycle").read_text())
        except (OSError, ValueError):
            return 0

    async def run(self) -> None:
        # Idle connections go before the server's keep-alive (5 s) closes them under us.
        limits = httpx.Limits(
            max_connections=self.streams + 10,
            max_keepalive_connections=self.streams,
            keepalive_expiry=2.0,
        )
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            await asyncio.gather(*(self.reader(n, client) for n in range(self.streams)))
        (self.dir / "tally.json").write_text(json.dumps(dataclasses.asdict(self.tally)))

    async def reader(self, n: int, client: httpx.AsyncClient) -> None:
        kind = "steady" if n % 10 < 8 else ("route" if n % 10 == 8 else "temp")
        while not (self.dir / "stop").exists():
            i = self.cycle()
            secret, model = f"sk-steady-{n % STEADY_KEYS}", "chat"
            if kind == "route":
                model = f"r-{i}"
            elif kind == "temp":
                secret = f"sk-temp-{i}"
            await self.one(kind, secret, model, client)

    async def one(self, kind: str, secret: str, model: str, client: httpx.AsyncClient) -> None:
        body = {
            "model": model,
            "stream": True,
            "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": "tell me"}],
        }
        t = self.tally
        error, done = None, False
        try:
            async with client.stream(
                "POST",
                self.url + "/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {secret}"},
            ) as resp:
                if resp.status_code in (401, 404) and kind != "steady":
                    t.refused_at_start += 1
                    await resp.aread()
                    await asyncio.sleep(0.05)  # the reload is under way: not a hot loop
                    return
                if resp.status_code != 200:
                    error = f"status {resp.status_code}: {(await resp.aread())[:200]!r}"
                else:
                    async for line in resp.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("event: error"):
                            error = "error"
                        elif error == "error" and line.startswith("data: "):
                            error = json.loads(line[6:])["error"]["code"]
        except httpx.HTTPError as exc:
            error = repr(exc)
        ok = done and error is None
        if kind == "steady":
            t.steady += ok
            if not ok:
                t.steady_failed.append(str(error))
        elif kind == "route":
            t.moving_route += ok
            if not ok:
                t.moving_route_failed.append(str(error))
        elif ok:
            t.temp_done += 1
        elif error == "key_revoked":
            t.revoked += 1
        else:
            t.temp_failed.append(str(error))


class Bench:
    def __init__(self, args: argparse.Namespace, directory: Path) -> None:
        self.args = args
        self.dir = directory
        self.keys, self.routes, self.canned = (
            directory / "keys.toml",
            directory / "routes.toml",
            directory / "canned.toml",
        )
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def write(self, i: int) -> None:
        for path, text in (
            (self.keys, keys_toml(i)),
            (self.routes, routes_toml(i)),
            (self.canned, canned_toml(i)),
        ):
            tmp = path.with_suffix(".new")
            tmp.write_text(text)
            os.replace(tmp, path)  # whole files only: never a half-written one

    def start(self) -> None:
        self.write(0)
        log = (self.dir / "server.log").open("wb")
        cmd = [
            sys.executable, "-m", "firsttoken", "serve", "--port", "0",
            "--api-keys", str(self.keys), "--routes", str(self.routes),
            "--canned-answers", str(self.canned), "--rate-limit-per-s", "0",
            "--max-streams-per-key", "10000", "--ttft-slo-ms", "0",
            "--drain-timeout-s", "1", "--workers", str(self.args.workers),
            # Finished streams' resume buffers go within 2 s: RSS then measures the reloads,
            # not thousands of buffers kept for the default 300 s.
            "--resume-ttl-s", "2",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in (self.dir / "server.log").read_text().splitlines():
                if '"listening"' in line:
                    self.url = json.loads(line)["url"]
                    return
            time.sleep(0.1)
        raise RuntimeError("server did not start:\n" + (self.dir / "server.log").read_text())

    def rss_mb(self) -> float:
        assert self.proc is not None
        ps = psutil.Process(self.proc.pid)
        procs = [ps, *ps.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs) / 2**20

    def took_effect(self, i: int) -> bool:
        """Whether reload i shows, on fresh connections, on every worker."""
        rounds = 8 if self.args.workers > 1 else 1
        with httpx.Client(base_url=self.url, timeout=5) as probe:
            for _ in range(rounds):
                steady = {"authorization": "Bearer sk-steady-1", "connection": "close"}
                listed = probe.get("/v1/models", headers=steady).json()
                ids = {m["id"] for m in listed.get("data", [])}
                if f"r-{i}" not in ids or f"r-{i - 1}" in ids:
                    return False
                new = probe.get(
                    "/v1/models", headers={"authorization": f"Bearer sk-temp-{i}", **CLOSE}
                )
                old = probe.get(
                    "/v1/models", headers={"authorization": f"Bearer sk-temp-{i - 1}", **CLOSE}
                )
                if new.status_code != 200 or old.status_code != 401:
                    return False
                ping = probe.post(
                    "/v1/chat/completions",
                    headers=steady,
                    json={"model": "chat", "messages": [{"role": "user", "content": "ping"}]},
                )
                if ping.json()["choices"][0]["message"]["content"] != f"pong {i}":
                    return False
        return True

    def run(self) -> dict[str, Any]:
        a = self.args
        effect_s: list[float] = []
        sent_at: list[float] = []  # wall clock, to match the server's config.reloaded lines
        rss: list[float] = []
        readers = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.reload",
                "--readers",
                self.url,
                str(self.dir),
                "--streams",
                str(a.streams),
            ],
            cwd=ROOT,
        )
        try:
            time.sleep(a.interval_s)
            for i in range(1, a.reloads + 1):
                rss.append(round(self.rss_mb(), 1))
                self.write(i)
                assert self.proc is not None
                sent = time.monotonic()
                sent_at.append(time.time())
                self.proc.send_signal(signal.SIGHUP)
                while not self.took_effect(i):
                    if time.monotonic() - sent > 20:
                        raise RuntimeError(f"reload {i} did not take effect within 20 s")
                    time.sleep(0.02)
                effect_s.append(round(time.monotonic() - sent, 3))
                (self.dir / "cycle").write_text(str(i))  # new streams use what reload i made
                time.sleep(max(0.0, a.interval_s - (time.monotonic() - sent)))
            rss.append(round(self.rss_mb(), 1))
        finally:
            (self.dir / "stop").write_text("")
            readers.wait(60)
        t = Tally(**json.loads((self.dir / "tally.json").read_text()))
        swap_s = self.swaps(sent_at)
        bound = 2.0 if a.workers > 1 else 1.0
        settled = rss[min(3, len(rss) - 1) :]  # after the first reloads' imports and caches
        growth = settled[-1] - settled[0]
        return {
            "streams": a.streams,
            "reloads": a.reloads,
            "workers": a.workers,
            "completed_steady": t.steady,
            "failed_steady": len(t.steady_failed),
            "completed_on_removed_routes": t.moving_route,
            "failed_on_removed_routes": len(t.moving_route_failed),
            "temp_completed": t.temp_done,
            "temp_revoked": t.revoked,
            "temp_failed_otherwise": len(t.temp_failed),
            "refused_at_start": t.refused_at_start,
            "failures": (t.steady_failed + t.moving_route_failed + t.temp_failed)[:10],
            "effect_s": effect_s,
            "effect_max_s": max(effect_s),
            "swap_s": swap_s,
            "swap_max_s": max(swap_s) if swap_s else None,
            "effect_bound_s": bound,
            "rss_mb": rss,
            "rss_growth_mb": round(growth, 1),
            "ok": not (t.steady_failed or t.moving_route_failed or t.temp_failed)
            and max(swap_s or effect_s) <= bound
            and growth < 0.1 * settled[0],
        }

    def swaps(self, sent_at: list[float]) -> list[float]:
        """Per reload, the signal to the last worker's swap (its `config.reloaded` line)."""
        done: list[float] = []
        for line in (self.dir / "server.log").read_text().splitlines():
            if '"config.reloaded"' in line:
                done.append(json.loads(line)["ts"])
        per = self.args.workers
        out = []
        for i, sent in enumerate(sent_at):
            mine = done[i * per : (i + 1) * per]
            if len(mine) == per:
                out.append(round(max(mine) - sent, 3))
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def render(res: dict[str, Any]) -> str:
    lines = [
        f"RELOAD UNDER LOAD: {res['streams']} streams, {res['reloads']} reloads, "
        f"{res['workers']} worker(s)",
        f"  steady key, unchanged route: {res['completed_steady']} completed, "
        f"{res['failed_steady']} cut or failed",
        f"  routes removed under them:   {res['completed_on_removed_routes']} completed, "
        f"{res['failed_on_removed_routes']} cut or failed",
        f"  keys removed under them:     {res['temp_revoked']} ended key_revoked, "
        f"{res['temp_completed']} finished first, {res['temp_failed_otherwise']} other errors",
        f"  refused at start (key or route just removed): {res['refused_at_start']}",
        f"  signal to swap (every worker): max {res['swap_max_s']:.3f} s "
        f"(bound {res['effect_bound_s']:g} s), each: {' '.join(f'{s:.2f}' for s in res['swap_s'])}",
        f"  signal to seen by a client (its own requests' latency too): max "
        f"{res['effect_max_s']:.3f} s, each: {' '.join(f'{s:.2f}' for s in res['effect_s'])}",
        f"  RSS MB before each reload: {' '.join(f'{m:.0f}' for m in res['rss_mb'])} "
        f"(growth after the first three: {res['rss_growth_mb']:+.1f} MB)",
        f"  verdict: {'OK' if res['ok'] else 'FAILED'}",
    ]
    if res["failures"]:
        lines.append(f"  first failures: {res['failures']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reload", description=__doc__)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--reloads", type=int, default=20)
    parser.add_argument("--interval-s", type=float, default=1.5)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="20 streams, 3 reloads")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--readers", nargs=2, metavar=("URL", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.readers:  # the streams' own process (`Readers`)
        url, directory = args.readers
        asyncio.run(Readers(url, Path(directory), args.streams).run())
        return
    if args.quick:
        args.streams, args.reloads = 20, 3
    with tempfile.TemporaryDirectory(prefix="bench-reload-") as tmp:
        bench = Bench(args, Path(tmp))
        bench.start()
        try:
            res = bench.run()
        finally:
            bench.stop()
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "reload-server.log").write_bytes((Path(tmp) / "server.log").read_bytes())
    (args.out / "reload.json").write_text(json.dumps(res, indent=2))
    print(render(res))
    if not res["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
