"""The reload (firsttoken/reload.py) on a gateway built from real files: a good set of files
is swapped in whole, a bad one changes nothing and says why in one line, the watch sees a
change of contents once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import anyio
import orjson
import pytest

from firsttoken.admission.keys import KeyRing
from firsttoken.app import create_app
from firsttoken.config import Settings
from firsttoken.reload import (
    WATCH_S,
    ConfigFiles,
    Configuration,
    Reloader,
    check_files,
    ineffective,
    unmatched_routes,
    unpriced_targets,
)
from firsttoken.routing.config import parse_routes
from firsttoken.routing.live import LiveRoutes
from tests.unit import virtual_loop
from tests.unit.clock import FakeClock

KEYS = '[[keys]]\nname = "a"\nkey = "sk-a"\nroutes = ["edge"]\n'
ROUTES = (
    '[targets.s]\nkind = "synthetic"\n\n[models.chat]\ntargets = ["s"]\n\n'
    '[models.edge]\ntargets = ["s"]\n'
)
CANNED = '[answers]\n"hi" = "Hello!"\n'


@pytest.fixture
def files(tmp_path: Path) -> ConfigFiles:
    (tmp_path / "keys.toml").write_text(KEYS)
    (tmp_path / "routes.toml").write_text(ROUTES)
    (tmp_path / "canned.toml").write_text(CANNED)
    return ConfigFiles(
        str(tmp_path / "keys.toml"), str(tmp_path / "routes.toml"), str(tmp_path / "canned.toml")
    )


def reloader(files: ConfigFiles, clock: FakeClock | None = None) -> Reloader:
    app = create_app(
        Settings(api_keys=files.api_keys, routes=files.routes, canned_answers=files.canned_answers)
    )
    reloader: Reloader = app.state.reloader
    if clock is not None:
        reloader.clock = clock
    return reloader


def write(path: str | None, text: str) -> None:
    assert path is not None
    Path(path).write_text(text)


def test_a_good_set_of_files_is_swapped_in_whole(files: ConfigFiles) -> None:
    clock = FakeClock(start=5000.0)
    r = reloader(files, clock)
    gw = r.gateway
    assert r.routes is not None and r.canned is not None
    old_target = r.routes.current.targets["s"]
    write(files.api_keys, KEYS.replace('["edge"]', '["edge", "chat"]'))
    write(
        files.routes,
        ROUTES + '\n[targets.t]\nkind = "synthetic"\n\n[models.new]\ntargets = ["t"]\n',
    )
    write(files.canned_answers, '[answers]\n"hey" = "Hi there."\n')
    clock.advance(7)
    assert anyio.run(r.reload) is True
    key = gw.admission.keys.find("sk-a") if gw.admission.keys else None
    assert key is not None and key.routes == ("edge", "chat")
    assert gw.engine.models == ("chat", "edge", "new")
    assert r.routes.current.targets["s"] is old_target  # unchanged: carried over
    assert r.canned.canned == {"hey": "Hi there."}
    assert r.results == {"ok": 1, "failed": 0} and r.loaded_at == 5007.0
    samples = {(m.name, tuple(s.labels.values())): s.value for m in r.collect() for s in m.samples}
    assert samples[("firsttoken_config_reloads", ("ok",))] == 1
    assert samples[("firsttoken_config_loaded_timestamp_seconds", ())] == 5007.0


@pytest.mark.parametrize(
    ("which", "text", "says"),
    [
        ("api_keys", '[[keys]]\nname = "a\n', "keys.toml: not valid TOML ("),
        ("api_keys", KEYS + "max_stream = 2\n", "keys.toml: keys[0].max_stream: unknown field"),
        (
            "api_keys",
            KEYS + '\n[[keys]]\nname = "b"\nkey = "sk-a"\n',
            "keys.toml: keys[1] ('b') has the same key as keys[0] ('a')",
        ),
        ("api_keys", KEYS.replace('"edge"', '"edge-[1"'), "keys.toml: keys[0].routes 'edge-[1'"),
        (
            "routes",
            ROUTES.replace('targets = ["s"]\n\n[models.edge]', 'targets = ["x"]\n\n[models.edge]'),
            "routes.toml: [models.chat] targets: no target named 'x'",
        ),
        ("routes", ROUTES + "\nbalance = 1\n", "routes.toml: [models.edge] balance: must be"),
        ("canned_answers", "[answer]\n", "canned.toml: unknown table or field 'answer'"),
    ],
)
def test_a_bad_file_changes_nothing_and_says_where_in_one_line(
    files: ConfigFiles,
    caplog: pytest.LogCaptureFixture,
    which: str,
    text: str,
    says: str,
) -> None:
    r = reloader(files)
    gw, routes = r.gateway, r.routes
    assert routes is not None
    keys, current, canned = gw.admission.keys, routes.current, dict(r.canned.canned)  # type: ignore[union-attr]
    write(getattr(files, which), text)
    with caplog.at_level(logging.INFO, logger="firsttoken"):
        assert anyio.run(r.reload) is False
    assert gw.admission.keys is keys and routes.current is current
    assert r.canned is not None and r.canned.canned == canned
    assert r.results == {"ok": 0, "failed": 1}
    lines = [orjson.loads(m) for m in caplog.messages if "config." in m]
    assert len(lines) == 1 and lines[0]["event"] == "config.reload_failed"
    assert says in lines[0]["error"] and "\n" not in lines[0]["error"]
    assert check_files(files) == [lines[0]["error"]]  # `firsttoken check` says the same


def test_the_watch_sees_a_change_of_contents_once(files: ConfigFiles) -> None:
    r = reloader(files)
    assert not r.changed()
    write(files.routes, ROUTES + "\n")
    assert r.changed()
    write(files.api_keys, "broken")
    assert not anyio.run(r.reload)
    assert not r.changed()  # a bad file is tried once, not every second
    write(files.api_keys, KEYS)
    assert r.changed() and anyio.run(r.reload)


def test_without_routes_or_canned_files_only_the_keys_reload(tmp_path: Path) -> None:
    (tmp_path / "keys.toml").write_text(KEYS)
    files = ConfigFiles(str(tmp_path / "keys.toml"))
    r = reloader(files)
    assert r.routes is None and r.canned is None
    assert not isinstance(r.gateway.engine, LiveRoutes)
    write(files.api_keys, KEYS.replace('"a"', '"b"'))
    assert anyio.run(r.reload)
    assert r.gateway.admission.keys is not None and r.gateway.admission.keys.names() == ["b"]


async def until(done: Callable[[], bool]) -> None:
    """Wait (on the loop's clock, in steps of 1 ms) until `done()`; 10 s at most."""
    for _ in range(10_000):
        if done():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("not done within 10 s")


def test_the_loop_reloads_at_once_when_asked_and_within_a_second_of_a_change(
    files: ConfigFiles,
) -> None:
    r = reloader(files)
    r.watch = True

    async def body() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(r.run())
        await asyncio.sleep(0.25)
        asked = loop.time()
        r.request()  # SIGHUP: at once, not at the next second
        await until(lambda: r.results["ok"] == 1)
        assert loop.time() - asked < 0.01
        write(files.routes, ROUTES + '\n[models.late]\ntargets = ["s"]\n')
        changed = loop.time()
        await until(lambda: r.results["ok"] == 2)
        assert loop.time() - changed <= WATCH_S + 0.01  # seen within one look
        assert r.gateway.engine.models == ("chat", "edge", "late")
        await asyncio.sleep(5)
        assert r.results == {"ok": 2, "failed": 0}  # unchanged files: no more reloads
        task.cancel()

    virtual_loop.run(body())


def test_a_routes_entry_that_matches_no_route_is_a_warning(files: ConfigFiles) -> None:
    assert unmatched_routes(files) == []  # "edge" is a route
    write(files.api_keys, KEYS.replace('["edge"]', '["edge", "egde", "chat-*", "c?at"]'))
    assert unmatched_routes(files) == [
        f"{files.api_keys}: key 'a': routes entry {p!r} matches no route of {files.routes} "
        "(chat, edge)"
        for p in ("egde", "chat-*")
    ]
    assert check_files(files) == []  # not a problem: the key is refused what it misnames


def test_a_target_without_a_price_is_said_to_cost_nothing(files: ConfigFiles) -> None:
    assert unpriced_targets(files) == [
        f"{files.routes}: no target has a price: every answer costs 0"
    ]
    priced = ROUTES.replace(
        'kind = "synthetic"\n', 'kind = "synthetic"\nprice = { prompt = 0.5, completion = 1.5 }\n'
    )
    write(files.routes, priced + '\n[targets.free]\nkind = "synthetic"\n')
    assert unpriced_targets(files) == [
        f"{files.routes}: [targets.free] has no price: its tokens cost 0"
    ]
    write(files.routes, priced)
    assert unpriced_targets(files) == []
    write(files.routes, "not toml [")
    assert unpriced_targets(files) == []  # a bad file is check_files' to say


def test_a_reload_that_changes_a_budgets_period_keeps_what_was_spent_in_it(
    tmp_path: Path,
) -> None:
    from firsttoken.core.stream import Outcome, Usage
    from firsttoken.formats.errors import APIError
    from firsttoken.pricing import LegStart

    keys = '[[keys]]\nname = "a"\nkey = "sk-a"\nbudget = {{ amount = 0.01, per = "{per}" }}\n'
    (tmp_path / "keys.toml").write_text(keys.format(per="day"))
    (tmp_path / "routes.toml").write_text(
        ROUTES.replace('kind = "synthetic"', 'kind = "synthetic"\nprice = { completion = 10000 }')
    )
    files = ConfigFiles(str(tmp_path / "keys.toml"), str(tmp_path / "routes.toml"))
    r = reloader(files)
    adm = r.gateway.admission

    async def body() -> None:
        adm.ledger.ready.set()  # the store is open (no writer runs here: records stay queued)
        assert adm.keys is not None
        key = adm.keys.find("sk-a")
        assert key is not None
        ticket = await adm.admit(key, 0, 1, "chat", request_id="r1")
        ticket.legs = (LegStart("s"),)
        await ticket.release(Outcome.COMPLETED, Usage(completion=1))  # a cent: all of it
        for per in ("month", "total", "day"):  # each a budget of its own, until now
            write(files.api_keys, keys.format(per=per))
            assert await r.reload() is True
            key = adm.keys.find("sk-a")
            assert key is not None
            with pytest.raises(APIError) as refused:
                await adm.admit(key, 0, 1, "chat")
            assert refused.value.code == "budget_exceeded", per

    asyncio.run(body())


def test_check_and_reload_refuse_a_key_variable_the_start_refuses(
    files: ConfigFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FT_UNSET_UPSTREAM_KEY", raising=False)
    write(
        files.routes,
        ROUTES.replace(
            'kind = "synthetic"', 'kind = "synthetic"\napi_key_env = "FT_UNSET_UPSTREAM_KEY"'
        ),
    )
    assert check_files(files) == [
        f"{files.routes}: [targets.s] api_key_env: FT_UNSET_UPSTREAM_KEY is not set (or empty) "
        "in the environment"
    ]
    monkeypatch.setenv("FT_UNSET_UPSTREAM_KEY", "sk-upstream")
    assert check_files(files) == []


def test_settings_that_cannot_take_effect_are_each_told_once(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[keys]]\nname = "a"\nkey = "sk-a"\nroutes = ["chta", "c*"]\n'
        "budget = { amount = 1 }\n\n"
        '[[keys]]\nname = "a"\nkey = "sk-a2"\nroutes = ["chta", "c*"]\nbudget = { amount = 1 }\n\n'
        '[[keys]]\nname = "old"\nkey = "sk-old"\nexpires_at = 2020-01-01\n'
    )
    routes = parse_routes(
        {
            "targets": {
                "edge": {"kind": "synthetic"},
                "vllm": {"kind": "openai", "url": "http://x"},
            },
            "models": {
                "chat": {"targets": ["vllm"], "handoff": {"from": "edge", "after_tokens": 8}}
            },
        }
    )
    config = Configuration(KeyRing.load(keys), routes)
    assert ineffective(config, [], now=1.8e9) == [
        '[models.chat] handoff: every target of the route has continuation = "none", so none '
        "can take the answer over: 'edge' answers alone",
        "key 'a': routes entry 'chta' matches no route (chat)",
        "key 'a': budget: no target has a price, so nothing is ever spent",
        "key 'old': expires_at is past: every request gets 401 key_expired",
    ]
    # Without a routes file: the engine's models, and no price anywhere.
    assert ineffective(Configuration(KeyRing.load(keys)), ["chta"], now=1.0) == [
        "key 'a': budget: no target has a price, so nothing is ever spent"
    ]


def test_the_start_and_each_reload_warn_of_what_cannot_take_effect(
    files: ConfigFiles, caplog: pytest.LogCaptureFixture
) -> None:
    write(files.api_keys, KEYS.replace('["edge"]', '["egde"]'))
    r = reloader(files)
    caplog.set_level(logging.WARNING)
    r.warn_ineffective(r.running())  # what run() does first
    notes = [orjson.loads(m)["note"] for m in caplog.messages if "config.ineffective" in m]
    assert notes == ["key 'a': routes entry 'egde' matches no route (chat, edge)"]
    caplog.clear()
    write(files.api_keys, KEYS.replace('["edge"]', '["edge"]\nexpires_at = 2020-01-01'))
    assert asyncio.run(r.reload())
    notes = [orjson.loads(m)["note"] for m in caplog.messages if "config.ineffective" in m]
    assert notes == ["key 'a': expires_at is past: every request gets 401 key_expired"]


def test_a_currency_change_is_refused_while_a_key_has_a_budget(tmp_path: Path) -> None:
    budgeted = '[[keys]]\nname = "a"\nkey = "sk-a"\nbudget = { amount = 1, per = "day" }\n'
    priced = ROUTES.replace('kind = "synthetic"', 'kind = "synthetic"\nprice = { completion = 1 }')
    (tmp_path / "keys.toml").write_text(budgeted)
    (tmp_path / "routes.toml").write_text('currency = "USD"\n' + priced)
    files = ConfigFiles(str(tmp_path / "keys.toml"), str(tmp_path / "routes.toml"))
    r = reloader(files)
    ledger = r.gateway.admission.ledger

    async def body() -> None:
        write(files.routes, 'currency = "EUR"\n' + priced)
        assert await r.reload() is False  # its amount and its period's spend are in USD
        assert ledger.currency == "USD" and r.results == {"ok": 0, "failed": 1}
        write(files.api_keys, KEYS)  # no budget left: the currency may change
        assert await r.reload() is True
        assert ledger.currency == "EUR"

    asyncio.run(body())


def test_a_reload_reads_the_admin_key_file_again(tmp_path: Path) -> None:
    from starlette.requests import Request

    def asking(secret: str) -> Request:
        headers = [(b"authorization", f"Bearer {secret}".encode())]
        return Request({"type": "http", "headers": headers})

    admin = tmp_path / "admin.key"
    admin.write_text("old-secret\n")
    (tmp_path / "keys.toml").write_text(KEYS)
    app = create_app(Settings(api_keys=str(tmp_path / "keys.toml"), admin_key_file=str(admin)))
    r: Reloader = app.state.reloader
    assert r.files.admin_key == str(admin) and str(admin) in r.files.paths()  # watched too
    assert r.gateway.admin.allows(asking("old-secret"))

    async def body() -> None:
        admin.write_text("new-secret\n")
        assert await r.reload() is True
        assert r.gateway.admin.allows(asking("new-secret"))
        assert not r.gateway.admin.allows(asking("old-secret"))
        admin.write_text("")  # a half-written file: refused, the key stays
        assert await r.reload() is False
        assert r.gateway.admin.allows(asking("new-secret"))

    asyncio.run(body())
