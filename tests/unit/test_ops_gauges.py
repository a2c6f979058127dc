"""Targets' in-flight counts and limits, keys' limits: read from what the router and the
keys file hold, at collect time."""

from __future__ import annotations

from types import SimpleNamespace

from firsttoken.admission.keys import ApiKey
from firsttoken.ops.gauges import LimitGauges


def test_targets_and_keys_as_gauges() -> None:
    targets = [
        SimpleNamespace(
            name="gpu-a",
            outstanding=3,
            first_token_s=0.12,
            config=SimpleNamespace(max_concurrency=4),
        ),
        SimpleNamespace(
            name="gpu-b",
            outstanding=0,
            first_token_s=None,
            config=SimpleNamespace(max_concurrency=None),
        ),
    ]
    keys = [ApiKey("alice", max_streams=8, tokens_per_minute=1000), ApiKey("bob")]
    gauges = LimitGauges(lambda: targets, lambda: keys, max_streams_per_key=5)
    samples = {
        (s.name, tuple(s.labels.values())): s.value
        for family in gauges.collect()
        for s in family.samples
    }
    assert samples["firsttoken_target_in_flight", ("gpu-a",)] == 3
    assert samples["firsttoken_target_in_flight", ("gpu-b",)] == 0
    assert samples["firsttoken_target_max_concurrency", ("gpu-a",)] == 4
    assert ("firsttoken_target_max_concurrency", ("gpu-b",)) not in samples
    assert samples["firsttoken_target_first_token_seconds", ("gpu-a",)] == 0.12
    assert samples["firsttoken_key_max_streams", ("alice",)] == 8
    assert samples["firsttoken_key_max_streams", ("bob",)] == 5  # the server's default
    assert samples["firsttoken_key_tokens_per_minute_limit", ("alice",)] == 1000
    assert ("firsttoken_key_tokens_per_minute_limit", ("bob",)) not in samples
    keys[:] = [ApiKey("carol", max_streams=2)]  # a reload: read again at the next collect
    names = {s.labels.get("key") for family in gauges.collect() for s in family.samples}
    assert names - {None} == {"carol"}
