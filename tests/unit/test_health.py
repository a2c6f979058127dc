"""A target's passive health on a fake clock: ejection after failures in a row, a cool-down
that grows with each ejection in a row (capped), one half-open probe, and Retry-After."""

from __future__ import annotations

from firsttoken.routing.health import MAX_EJECT_S, MAX_RETRY_AFTER_S, TargetHealth
from tests.unit.clock import FakeClock


def make(eject_after: int = 3, eject_s: float = 10.0) -> tuple[TargetHealth, FakeClock]:
    return TargetHealth(eject_after=eject_after, eject_s=eject_s), FakeClock()


def fail(health: TargetHealth, clock: FakeClock, times: int) -> None:
    for _ in range(times):
        health.failure(clock())


def test_ejected_after_eject_after_failures_in_a_row() -> None:
    health, clock = make(eject_after=3)
    fail(health, clock, 2)
    assert health.state == TargetHealth.UP and health.available(clock())
    fail(health, clock, 1)
    assert health.state == TargetHealth.EJECTED
    assert not health.up
    assert not health.available(clock())
    assert not health.acquire(clock())


def test_a_success_resets_the_count() -> None:
    health, clock = make(eject_after=3)
    fail(health, clock, 2)
    health.success()
    fail(health, clock, 2)
    assert health.state == TargetHealth.UP
    fail(health, clock, 1)
    assert health.state == TargetHealth.EJECTED


def test_the_cool_down_ends_in_one_half_open_probe() -> None:
    health, clock = make(eject_after=1, eject_s=10.0)
    fail(health, clock, 1)
    clock.advance(9.9)
    assert not health.available(clock())
    clock.advance(0.1)
    assert health.available(clock())
    assert health.acquire(clock())  # the probe
    assert health.state == TargetHealth.HALF_OPEN
    assert not health.up
    # Exactly one: every other request is kept away while the probe is out.
    assert not health.available(clock())
    assert not health.acquire(clock())
    clock.advance(1000)
    assert not health.acquire(clock())


def test_a_probe_that_succeeds_brings_the_target_up() -> None:
    health, clock = make(eject_after=1)
    fail(health, clock, 1)
    clock.advance(10)
    assert health.acquire(clock())
    health.success()
    assert health.state == TargetHealth.UP and health.up
    assert health.acquire(clock()) and health.acquire(clock())  # no longer one at a time
    assert health.ejections == 0


def test_a_probe_that_fails_ejects_again_for_longer() -> None:
    health, clock = make(eject_after=3, eject_s=10.0)
    fail(health, clock, 3)
    clock.advance(10)
    assert health.acquire(clock())
    fail(health, clock, 1)  # one failure is enough in half-open
    assert health.state == TargetHealth.EJECTED
    assert health.ejections == 2
    clock.advance(19.9)
    assert not health.available(clock())
    clock.advance(0.1)
    assert health.acquire(clock())
    fail(health, clock, 1)
    clock.advance(29.9)
    assert not health.available(clock())
    clock.advance(0.1)
    assert health.available(clock())


def test_after_a_recovery_the_cool_down_starts_short_again() -> None:
    health, clock = make(eject_after=1, eject_s=10.0)
    fail(health, clock, 1)
    clock.advance(10)
    health.acquire(clock())
    fail(health, clock, 1)  # 20 s
    clock.advance(20)
    health.acquire(clock())
    health.success()
    fail(health, clock, 1)
    clock.advance(10)
    assert health.available(clock())


def test_the_cool_down_is_capped() -> None:
    health, clock = make(eject_after=1, eject_s=100.0)
    for cool_down in (100.0, 200.0, MAX_EJECT_S, MAX_EJECT_S, MAX_EJECT_S):
        fail(health, clock, 1)
        clock.advance(cool_down - 0.1)
        assert not health.available(clock())
        clock.advance(0.1)
        assert health.acquire(clock())
    assert health.ejections == 5


def test_release_gives_the_probe_back() -> None:
    health, clock = make(eject_after=1)
    fail(health, clock, 1)
    clock.advance(10)
    assert health.acquire(clock())
    health.release()  # the probe's client left: nothing learnt
    assert health.state == TargetHealth.HALF_OPEN
    assert health.acquire(clock())
    assert not health.acquire(clock())


