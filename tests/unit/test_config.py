"""Settings without a process: the Redis pool's knob, its flag, its variable and its rule;
settings that cannot take effect beside the others are refused.
(The other knobs' conversion and checks: tests/system/test_config.py, with the CLI.)"""

from __future__ import annotations

import pytest

from firsttoken.config import SettingError, Settings, unknown_variables


def parse(*argv: str, **env: str) -> Settings:
    return Settings.from_args(list(argv), env=env)


REDIS = ("--redis", "redis://127.0.0.1:6379")


def test_redis_max_connections_default_flag_and_variable() -> None:
    assert Settings().redis_max_connections == 64
    assert parse(*REDIS, "--redis-max-connections", "8").redis_max_connections == 8
    assert parse(*REDIS, FIRSTTOKEN_REDIS_MAX_CONNECTIONS="16").redis_max_connections == 16
    flag_wins = parse(*REDIS, "--redis-max-connections", "8", FIRSTTOKEN_REDIS_MAX_CONNECTIONS="16")
    assert flag_wins.redis_max_connections == 8


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (
            ["--redis-max-connections", "1"],
            {},
            "invalid --redis-max-connections '1': must be an integer >= 2",
        ),
        (
            ["--redis-max-connections", "0"],
            {},
            "invalid --redis-max-connections '0': must be an integer >= 2",
        ),
        (
            [],
            {"FIRSTTOKEN_REDIS_MAX_CONNECTIONS": "many"},
            "invalid FIRSTTOKEN_REDIS_MAX_CONNECTIONS 'many': must be an integer >= 2",
        ),
        (
            ["--redis-max-connections", "6.5"],
            {},
            "invalid --redis-max-connections '6.5': must be an integer >= 2",
        ),
    ],
)
def test_redis_max_connections_refused_in_one_line(
    argv: list[str], env: dict[str, str], line: str
) -> None:
    with pytest.raises(SettingError) as refused:
        parse(*argv, **env)
    assert str(refused.value) == line


def test_redis_cluster_is_a_switch_that_needs_redis() -> None:
    assert Settings().redis_cluster is False
    assert parse(*REDIS, "--redis-cluster").redis_cluster is True  # the bare flag: on
    for word, on in (("1", True), ("Yes", True), ("true", True), ("0", False), ("no", False)):
        assert parse(*REDIS, "--redis-cluster", word).redis_cluster is on
        assert parse(*REDIS, FIRSTTOKEN_REDIS_CLUSTER=word).redis_cluster is on
    flag_wins = parse(*REDIS, "--redis-cluster", "0", FIRSTTOKEN_REDIS_CLUSTER="1")
    assert flag_wins.redis_cluster is False
    line = "invalid --redis-cluster 'maybe': must be 1, true, yes, 0, false or no"
    assert refusal(*REDIS, "--redis-cluster", "maybe") == line
    line = "--redis-cluster: takes effect only with --redis; --redis is not set"
    assert refusal("--redis-cluster") == line
    assert refusal(FIRSTTOKEN_REDIS_CLUSTER="0").startswith("FIRSTTOKEN_REDIS_CLUSTER: takes")
    with pytest.raises(SettingError, match="redis-cluster"):
        Settings(redis_cluster=True)  # built in code: the same rule


def test_redis_max_connections_built_in_code_is_checked_too() -> None:
    with pytest.raises(SettingError, match="redis-max-connections"):
        Settings(redis_max_connections=1)


# ---- a setting that cannot take effect is refused ---------------------------------------------

