from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from firsttoken.admission.keys import ApiKey, KeyRing, digest_hex, new_secret, rotate
from tests.unit.clock import FakeClock


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


KNOWN = (
    "name, key, key_sha256, max_streams, tokens_per_minute, requests_per_minute, "
    "resume_max_bytes, priority, weight, routes, expires_at, disabled, budget"
)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # A typo would leave the key on the default limit without a word.
        (
            "max_stream = 3",
            f"keys[0].max_stream: unknown field (known: {KNOWN})",
        ),
        (
            "weigth = 2",
            f"keys[0].weigth: unknown field (known: {KNOWN})",
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


def load(tmp_path: Path, body: str) -> KeyRing:
    path = tmp_path / "keys.toml"
    path.write_text(body)
    return KeyRing.load(path)


def test_routes_allow_names_and_globs_and_default_to_every_route(tmp_path: Path) -> None:
    ring = load(
        tmp_path,
        '[[keys]]\nname = "a"\nkey = "sk-a"\nroutes = ["chat", "edge-*", "v[12]"]\n\n'
        '[[keys]]\nname = "b"\nkey = "sk-b"\n',
    )
    a, b = ring.find("sk-a"), ring.find("sk-b")
    assert a is not None and b is not None
    assert [m for m in ("chat", "edge-1", "edge", "v1", "v3", "chat-2") if a.may_use(m)] == [
        "chat",
        "edge-1",
        "v1",
    ]
    assert b.routes is None and b.may_use("anything")
    none = load(tmp_path, '[[keys]]\nname = "n"\nkey = "sk-n"\nroutes = []\n').find("sk-n")
    assert none is not None and not none.may_use("chat")  # an empty list: no route


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ('"chat"', 'keys[0].routes must be a list of route names or globs (routes = ["chat"'),
        ('["edge-[12"]', "keys[0].routes 'edge-[12': a bad glob"),
        ('["a]"]', "keys[0].routes 'a]': a bad glob"),
        ('["chat bot"]', "keys[0].routes 'chat bot': a route name or glob is made of"),
        ('[""]', "keys[0].routes must be route names or globs"),
        ("[1]", "keys[0].routes must be route names or globs"),
    ],
)
def test_a_bad_routes_entry_is_one_line_naming_it(
    tmp_path: Path, routes: str, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        load(tmp_path, f'[[keys]]\nname = "x"\nkey = "k"\nroutes = {routes}\n')
    assert str(refused.value).startswith(f"{tmp_path / 'keys.toml'}: {message}")


def test_a_key_given_by_its_digest_is_found_by_its_secret(tmp_path: Path) -> None:
    secret = new_secret()
    assert len(secret) >= 3 + 43  # "sk-" and 256 bits in base64
    ring = load(tmp_path, f'[[keys]]\nname = "a"\nkey_sha256 = "{digest_hex(secret).upper()}"\n')
    found = ring.find(secret)
    assert found is not None and found.name == "a"
    assert ring.find(secret + "x") is None


@pytest.mark.parametrize(
    ("secret", "message"),
    [
        ('key_sha256 = "abc"', "keys[0].key_sha256 must be 64 hex digits"),
        ("", "keys[0] needs a string 'name' and one of 'key' or 'key_sha256'"),
        (
            f'key = "k"\nkey_sha256 = "{"0" * 64}"',
            "keys[0] needs a string 'name' and one of 'key' or 'key_sha256'",
        ),
    ],
)
def test_a_key_needs_exactly_one_well_formed_secret(
    tmp_path: Path, secret: str, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        load(tmp_path, f'[[keys]]\nname = "x"\n{secret}\n')
    assert str(refused.value).startswith(f"{tmp_path / 'keys.toml'}: {message}")


def test_a_secret_given_plainly_and_as_its_digest_is_the_same_key_twice(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"keys\[1\] \('b'\) has the same key as keys\[0\]"):
        load(
            tmp_path,
            f'[[keys]]\nname = "a"\nkey = "sk-a"\n\n'
            f'[[keys]]\nname = "b"\nkey_sha256 = "{digest_hex("sk-a")}"\n',
        )


def test_expiry_and_disabling_refuse_the_key_on_the_clock_given(tmp_path: Path) -> None:
    ring = load(
        tmp_path,
        '[[keys]]\nname = "temp"\nkey = "sk-t"\nexpires_at = 2030-01-01T00:00:00Z\n\n'
        '[[keys]]\nname = "local"\nkey = "sk-l"\nexpires_at = 2030-01-01T01:00:00+01:00\n\n'
        '[[keys]]\nname = "day"\nkey = "sk-d"\nexpires_at = 2030-01-01\n\n'
        '[[keys]]\nname = "off"\nkey = "sk-o"\ndisabled = true\n',
    )
    clock = FakeClock(start=1_893_456_000.0 - 1)  # 2030-01-01T00:00:00Z, less a second
    temp, local, day, off = (ring.find(s) for s in ("sk-t", "sk-l", "sk-d", "sk-o"))
    assert temp is not None and local is not None and day is not None and off is not None
    assert temp.expires_at == local.expires_at == day.expires_at == 1_893_456_000.0
    assert temp.refusal(clock()) is None
    assert off.refusal(clock()) == "key_disabled"
    clock.advance(1)
    assert temp.refusal(clock()) == "key_expired"
    plain = load(tmp_path, '[[keys]]\nname = "n"\nkey = "k"\n').find("k")
    assert plain is not None and plain.refusal(clock()) is None  # no expiry: never


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ('expires_at = "2030-01-01"', "keys[0].expires_at must be a TOML date-time"),
        ('disabled = "yes"', "keys[0].disabled must be true or false"),
        ("requests_per_minute = 0", "keys[0].requests_per_minute must be a positive integer"),
    ],
)
def test_a_bad_lifetime_or_rate_is_one_line_naming_it(
    tmp_path: Path, field: str, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        load(tmp_path, f'[[keys]]\nname = "x"\nkey = "k"\n{field}\n')
    assert str(refused.value).startswith(f"{tmp_path / 'keys.toml'}: {message}")


def test_a_file_that_is_not_toml_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as refused:
        load(tmp_path, '[[keys]]\nname = "x\n')
    assert str(refused.value).startswith(f"{tmp_path / 'keys.toml'}: not valid TOML (")


def test_a_reloaded_ring_says_which_secrets_it_still_holds(tmp_path: Path) -> None:
    # A name may hold two secrets while it is rotated.
    old = load(
        tmp_path, '[[keys]]\nname = "a"\nkey = "sk-1"\n\n[[keys]]\nname = "a"\nkey = "sk-2"\n'
    )
    new = load(tmp_path, '[[keys]]\nname = "a"\nkey = "sk-2"\nweight = 2\n')
    first, second = old.find("sk-1"), old.find("sk-2")
    assert first is not None and second is not None
    assert new.holds(first) is None  # rotated out: its streams end
    assert new.holds(second) == ApiKey(name="a", weight=2.0)  # the same secret, new settings


def test_the_entries_of_one_name_must_share_its_limits(tmp_path: Path) -> None:
    # The name's counters (streams, minute, budget) are one: a second secret with other
    # limits (or none) would escape the first's.
    with pytest.raises(ValueError) as refused:
        load(
            tmp_path,
            '[[keys]]\nname = "a"\nkey = "sk-1"\nrequests_per_minute = 2\n\n'
            '[[keys]]\nname = "a"\nkey = "sk-2"\n',
        )
    assert str(refused.value).startswith(
        f"{tmp_path / 'keys.toml'}: keys[1].requests_per_minute differs from "
        "keys[0].requests_per_minute, the same name 'a': "
    )
    assert "firsttoken keys rotate a" in str(refused.value)


def test_the_entries_of_one_name_may_differ_in_lifetime(tmp_path: Path) -> None:
    ring = load(
        tmp_path,
        '[[keys]]\nname = "a"\nkey = "sk-1"\nweight = 2\nexpires_at = 2020-01-01\n\n'
        '[[keys]]\nname = "a"\nkey = "sk-2"\nweight = 2.0\n\n'
        '[[keys]]\nname = "a"\nkey = "sk-3"\nweight = 2\ndisabled = true\n',
    )
    assert [k.weight for k in ring.keys()] == [2.0, 2.0, 2.0]


def test_rotate_appends_a_secret_with_the_names_limits_but_not_its_lifetime(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        '[[keys]]\nname = "b"\nkey = "sk-b"\n\n'
        '[[keys]]\nname = "a"\nkey = "sk-1"\nmax_streams = 1\nrequests_per_minute = 2\n'
        'routes = ["chat", "edge-*"]\nbudget = { amount = 0.01, per = "month" }\n'
        "weight = 1.5\npriority = -1\nexpires_at = 2030-01-01T00:00:00Z\n"
    )
    path.chmod(0o600)
    secret, index = rotate(path, "a")
    assert index == 2 and secret.startswith("sk-")
    assert secret not in path.read_text() and path.stat().st_mode & 0o777 == 0o600
    ring = KeyRing.load(path)
    old, new = ring.find("sk-1"), ring.find(secret)
    assert old is not None and new is not None
    assert new == replace(old, expires_at=None)
    assert ring.find("sk-b") == ApiKey(name="b")


def test_rotate_refuses_an_unknown_name_or_a_bad_file_and_changes_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.toml"
    good = '[[keys]]\nname = "a"\nkey = "sk-1"\n'
    path.write_text(good)
    with pytest.raises(ValueError, match="no key named 'z'"):
        rotate(path, "z")
    path.write_text(good + "max_stream = 2\n")
    with pytest.raises(ValueError, match=r"keys\[0\]\.max_stream: unknown field"):
        rotate(path, "a")
    assert path.read_text() == good + "max_stream = 2\n"
    assert [p.name for p in tmp_path.iterdir()] == ["keys.toml"]