def test_release_when_up_changes_nothing() -> None:
    health, clock = make(eject_after=2)
    fail(health, clock, 1)
    health.release()
    fail(health, clock, 1)
    assert health.state == TargetHealth.EJECTED  # the count survived the release


def test_retry_after_holds_requests_back_without_counting_a_failure() -> None:
    health, clock = make(eject_after=1)
    health.hold(clock(), 5.0)
    assert health.state == TargetHealth.UP and health.up  # held is not down
    assert not health.available(clock())
    assert not health.acquire(clock())
    clock.advance(4.9)
    assert not health.available(clock())
    clock.advance(0.1)
    assert health.acquire(clock())
    # A second, shorter hold does not shorten a longer one.
    health.hold(clock(), 10.0)
    health.hold(clock(), 1.0)
    clock.advance(5)
    assert not health.available(clock())
    clock.advance(5)
    assert health.available(clock())


def test_retry_after_is_capped_and_never_negative() -> None:
    health, clock = make()
    health.hold(clock(), 1e9)
    assert health.held_until == clock() + MAX_RETRY_AFTER_S
    other, clock = make()
    other.hold(clock(), -5)
    assert other.available(clock())


def test_retry_after_holds_back_a_half_open_target_too() -> None:
    health, clock = make(eject_after=1)
    fail(health, clock, 1)
    clock.advance(10)
    assert health.acquire(clock())
    health.hold(clock(), 3.0)  # the probe answered 429 Retry-After: 3
    assert not health.available(clock())
    clock.advance(3)
    assert health.acquire(clock())  # the probe is free again once the hold is over


# -- failures tied to one key's requests (issue 37.8) ------------------------------------------


def test_one_keys_tied_failures_eject_the_target_for_that_key_only() -> None:
    # Three requests of one key with a passthrough field the upstream answers 500 to set
    # target_up to 0, and every other key went to the fallback for up to 300 s.
    health, clock = make(eject_after=3, eject_s=10.0)
    for _ in range(3):
        health.failure(clock(), "mallory")
    assert health.state == TargetHealth.UP and health.up
    assert health.available(clock(), "alice") and health.available(clock())
    assert not health.available(clock(), "mallory")
    clock.advance(10.0)
    assert health.available(clock(), "mallory")  # its own cool-down ends too


def test_tied_failures_of_two_keys_count_against_the_target() -> None:
    health, clock = make(eject_after=3)
    health.failure(clock(), "mallory")
    health.failure(clock(), "mallory")
    assert health.state == TargetHealth.UP
    health.failure(clock(), "alice")  # the same run, seen from another key: the target's
    assert health.state == TargetHealth.EJECTED
    assert not health.available(clock(), "alice") and not health.available(clock())


def test_an_untied_failure_still_counts_and_a_success_clears_the_run() -> None:
    health, clock = make(eject_after=3)
    health.failure(clock(), "mallory")
    health.success()
    health.failure(clock(), "alice")  # a new run: one key's, alone
    assert health.state == TargetHealth.UP
    fail(health, clock, 3)  # refused connects: the target's own
    assert health.state == TargetHealth.EJECTED


def test_a_half_open_probe_that_fails_for_one_key_is_given_back() -> None:
    health, clock = make(eject_after=1, eject_s=10.0)
    fail(health, clock, 1)
    clock.advance(10.0)
    assert health.acquire(clock(), "mallory")  # the probe
    health.failure(clock(), "mallory")  # tied: says nothing about the target
    assert health.state == TargetHealth.HALF_OPEN
    assert health.acquire(clock(), "alice")  # the next request probes
    health.success()
    assert health.state == TargetHealth.UP


def test_probe_at_says_when_an_ejected_target_is_probed() -> None:
    health, clock = make(eject_after=1, eject_s=10.0)
    assert health.probe_at is None  # up
    start = clock()
    fail(health, clock, 1)
    assert health.probe_at == start + 10.0
    clock.advance(12.0)
    assert health.probe_at == start + 10.0 and not health.up  # due, but nobody came yet
    assert health.acquire(clock())
    assert health.probe_at is None  # half-open: the probe is out
    health.failure(clock())
    assert health.probe_at == clock() + 20.0  # ejected again, for longer