UPSTREAM = ("--upstream", "http://127.0.0.1:9/v1")
OPENAI = ("--engine", "openai", *UPSTREAM)


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (
            UPSTREAM,
            {},
            "--upstream: takes effect only with --engine openai; --engine is synthetic",
        ),
        (
            [],
            {"FIRSTTOKEN_UPSTREAM": "http://127.0.0.1:9/v1"},
            "FIRSTTOKEN_UPSTREAM: takes effect only with --engine openai; --engine is synthetic",
        ),
        (
            ["--engine", "llamacpp", "--upstream-api-key", "k"],
            {},
            "--upstream-api-key: takes effect only with --engine openai; --engine is llamacpp",
        ),
        (
            ["--upstream-connect-timeout-s", "2"],
            {},
            "--upstream-connect-timeout-s: takes effect only with --engine openai; "
            "--engine is synthetic",
        ),
        (
            [],
            {"FIRSTTOKEN_UPSTREAM_READ_TIMEOUT_S": "9"},
            "FIRSTTOKEN_UPSTREAM_READ_TIMEOUT_S: takes effect only with --engine openai; "
            "--engine is synthetic",
        ),
        (
            ["--model", __file__],
            {},
            "--model: takes effect only with --engine llamacpp; --engine is synthetic",
        ),
        (
            [*OPENAI, "--model", __file__],
            {},
            "--model: takes effect only with --engine llamacpp; --engine is openai",
        ),
        (
            ["--batch-timeout-ms", "20"],
            {},
            "--batch-timeout-ms: takes effect only with --batch-max above 0; --batch-max is 0",
        ),
        (
            ["--batch-step-base-ms", "5"],
            {},
            "--batch-step-base-ms: takes effect only with --batch-max above 0; --batch-max is 0",
        ),
        (
            [],
            {"FIRSTTOKEN_BATCH_STEP_PER_SEQ_MS": "2"},
            "FIRSTTOKEN_BATCH_STEP_PER_SEQ_MS: takes effect only with --batch-max above 0; "
            "--batch-max is 0",
        ),
        (
            [*OPENAI, "--batch-max", "4"],
            {},
            "--batch-max: takes effect only with --engine synthetic; --engine is openai",
        ),
        (
            [*OPENAI, "--synthetic-ttft-ms", "5"],
            {},
            "--synthetic-ttft-ms: takes effect only with --engine synthetic; --engine is openai",
        ),
        (
            ["--engine", "llamacpp"],
            {"FIRSTTOKEN_SYNTHETIC_ITL_MS": "1"},
            "FIRSTTOKEN_SYNTHETIC_ITL_MS: takes effect only with --engine synthetic; "
            "--engine is llamacpp",
        ),
        (
            [*OPENAI, "--synthetic-style", "markdown"],
            {},
            "--synthetic-style: takes effect only with --engine synthetic; --engine is openai",
        ),
        (
            ["--batch-max", "4", "--synthetic-ttft-ms", "5"],
            {},
            "--synthetic-ttft-ms: takes effect only with --batch-max 0 (batching sets its own "
            "pace); --batch-max is 4",
        ),
        (
            ["--redis-max-connections", "8"],
            {},
            "--redis-max-connections: takes effect only with --redis; --redis is not set",
        ),
    ],
)
def test_a_setting_that_cannot_take_effect_is_refused_in_one_line(
    argv: list[str], env: dict[str, str], line: str
) -> None:
    with pytest.raises(SettingError) as refused:
        parse(*argv, **env)
    assert str(refused.value) == line


def refusal(*argv: str, **env: str) -> str:
    with pytest.raises(SettingError) as refused:
        parse(*argv, **env)
    return str(refused.value)


def test_a_flag_equal_to_its_default_still_counts_as_given() -> None:
    # Typed on purpose, so the purpose is told it does not hold (the default alone is not).
    line = refusal(*OPENAI, "--synthetic-itl-ms", "20")
    assert line.startswith("--synthetic-itl-ms: takes effect only with --engine synthetic")
    line = refusal(FIRSTTOKEN_BATCH_TIMEOUT_MS="50")
    assert line.startswith("FIRSTTOKEN_BATCH_TIMEOUT_MS: takes effect only with --batch-max")
    relay = parse(*OPENAI)
    assert relay.synthetic_itl_ms == 20.0 and relay.batch_timeout_ms == 50.0


def test_an_empty_optional_variable_is_not_given() -> None:
    assert parse(FIRSTTOKEN_UPSTREAM="", FIRSTTOKEN_MODEL="").upstream is None


