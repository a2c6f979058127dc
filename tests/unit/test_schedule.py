from __future__ import annotations

from firsttoken.core.schedule import Schedule
from tests.unit.clock import FakeClock


def make() -> tuple[Schedule, FakeClock]:
    clock = FakeClock()
    return Schedule(clock=clock, call_at=clock.call_at), clock


def test_callbacks_run_at_their_deadlines_in_order() -> None:
    schedule, clock = make()
    fired: list[str] = []
    schedule.call_later(2.0, lambda: fired.append("b"))
    schedule.call_later(1.0, lambda: fired.append("a"))
    clock.advance(0.5)
    assert fired == []
    clock.advance(0.6)
    assert fired == ["a"]
    clock.advance(1.0)
    assert fired == ["a", "b"]
    assert len(schedule) == 0


def test_cancelled_call_never_runs() -> None:
    schedule, clock = make()
    fired: list[int] = []
    call = schedule.call_later(1.0, lambda: fired.append(1))
    call.cancel()
    clock.advance(5)
    assert fired == []


def test_a_callback_that_reschedules_itself_runs_once_per_deadline() -> None:
    schedule, clock = make()
    times: list[float] = []

    def tick() -> None:
        times.append(clock.now)
        schedule.call_later(1.0, tick)

    schedule.call_later(1.0, tick)
    clock.advance(3.5)
    assert times == [1001.0, 1002.0, 1003.0]


def test_many_deadlines_share_one_armed_timer_at_a_time() -> None:
    schedule, clock = make()
    for i in range(100):
        schedule.call_later(10.0 + i, lambda: None)
    # Only the earliest deadline arms the loop timer (later ones don't re-arm it).
    assert len(clock.timers) == 1


def test_lag_samples_say_how_late_the_loop_ran_scheduled_work() -> None:
    schedule, clock = make()
    lags: list[float] = []
    schedule.sample_lag(0.05, lags.append)

    def busy() -> None:
        clock.now += 0.03  # 30 ms of other work on the loop, from 40 ms to 70 ms

    schedule.call_later(0.04, busy)
    clock.advance(0.2)
    # Due at 50 ms, run at 70: 20 ms late; then every 50 ms from when it ran, on time.
    assert [round(lag, 6) for lag in lags] == [0.02, 0.0, 0.0]
    assert len(schedule) == 1  # one entry: the next sample


def test_an_idle_loop_is_sampled_once_a_second_and_a_burst_wakes_the_sampler() -> None:
    schedule, clock = make()
    lags: list[float] = []
    busy = [False]
    start = clock.now
    wake = schedule.sample_lag(0.05, lags.append, busy=lambda: busy[0], idle_interval=1.0)
    clock.advance(2.06)
    # At 50 ms nothing was running: from then on, one sample a second.
    assert len(lags) == 3  # 0.05, 1.05, 2.05
    busy[0] = True
    wake()  # a stream began at 2.06: the next sample is 50 ms away, not at 3.05
    clock.advance(0.05)
    assert len(lags) == 4
    clock.advance(0.1)
    assert len(lags) == 6  # every 50 ms while busy
    busy[0] = False
    clock.advance(1.1)
    # The sample already due 50 ms on finds it idle; the one after comes a second later.
    assert len(lags) == 8
    assert len(schedule) == 1  # the cancelled idle sample was dropped, never run
    wake()
    wake()  # twice: still one pending sample (and one cancelled)
    assert len([e for e in schedule._heap if not e[2].cancelled]) == 1
    assert all(lag == 0.0 for lag in lags)
    assert clock.now - start > 3


def test_a_busy_sampler_is_not_moved_by_wake() -> None:
    schedule, clock = make()
    lags: list[float] = []
    wake = schedule.sample_lag(0.05, lags.append, busy=lambda: True)
    clock.advance(0.04)
    wake()  # not idle: the sample stays due at 50 ms
    clock.advance(0.01)
    assert len(lags) == 1
