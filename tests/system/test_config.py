"""Settings: one conversion and one set of checks for flags and FIRSTTOKEN_* variables."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from firsttoken import __version__
from firsttoken.config import Range, SettingError, Settings, env_var, flag, unknown_variables
from tests.servers import ROOT, run_server


def parse(*argv: str, **env: str) -> Settings:
    return Settings.from_args(list(argv), env=env)


def refused(*argv: str, **env: str) -> SettingError:
    with pytest.raises(SettingError) as info:
        parse(*argv, **env)
    return info.value


def test_defaults_and_precedence() -> None:
    assert parse() == Settings()
    s = parse("--port", "9001", FIRSTTOKEN_PORT="9002", FIRSTTOKEN_HEARTBEAT_S="2.5")
    assert s.port == 9001  # the flag wins over the variable
    assert s.heartbeat_s == 2.5
    assert parse(FIRSTTOKEN_COALESCE="boundary").coalesce == "boundary"


@pytest.mark.parametrize(
    ("argv", "env", "source", "value", "words"),
    [
        (["--heartbeat-s", "0"], {}, "--heartbeat-s", "0", ">= 0.01"),
        (["--heartbeat-s", "-1"], {}, "--heartbeat-s", "-1", ">= 0.01"),
        ([], {"FIRSTTOKEN_HEARTBEAT_S": "nan"}, "FIRSTTOKEN_HEARTBEAT_S", "nan", "a number"),
        ([], {"FIRSTTOKEN_COALESCE": "boundry"}, "FIRSTTOKEN_COALESCE", "boundry", "off, boundary"),
        ([], {"FIRSTTOKEN_PORT": "abc"}, "FIRSTTOKEN_PORT", "abc", "an integer from 0 to 65535"),
        (["--port", "70000"], {}, "--port", "70000", "from 0 to 65535"),
        (["--workers", "0"], {}, "--workers", "0", "from 1"),
        (["--rate-limit-burst", "1.5"], {}, "--rate-limit-burst", "1.5", "an integer"),
        (["--memory-shed-fraction", "0"], {}, "--memory-shed-fraction", "0", "> 0"),
        (["--breaker-error-rate", "2"], {}, "--breaker-error-rate", "2", "from 0 to 1"),
        (["--send-timeout-s", "0"], {}, "--send-timeout-s", "0", "> 0"),
        (["--engine", "vllm"], {}, "--engine", "vllm", "synthetic, openai, llamacpp"),
        (["--log-level", "loud"], {}, "--log-level", "loud", "debug, info, warning, error"),
        (["--memory-limit", "2X"], {}, "--memory-limit", "2X", "512M"),
        (["--redis", "http://x:6379"], {}, "--redis", "http://x:6379", "redis://"),
        (["--api-keys", "/no/such/keys.toml"], {}, "--api-keys", "/no/such/keys.toml", "no such"),
        ([], {"FIRSTTOKEN_MODEL": "/no/x.gguf"}, "FIRSTTOKEN_MODEL", "/no/x.gguf", "no such file"),
        (["--canned-answers", "/"], {}, "--canned-answers", "/", "directory"),
        (["--host", "a b"], {}, "--host", "a b", "address"),
        (
            ["--engine", "openai", "--upstream", "localhost:8000"],
            {},
            "--upstream",
            "localhost:8000",
            "http(s)",
        ),
    ],
)
def test_bad_values_name_setting_value_and_rule(
    argv: list[str], env: dict[str, str], source: str, value: str, words: str
) -> None:
    err = refused(*argv, **env)
    line = str(err)
    assert err.source == source
    assert "\n" not in line
    assert line.startswith(f"invalid {source} {value!r}: "), line
    assert words in line, line


def test_openai_engine_needs_an_upstream() -> None:
    err = refused("--engine", "openai")
    assert err.name == "upstream"
    assert str(err) == "--upstream: required with --engine openai (URL[,URL...])"
    s = parse(FIRSTTOKEN_ENGINE="openai", FIRSTTOKEN_UPSTREAM="http://a:1,https://b/v1")
    assert s.upstream == "http://a:1,https://b/v1"


def test_empty_optional_variable_is_unset(tmp_path: Path) -> None:
    assert parse(FIRSTTOKEN_REDIS="", FIRSTTOKEN_API_KEYS="").redis is None
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nname = "a"\nkey = "k"\n')
    assert parse("--api-keys", str(keys)).api_keys == str(keys)


def test_settings_built_in_code_are_checked_too() -> None:
    with pytest.raises(SettingError, match="heartbeat-s"):
        Settings(heartbeat_s=0)
    with pytest.raises(SettingError, match="coalesce"):
        Settings(coalesce="boundry")
    with pytest.raises(SettingError, match="integer"):
        Settings(port=80.5)  # type: ignore[arg-type]


def test_every_setting_has_a_flag_a_variable_and_a_readme_row() -> None:
    readme = (ROOT / "README.md").read_text()
    parser = Settings.parser()
    known = {a.dest for a in parser._actions}
    for f in fields(Settings):
        assert f.name in known
        assert f"`{flag(f.name)}`" in readme, f"README has no row for {flag(f.name)}"
        assert env_var(f.name).startswith("FIRSTTOKEN_")


def test_range_words() -> None:
    assert Range(0, 65535).describe() == "from 0 to 65535"
    assert Range(0, above=True).describe() == "> 0"
    assert Range(0, 1, above=True).describe() == "> 0 and <= 1"
    assert Range(1).describe() == ">= 1"
    assert Range(4, 1_048_576).describe() == "from 4 to 1048576"
    assert Range(0.01).describe() == ">= 0.01"
    assert Range(0, 1, above=True).allows(1) and not Range(0, 1, above=True).allows(0)


# ---- the command line, as a person meets it ------------------------------------------------


def firsttoken(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FIRSTTOKEN_")}
    return subprocess.run(
        [sys.executable, "-m", "firsttoken", *args],
        cwd=ROOT,
        env={**full_env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--heartbeat-s", "0"], {}, "firsttoken serve: invalid --heartbeat-s '0': must be a"),
        ([], {"FIRSTTOKEN_COALESCE": "boundry"}, "invalid FIRSTTOKEN_COALESCE 'boundry'"),
        ([], {"FIRSTTOKEN_PORT": "abc"}, "invalid FIRSTTOKEN_PORT 'abc': must be an integer"),
        (["--api-keys", "missing-keys.toml"], {}, "invalid --api-keys 'missing-keys.toml'"),
        (["--engine", "openai"], {}, "--upstream: required with --engine openai"),
        (["--engine", "llamacpp", "--model", "no.gguf"], {}, "invalid --model 'no.gguf'"),
        # Settings that cannot take effect beside the others (issue 26): refused, not ignored.
        (
            ["--upstream", "http://127.0.0.1:9/v1"],
            {},
            "firsttoken serve: --upstream: takes effect only with --engine openai; "
            "--engine is synthetic",
        ),
        (
            [],
            {"FIRSTTOKEN_MODEL": "pyproject.toml"},
            "firsttoken serve: FIRSTTOKEN_MODEL: takes effect only with --engine llamacpp",
        ),
        (
            ["--batch-timeout-ms", "50"],
            {},
            "firsttoken serve: --batch-timeout-ms: takes effect only with --batch-max above 0",
        ),
    ],
)
def test_bad_setting_exits_2_with_one_line(
    args: list[str], env: dict[str, str], expected: str
) -> None:
    proc = firsttoken("serve", *args, env=env)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_flag_is_the_error_and_a_hint_not_the_usage() -> None:
    proc = firsttoken("serve", "--prot", "8000")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "firsttoken serve: unrecognized arguments: --prot 8000",
        "try 'firsttoken serve --help' for the options",
    ]
    proc = firsttoken("serv")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 2
    assert "unknown command 'serv'" in proc.stderr
    proc = firsttoken("diag", "--concurency", "2", "http://127.0.0.1:9/v1/streams")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 2


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["serve", "--po", "70000"], "firsttoken serve: unrecognized arguments: --po 70000"),
        (
            ["diag", "--conc", "2", "http://127.0.0.1:9/v1/streams"],
            "firsttoken diag: unrecognized arguments: --conc",
        ),
        (["replay", "--spe", "2", "x.jsonl"], "firsttoken replay: unrecognized arguments: --spe"),
    ],
)
def test_abbreviated_flags_are_refused(args: list[str], line: str) -> None:
    # argparse would read `--po` as `--port` (and then refuse 70000 for a reason the user
    # did not expect); a flag must be spelled out.
    proc = firsttoken(*args)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith(line), proc.stderr


def test_version() -> None:
    for args in (["--version"], ["serve", "--version"]):
        proc = firsttoken(*args)
        assert proc.returncode == 0
        assert proc.stdout.strip() == f"firsttoken {__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{__version__}"' in pyproject


def test_unknown_variables_are_named_with_the_closest_setting() -> None:
    env = {"FIRSTTOKEN_HEARTBEAT": "5", "FIRSTTOKEN_PORT": "1", "FIRSTTOKEN_ZZZ": "", "HOME": "/"}
    assert unknown_variables(env) == {
        "FIRSTTOKEN_HEARTBEAT": "FIRSTTOKEN_HEARTBEAT_S",
        "FIRSTTOKEN_ZZZ": None,
    }


def test_the_readmes_admin_key_example_starts_without_a_warning_or_a_loop() -> None:
    readme = (ROOT / "README.md").read_text()
    assert (
        "FIRSTTOKEN_ADMIN_KEY=... firsttoken serve --admin-key-env FIRSTTOKEN_ADMIN_KEY" in readme
    )
    secret = "admin-9f8e7d6c5b4a"
    env = {"FIRSTTOKEN_ADMIN_KEY": secret}
    with run_server("--admin-key-env", "FIRSTTOKEN_ADMIN_KEY", env=env) as server:
        events = [r.get("event") for r in server.log_records()]
        assert "config.unknown_variable" not in events
    # The variable without the flag: the hint says what to set, and never shows the key.
    with run_server(env=env) as server:
        (warned,) = [r for r in server.log_records() if r.get("event") == "config.unknown_variable"]
        assert "set FIRSTTOKEN_ADMIN_KEY_ENV=FIRSTTOKEN_ADMIN_KEY" in warned["note"]
        assert secret not in "\n".join(server.log)
    # Following an older hint, the key itself where its variable's name goes: exit 2, unseen.
    proc = firsttoken("serve", env={"FIRSTTOKEN_ADMIN_KEY_ENV": secret})
    assert proc.returncode == 2 and secret not in proc.stdout + proc.stderr