def test_settings_that_take_effect_are_accepted() -> None:
    relay = parse(*OPENAI, "--upstream-api-key", "k", "--upstream-read-timeout-s", "5")
    assert relay.upstream_api_key == "k" and relay.upstream_read_timeout_s == 5
    batching = parse("--batch-max", "4", "--batch-timeout-ms", "20", "--synthetic-style", "hostile")
    assert batching.batch_timeout_ms == 20 and batching.synthetic_style == "hostile"
    assert parse("--engine", "llamacpp", "--model", __file__).model == __file__
    assert parse("--synthetic-ttft-ms", "0", "--synthetic-itl-ms", "0").synthetic_ttft_ms == 0
    # Settings every engine reads are never refused.
    assert parse(*OPENAI, "--cache-ttl-s", "5", "--coalesce", "boundary").cache_ttl_s == 5


def test_settings_built_in_code_are_refused_when_they_differ_from_the_default() -> None:
    with pytest.raises(SettingError) as refused:
        Settings(engine="openai", upstream="http://127.0.0.1:9/v1", synthetic_ttft_ms=0)
    assert str(refused.value).startswith("--synthetic-ttft-ms: takes effect only with --engine")
    with pytest.raises(SettingError) as refused:
        Settings(batch_timeout_ms=10)
    assert str(refused.value).startswith("--batch-timeout-ms: takes effect only with --batch-max")
    # A default passed on in code is not a choice (replace() and **vars() do that).
    assert Settings(engine="openai", upstream="http://127.0.0.1:9/v1", synthetic_ttft_ms=200.0)


def test_tls_takes_both_files_or_neither(tmp_path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")
    both = parse("--ssl-certfile", str(cert), FIRSTTOKEN_SSL_KEYFILE=str(key))
    assert (both.ssl_certfile, both.ssl_keyfile) == (str(cert), str(key))
    assert Settings().ssl_certfile is None and Settings().ssl_keyfile is None
    with pytest.raises(SettingError) as alone:
        parse("--ssl-certfile", str(cert))
    assert str(alone.value) == (
        "--ssl-certfile: takes effect only with --ssl-keyfile; --ssl-keyfile is not set"
    )
    with pytest.raises(SettingError) as alone:
        parse(FIRSTTOKEN_SSL_KEYFILE=str(key))
    assert str(alone.value) == (
        "FIRSTTOKEN_SSL_KEYFILE: takes effect only with --ssl-certfile; --ssl-certfile is not set"
    )
    with pytest.raises(SettingError) as missing:
        parse("--ssl-certfile", str(tmp_path / "nope.pem"), "--ssl-keyfile", str(key))
    assert str(missing.value) == f"invalid --ssl-certfile '{tmp_path / 'nope.pem'}': no such file"


def test_upstream_errors_and_trust_trace_headers_defaults_flags_and_variables() -> None:
    # Issue 37.7 and 37.11: two knobs, each with its variable and a one-line refusal.
    assert Settings().upstream_errors == "pass" and Settings().trust_trace_headers is False
    assert parse("--upstream-errors", "redact").upstream_errors == "redact"
    assert parse(FIRSTTOKEN_UPSTREAM_ERRORS="redact").upstream_errors == "redact"
    assert parse("--trust-trace-headers").trust_trace_headers is True
    assert parse(FIRSTTOKEN_TRUST_TRACE_HEADERS="yes").trust_trace_headers is True
    assert refusal(FIRSTTOKEN_UPSTREAM_ERRORS="hide") == (
        "invalid FIRSTTOKEN_UPSTREAM_ERRORS 'hide': must be one of pass, redact"
    )
    assert refusal(FIRSTTOKEN_TRUST_TRACE_HEADERS="maybe") == (
        "invalid FIRSTTOKEN_TRUST_TRACE_HEADERS 'maybe': must be 1, true, yes, 0, false or no"
    )


# ---- beside --routes: the file builds every engine -------------------------------------------

SINGLE = "takes effect only with a single engine (not --routes)"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        # The routes file's synthetic targets never batch, and never fail on purpose.
        (["--batch-max", "4"], f"--batch-max: {SINGLE}"),
        (["--synthetic-fail-rate", "0.1"], f"--synthetic-fail-rate: {SINGLE}"),
        (["--engine", "llamacpp"], f"--engine: {SINGLE}"),
        (["--engine", "synthetic"], f"--engine: {SINGLE}"),
        (["--model", __file__], f"--model: {SINGLE}"),
        (["--upstream-api-key", "k"], f"--upstream-api-key: {SINGLE}"),
        # Refused for the real reason, not for a missing --upstream.
        (
            ["--engine", "openai"],
            "--routes: cannot go with --engine openai or --upstream: name the upstreams as "
            "targets in the routes file",
        ),
    ],
)
def test_engine_settings_beside_routes_are_refused_for_the_real_reason(
    argv: list[str], line: str
) -> None:
    said = refusal("--routes", __file__, *argv)
    assert said == line or said.startswith(f"{line}; --routes is "), said


