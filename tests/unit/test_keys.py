from __future__ import annotations

from pathlib import Path

import pytest

from firsttoken.admission.keys import ApiKey, KeyRing


def test_keys_are_found_by_secret(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        '[[keys]]\nname = "alice"\nkey = "sk-a"\nmax_streams = 2\n\n'
        '[[keys]]\nname = "bob"\nkey = "sk-b"\ntokens_per_minute = 100\n'
    )
    ring = KeyRing.load(path)
    assert ring.find("sk-a") == ApiKey(name="alice", max_streams=2)
    assert ring.find("sk-b") == ApiKey(name="bob", tokens_per_minute=100)
    assert ring.find("sk-c") is None and ring.find("") is None


@pytest.mark.parametrize(
    "body",
    [
        "",
        '[[keys]]\nname = "x"\n',
        '[[keys]]\nname = "x"\nkey = "k"\nmax_streams = 0\n',
        '[[keys]]\nname = "x"\nkey = "k"\ntokens_per_minute = "lots"\n',
    ],
)
def test_a_bad_keys_file_names_what_is_wrong(tmp_path: Path, body: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(body)
    with pytest.raises(ValueError, match="keys"):
        KeyRing.load(path)


def test_the_same_key_under_two_names_is_refused(tmp_path: Path) -> None:
    # Which name's limits would a request with it get? The file must say one.
    path = tmp_path / "keys.toml"
    path.write_text(
        '[[keys]]\nname = "alice"\nkey = "sk-a"\nmax_streams = 2\n\n'
        '[[keys]]\nname = "bob"\nkey = "sk-b"\n\n'
        '[[keys]]\nname = "carol"\nkey = "sk-a"\nmax_streams = 50\n'
    )
    with pytest.raises(ValueError) as refused:
        KeyRing.load(path)
    assert str(refused.value) == (
        f"{path}: keys[2] ('carol') has the same key as keys[0] ('alice'); "
        "each key must be listed once"
    )


def test_priority_and_weight_default_and_parse(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        '[[keys]]\nname = "batch"\nkey = "sk-b"\npriority = -1\nweight = 0.5\n\n'
        '[[keys]]\nname = "live"\nkey = "sk-l"\npriority = 2\nweight = 3\n\n'
        '[[keys]]\nname = "plain"\nkey = "sk-p"\n'
    )
    ring = KeyRing.load(path)
    assert ring.find("sk-b") == ApiKey(name="batch", priority=-1, weight=0.5)
    live = ring.find("sk-l")
    assert live is not None and live.priority == 2
    assert live.weight == 3.0 and isinstance(live.weight, float)
    assert ring.find("sk-p") == ApiKey(name="plain", priority=0, weight=1.0)
    assert ring.names() == ["batch", "live", "plain"]


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ('priority = "high"', "keys[0].priority must be an integer"),
        ("priority = 1.5", "keys[0].priority must be an integer"),
        ("priority = true", "keys[0].priority must be an integer"),
        ("weight = 0", "keys[0].weight must be a positive number"),
        ("weight = -2", "keys[0].weight must be a positive number"),
        ("weight = nan", "keys[0].weight must be a positive number"),
        ("weight = inf", "keys[0].weight must be a positive number"),
        ('weight = "2"', "keys[0].weight must be a positive number"),
        ("weight = true", "keys[0].weight must be a positive number"),
        ("max_streams = true", "keys[0].max_streams must be a positive integer"),
    ],
)
def test_a_bad_priority_or_weight_is_one_line_naming_it(
    tmp_path: Path, field: str, message: str
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f'[[keys]]\nname = "x"\nkey = "k"\n{field}\n')
    with pytest.raises(ValueError) as refused:
        KeyRing.load(path)
    assert str(refused.value) == f"{path}: {message}"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # A typo would leave the key on the default limit without a word.
        (
            "max_stream = 3",
            "keys[0].max_stream: unknown field (known: name, key, max_streams, "
            "tokens_per_minute, resume_max_bytes, priority, weight, budget)",
        ),
        (
            "weigth = 2",
            "keys[0].weigth: unknown field (known: name, key, max_streams, "
            "tokens_per_minute, resume_max_bytes, priority, weight, budget)",
        ),
    ],
)
def test_an_unknown_field_is_refused_naming_the_known_ones(
    tmp_path: Path, body: str, message: str
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f'[[keys]]\nname = "x"\nkey = "k"\n{body}\n')
    with pytest.raises(ValueError) as refused:
        KeyRing.load(path)
    assert str(refused.value) == f"{path}: {message}"


SHAPE = '[[keys]] entries (name = "...", key = "...")'


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[keys]\nname = "alice"\nkey = "sk-a"\n', f"keys is a table; write each key as {SHAPE}"),
        (
            '[keys.alice]\nkey = "sk-a"\n',
            f"keys is a table; write each key as {SHAPE}",
        ),
        ('keys = ["sk-secret"]\n', f"keys[0] is not a table; write each key as {SHAPE}"),
        ('keys = "sk-secret"\n', f"keys is not a list of tables; write each key as {SHAPE}"),
        (
            '[[key]]\nname = "a"\nkey = "sk-a"\n',
            f"unknown table or field 'key' (expected {SHAPE})",
        ),
    ],
)
def test_a_keys_file_of_the_wrong_shape_says_so_without_its_secrets(
    tmp_path: Path, body: str, message: str
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(body)
    with pytest.raises(ValueError) as refused:
        KeyRing.load(path)
    assert str(refused.value) == f"{path}: {message}"
    assert "sk-" not in str(refused.value)
