"""Settings without a process: the Redis pool's knob, its flag, its variable and its rule.
(The other knobs' conversion and checks: tests/system/test_config.py, with the CLI.)"""

from __future__ import annotations

import pytest

from firsttoken.config import SettingError, Settings


def parse(*argv: str, **env: str) -> Settings:
    return Settings.from_args(list(argv), env=env)


def test_redis_max_connections_default_flag_and_variable() -> None:
    assert Settings().redis_max_connections == 64
    assert parse("--redis-max-connections", "8").redis_max_connections == 8
    assert parse(FIRSTTOKEN_REDIS_MAX_CONNECTIONS="16").redis_max_connections == 16
    flag_wins = parse("--redis-max-connections", "8", FIRSTTOKEN_REDIS_MAX_CONNECTIONS="16")
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


def test_redis_max_connections_built_in_code_is_checked_too() -> None:
    with pytest.raises(SettingError, match="redis-max-connections"):
        Settings(redis_max_connections=1)