def test_routes_leave_the_synthetic_pace_to_the_file() -> None:
    # A routes file's synthetic targets read these (preflight checks that one does).
    pace = ("--synthetic-itl-ms", "5", "--synthetic-style", "hostile")
    settings = parse("--routes", __file__, *pace)
    assert settings.synthetic_itl_ms == 5 and settings.synthetic_style == "hostile"


def test_caddys_variables_are_not_taken_for_typos() -> None:
    env = {"FIRSTTOKEN_SITE": "localhost:8443", "FIRSTTOKEN_BIND": "0.0.0.0"}
    env["FIRSTTOKEN_HOTS"] = "x"  # a typo beside them is still told
    assert unknown_variables(env) == {"FIRSTTOKEN_HOTS": "FIRSTTOKEN_HOST"}


def test_admin_key_env_names_a_variable_that_holds_a_secret(monkeypatch) -> None:
    monkeypatch.delenv("FT_ADMIN_UNSET", raising=False)
    monkeypatch.setenv("FT_ADMIN_SET", "s3cret")
    assert parse("--admin-key-env", "FT_ADMIN_SET").admin_key_env == "FT_ADMIN_SET"
    line = "--admin-key-env: $FT_ADMIN_UNSET is empty or not set"
    assert refusal("--admin-key-env", "FT_ADMIN_UNSET") == line
    assert "environment variable" in refusal("--admin-key-env", "not a name")
    line = (
        "--metrics-need-admin: takes effect only with --admin-key-env or --admin-key-file; "
        "neither is set"
    )
    assert refusal("--metrics-need-admin") == line
    assert parse("--admin-key-env", "FT_ADMIN_SET", "--metrics-need-admin").metrics_need_admin


def test_admin_key_file_holds_the_key_and_stands_for_the_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FT_ADMIN_SET", "s3cret")
    key, empty = tmp_path / "admin.key", tmp_path / "empty.key"
    key.write_text("s3cret\n")
    empty.write_text("\n")
    settings = parse("--admin-key-file", str(key), "--metrics-need-admin")
    assert settings.admin_key == str(key) and settings.metrics_need_admin
    assert refusal("--admin-key-file", str(empty)).endswith("is empty: it must hold the admin key")
    assert refusal("--admin-key-file", str(tmp_path / "none")).endswith("no such file")
    both = refusal("--admin-key-file", str(key), "--admin-key-env", "FT_ADMIN_SET")
    assert both.startswith("--admin-key-file: takes effect only with no --admin-key-env")


def test_a_secret_given_where_a_variable_name_goes_is_never_echoed() -> None:
    # Following a hint, someone sets FIRSTTOKEN_ADMIN_KEY_ENV to the key itself.
    line = refusal(FIRSTTOKEN_ADMIN_KEY_ENV="sk-admin-9f8e/7d6c+5b4a")
    assert "sk-admin" not in line
    assert line.startswith("FIRSTTOKEN_ADMIN_KEY_ENV: must be the name of the environment ")
    assert "not the key" in line and "firsttoken serve --admin-key-env FIRSTTOKEN_ADMIN_KEY" in line


def test_the_variable_admin_key_env_names_is_not_taken_for_a_typo() -> None:
    env = {"FIRSTTOKEN_ADMIN_KEY": "secret", "FIRSTTOKEN_GATEWAY": "127.0.0.1:8000"}
    assert unknown_variables(env, named=("FIRSTTOKEN_ADMIN_KEY",)) == {}
    assert unknown_variables(env) == {"FIRSTTOKEN_ADMIN_KEY": "FIRSTTOKEN_ADMIN_KEY_ENV"}
