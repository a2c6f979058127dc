"""The routes file: every mistake is one line naming the file, the table and the field; the
defaults are INTERFACE.md's example values; each kind gets its own continuation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from firsttoken.routing.config import (
    ModelRoute,
    RoutesError,
    TargetConfig,
    load_routes,
    parse_routes,
)

GOOD_TARGET: dict[str, Any] = {"kind": "openai", "url": "http://127.0.0.1:8000/v1"}


def table(target: dict[str, Any] | None = None, **route: Any) -> dict[str, Any]:
    return {
        "targets": {"a": dict(GOOD_TARGET if target is None else target)},
        "models": {"chat": {"targets": ["a"], **route}},
    }


def refused(data: dict[str, Any]) -> str:
    with pytest.raises(RoutesError) as caught:
        parse_routes(data, "routes.toml")
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("routes.toml: ")
    return line


def test_defaults_are_the_interface_example_values() -> None:
    routes = parse_routes(table())
    target = routes.targets["a"]
    assert (target.connect_timeout_s, target.first_token_timeout_s) == (5.0, 30.0)
    assert (target.idle_timeout_s, target.total_timeout_s) == (30.0, 600.0)
    assert target.queue_timeout_s == 30.0
    assert target.max_concurrency is None
    assert routes.routes["chat"].max_splices == 1
    assert routes.routes["chat"].balance == "order"
    # The dataclasses' own defaults are the same (the shorthand builds them in code).
    assert TargetConfig(name="x", kind="openai").first_token_timeout_s == 30.0
    assert ModelRoute(name="x", targets=("a",)).max_splices == 1


def test_a_whole_file_is_read_in_order_with_every_field() -> None:
    data = {
        "targets": {
            "gpu-a": {
                "kind": "openai",
                "url": "http://10.0.0.5:8000/v1",
                "model": "Qwen/Qwen3-8B",
                "api_key_env": "GPU_A_KEY",
                "continuation": "vllm",
                "connect_timeout_s": 1,
                "first_token_timeout_s": 2.5,
                "idle_timeout_s": 3,
                "total_timeout_s": 40,
                "max_concurrency": 16,
                "queue_timeout_s": 0,
                "eject_after": 2,
                "eject_s": 7,
                "health_check_interval_s": 15,
            },
            "claude": {"kind": "anthropic", "url": "https://api.anthropic.com/v1"},
            "fake": {"kind": "synthetic", "ttft_ms": 5, "itl_ms": 1},
        },
        "models": {
            "chat": {"targets": ["gpu-a", "claude"], "max_splices": 0},
            "fast": {"targets": ["fake"], "balance": "least_busy"},
        },
    }
    routes = parse_routes(data)
    gpu = routes.targets["gpu-a"]
    assert gpu.first_token_timeout_s == 2.5
    assert isinstance(gpu.connect_timeout_s, float)  # integers in the file become seconds
    assert (gpu.max_concurrency, gpu.queue_timeout_s, gpu.eject_after) == (16, 0.0, 2)
    assert gpu.api_key({"GPU_A_KEY": "sk-1"}) == "sk-1"
    assert routes.targets["claude"].api_key({"GPU_A_KEY": "sk-1"}) is None
    assert routes.targets["fake"].ttft_ms == 5.0
    assert list(routes.routes) == ["chat", "fast"]
    assert routes.default.name == "chat"
    assert routes.routes["chat"].targets == ("gpu-a", "claude")
    assert routes.routes["fast"].balance == "least_busy"


@pytest.mark.parametrize(
    ("kind", "extra", "continuation"),
    [
        ("openai", GOOD_TARGET, "none"),
        ("anthropic", GOOD_TARGET, "anthropic"),
        ("synthetic", {}, "native"),
        ("llamacpp", {}, "native"),
    ],
)
def test_each_kind_has_its_continuation_by_default(
    kind: str, extra: dict[str, Any], continuation: str
) -> None:
    routes = parse_routes(table({**extra, "kind": kind}))
    assert routes.targets["a"].continuation == continuation


@pytest.mark.parametrize(
    ("target", "continuation"),
    [
        ({**GOOD_TARGET, "continuation": "vllm"}, "vllm"),
        ({**GOOD_TARGET, "continuation": "completions"}, "completions"),
        ({**GOOD_TARGET, "kind": "anthropic", "continuation": "none"}, "none"),
        ({"kind": "synthetic", "continuation": "none"}, "none"),
    ],
)
def test_a_continuation_can_be_chosen_or_turned_off(
    target: dict[str, Any], continuation: str
) -> None:
    assert parse_routes(table(target)).targets["a"].continuation == continuation


@pytest.mark.parametrize(
    ("target", "where", "says"),
    [
        ({**GOOD_TARGET, "continuation": "maybe"}, "continuation", "must be one of"),
        ({**GOOD_TARGET, "kind": "anthropic", "continuation": "vllm"}, "continuation", "prefill"),
        ({**GOOD_TARGET, "continuation": "anthropic"}, "continuation", "kind 'openai'"),
        ({"kind": "synthetic", "continuation": "vllm"}, "continuation", "natively"),
        ({"kind": "llamacpp", "continuation": "native"}, "continuation", "must be one of"),
    ],
)
def test_a_continuation_the_kind_cannot_do_is_refused(
    target: dict[str, Any], where: str, says: str
) -> None:
    line = refused(table(target))
    assert f"[targets.a] {where}: " in line
    assert says in line


def test_url_is_required_for_remote_kinds_and_refused_for_ours() -> None:
    for kind in ("openai", "anthropic"):
        line = refused(table({"kind": kind}))
        assert f"[targets.a] url: is required for kind '{kind}'" in line
    for kind in ("synthetic", "llamacpp"):
        line = refused(table({"kind": kind, "url": "http://127.0.0.1:1/v1"}))
        assert "[targets.a] url: " in line and "no url" in line


def test_kind_is_required_and_must_be_known() -> None:
    assert "[targets.a] kind: is required" in refused(table({"url": "http://h/v1"}))
    line = refused(table({"kind": "vllm", "url": "http://h/v1"}))
    assert "[targets.a] kind: must be one of openai, anthropic, llamacpp, synthetic" in line


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("url", "ftp://h/v1", "must be an http(s)://"),
        ("url", "http:///v1", "must be an http(s)://"),
        ("url", "http://h:99999/v1", "bad port"),
        ("url", 8000, "must be a string, not 8000"),
        ("model", 3, "must be a string"),
        ("api_key_env", ["K"], "must be a string"),
        ("connect_timeout_s", 0, "must be > 0, not 0"),
        ("connect_timeout_s", "5", "must be a number, not '5'"),
        ("first_token_timeout_s", -1, "must be > 0"),
        ("first_token_timeout_s", float("nan"), "must be a finite number"),
        ("idle_timeout_s", float("inf"), "must be a finite number"),
        ("idle_timeout_s", True, "must be a number, not True"),
        ("total_timeout_s", 0.0, "must be > 0"),
        ("max_concurrency", 0, "must be >= 1, not 0"),
        ("max_concurrency", 2.5, "must be an integer, not 2.5"),
        ("max_concurrency", False, "must be an integer"),
        ("queue_timeout_s", -0.5, "must be >= 0"),
        ("eject_after", 0, "must be >= 1"),
        ("eject_after", 1.0, "must be an integer"),
        ("eject_s", 0, "must be > 0"),
        ("health_check_interval_s", -1, "must be >= 0"),
        ("continuation", 1, "must be a string"),
        ("retries", 3, "unknown field (known: kind, url, model"),
    ],
)
def test_each_target_field_is_checked(field: str, value: Any, says: str) -> None:
    line = refused(table({**GOOD_TARGET, field: value}))
    assert f"[targets.a] {field}: " in line
    assert says in line


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("targets", "a", "must be a list"),
        ("targets", [], "must list at least one target"),
        ("targets", [1], "must be a list of target names"),
        ("targets", ["a", "b"], "no target named 'b' (targets: a)"),
        ("targets", ["a", "a"], "lists a target twice"),
        ("max_splices", -1, "must be >= 0"),
        ("max_splices", 1.0, "must be an integer"),
        ("balance", "random", "must be one of order, least_busy"),
        (
            "fallbacks",
            ["a"],
            "unknown field (known: targets, max_splices, balance, handoff, short_prompts, hedge)",
        ),
    ],
)
def test_each_route_field_is_checked(field: str, value: Any, says: str) -> None:
    data = table()
    data["models"]["chat"][field] = value
    line = refused(data)
    assert f"[models.chat] {field}: " in line
    assert says in line


def test_a_route_without_targets_is_refused() -> None:
    data = table()
    data["models"]["chat"] = {}
    assert "[models.chat] targets: must list at least one target" in refused(data)


@pytest.mark.parametrize(
    ("field", "value"), [("ttft_ms", 5), ("itl_ms", 1), ("health_check_interval_s", 5)]
)
def test_fields_of_other_kinds_are_refused(field: str, value: Any) -> None:
    if field == "health_check_interval_s":
        line = refused(table({"kind": "synthetic", field: value}))
        assert "no URL to check" in line
    else:
        line = refused(table({**GOOD_TARGET, field: value}))
        assert "applies to kind 'synthetic' only" in line
    assert f"[targets.a] {field}: " in line


def test_a_llamacpp_model_must_be_a_file(tmp_path: Path) -> None:
    line = refused(table({"kind": "llamacpp", "model": str(tmp_path / "none.gguf")}))
    assert "[targets.a] model: no such GGUF file" in line
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert parse_routes(table({"kind": "llamacpp", "model": str(gguf)})).targets["a"].model


def test_unknown_tables_and_missing_ones_are_refused() -> None:
    data = table()
    data["upstreams"] = {}
    assert "[upstreams]: unknown table" in refused(data)
    assert "[targets]: at least one target" in refused({"models": table()["models"]})
    assert "[models]: at least one model route" in refused({"targets": table()["targets"]})
    assert "[targets]: must be a table" in refused({"targets": 1, "models": {}})
    data = table()
    data["targets"]["a"] = "openai"
    assert "[targets.a]: must be a table" in refused(data)
    data = table()
    data["models"]["chat"] = ["a"]
    assert "[models.chat]: must be a table" in refused(data)


@pytest.mark.parametrize("name", ["", "a b", "é", "x" * 129, "a]b"])
def test_names_are_refused_outside_their_alphabet(name: str) -> None:
    data = {"targets": {name: dict(GOOD_TARGET)}, "models": {"chat": {"targets": [name]}}}
    assert "a name is 1-128 of" in refused(data)
    data = {"targets": {"a": dict(GOOD_TARGET)}, "models": {name: {"targets": ["a"]}}}
    assert f"[models.{name}]: a name is" in refused(data)


def test_a_file_is_named_in_every_refusal(tmp_path: Path) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(
        '[targets.a]\nkind = "openai"\nurl = "http://127.0.0.1:8000/v1"\n'
        'first_token_timeout_s = 0\n\n[models.chat]\ntargets = ["a"]\n'
    )
    with pytest.raises(RoutesError) as caught:
        load_routes(path)
    assert str(caught.value) == f"{path}: [targets.a] first_token_timeout_s: must be > 0, not 0"


def test_a_duplicate_table_is_refused_as_not_toml(tmp_path: Path) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(
        '[targets.a]\nkind = "synthetic"\n[targets.a]\nkind = "synthetic"\n'
        '[models.chat]\ntargets = ["a"]\n'
    )
    with pytest.raises(RoutesError) as caught:
        load_routes(path)
    line = str(caught.value)
    assert line.startswith(f"{path}: not TOML: ") and "line 3" in line
    assert "\n" not in line


def test_a_missing_or_binary_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(RoutesError, match=r"none\.toml: cannot read: "):
        load_routes(tmp_path / "none.toml")
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RoutesError, match=r"bin\.toml: cannot read: "):
        load_routes(binary)


def test_a_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(
        '[targets.fake]\nkind = "synthetic"\n\n[models.chat]\ntargets = ["fake"]\nmax_splices = 2\n'
    )
    routes = load_routes(path)
    assert routes.targets["fake"].continuation == "native"
    assert routes.default.max_splices == 2


def test_a_mistake_after_a_hand_off_still_names_the_file() -> None:
    data = {
        "targets": {"a": dict(GOOD_TARGET), "edge": dict(GOOD_TARGET)},
        "models": {
            "chat": {"targets": ["a"], "handoff": {"from": "edge", "after_tokens": 8}},
            "other": {"targets": ["nowhere"]},
        },
    }
    assert refused(data).startswith("routes.toml: [models.other] targets: no target named")


def test_a_price_is_read_exactly_with_its_defaults_and_one_currency() -> None:
    from firsttoken.pricing import Price

    price = {"prompt": 0.50, "completion": "1.50", "cache_write": 0.625}
    data = {**table({**GOOD_TARGET, "price": price}), "currency": "EUR"}
    read = parse_routes(data)
    assert read.currency == "EUR"
    assert read.targets["a"].price == Price(
        prompt=500_000,
        completion=1_500_000,
        cached_prompt=500_000,
        cache_write=625_000,
        reasoning=1_500_000,
    )
    assert parse_routes(table()).currency == "USD"
    assert parse_routes(table()).targets["a"].price is None


@pytest.mark.parametrize(
    ("price", "says"),
    [
        ({"prompt": -1}, "[targets.a] price.prompt: a price must be a number >= 0"),
        ({"input": 1}, "[targets.a] price.input: unknown price"),
        ({"prompt": 0.0000001}, "more than 6 decimal places"),
        ({"prompt": True}, "a price must be a number"),
        # Past BIGINT picos within a request: a ledger batch that could never be written.
        ({"prompt": 2e13}, "price.prompt: a price per million tokens of at most 10,000"),
        ({"completion": 10_000.000001}, "price.completion: a price per million tokens of at"),
    ],
)
def test_a_bad_price_is_refused_naming_it(price: dict[str, Any], says: str) -> None:
    assert says in refused(table({**GOOD_TARGET, "price": price}))


def test_a_bad_currency_is_refused() -> None:
    assert "currency: must be a currency code" in refused({**table(), "currency": ""})


def two_tiers(**handoff: Any) -> dict[str, Any]:
    data = table()
    data["targets"]["small"] = {"kind": "synthetic"}
    data["models"]["chat"]["handoff"] = {"from": "small", "after_tokens": 24, **handoff}
    return data


def test_a_handoff_is_timed_by_default_and_by_count_when_asked() -> None:
    handoff = parse_routes(two_tiers()).routes["chat"].handoff
    assert handoff is not None
    assert (handoff.source, handoff.after_tokens, handoff.at, handoff.fallback) == (
        "small",
        24,
        "tokens",
        True,
    )
    assert handoff.prefill is True and handoff.pace_ms == 50.0
    counted = parse_routes(two_tiers(prefill=False, pace_ms=0)).routes["chat"].handoff
    assert counted is not None and counted.prefill is False and counted.pace_ms == 0.0


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("prefill", "yes", "must be true or false"),
        ("pace_ms", -1, "must be >= 0"),
        ("pace_ms", "fast", "must be a number"),
        ("pace", 50, "unknown field"),
    ],
)
def test_the_handoffs_timing_fields_are_checked(field: str, value: Any, says: str) -> None:
    line = refused(two_tiers(**{field: value}))
    assert f"[models.chat] handoff {field}" in line and says in line


def test_a_misspelt_currency_is_named() -> None:
    line = refused({**table(), "curency": "EUR"})
    assert line == (
        "routes.toml: curency: unknown field (known: currency, [targets.*], [models.*]); "
        "did you mean currency?"
    )


def test_an_openai_target_serves_embeddings_unless_it_names_more() -> None:
    assert parse_routes(table()).targets["a"].serves == ("embeddings",)
    named = parse_routes(table({**GOOD_TARGET, "serves": ["moderations", "embeddings"]}))
    assert named.targets["a"].serves == ("moderations", "embeddings")
    assert parse_routes(table({**GOOD_TARGET, "serves": []})).targets["a"].serves == ()


@pytest.mark.parametrize(
    ("target", "says"),
    [
        (
            {**GOOD_TARGET, "serves": ["audio"]},
            "'audio' is not one of embeddings, moderations, images",
        ),
        ({**GOOD_TARGET, "serves": "moderations"}, "must be a list"),
        ({**GOOD_TARGET, "serves": ["moderations"] * 2}, "names an endpoint twice"),
        ({"kind": "synthetic", "serves": ["moderations"]}, "applies to kind 'openai' only"),
    ],
)
def test_a_bad_serves_is_refused_naming_it(target: dict[str, Any], says: str) -> None:
    line = refused(table(target))
    assert "[targets.a] serves: " in line and says in line
