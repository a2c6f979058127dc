"""What the admission tests share: admissions on a fake clock, keys, a priced route."""

from __future__ import annotations

from firsttoken.admission import Admission, ApiKey
from firsttoken.admission.limits import TokenBudgets
from firsttoken.admission.spend import LocalSpend, MemorySpend
from firsttoken.config import Settings
from firsttoken.routing.config import parse_routes
from firsttoken.telemetry.metrics import Metrics
from tests.unit.clock import FakeClock

ANYONE = ApiKey(name="")  # no keys file: everyone is one anonymous caller


def admission() -> Admission:
    settings = Settings(
        breaker_min_streams=2,
        breaker_error_rate=0.5,
        breaker_open_s=10.0,
        ttft_slo_ms=0,
        rate_limit_per_s=0,
    )
    return Admission(settings, Metrics())


def guarded() -> Admission:
    """A server with the breaker and the TTFT guard at their defaults' shape."""
    settings = Settings(
        breaker_min_streams=20,
        breaker_error_rate=0.5,
        breaker_window_s=30.0,
        ttft_slo_ms=500,
        rate_limit_per_s=0,
    )
    return Admission(settings, Metrics())


DAVE = ApiKey(name="dave", tokens_per_minute=100, max_streams=2)


def budgeted(clock: FakeClock) -> Admission:
    adm = admission()
    adm.limits.budgets = TokenBudgets(clock)
    return adm


ROUTES = {
    "targets": {
        "edge": {"kind": "synthetic", "price": {"prompt": 0.5, "completion": 50}},
        "center": {"kind": "synthetic", "price": {"prompt": 1, "completion": 100}},
    },
    "models": {"chat": {"targets": ["edge", "center"]}},
}


CENT = 10**10  # picos


def priced(clock: FakeClock) -> Admission:
    """An admission whose route `chat` costs 10 a million answer tokens (1,024 of them are
    just over a cent), on a spend clock of its own."""
    adm = admission()
    table = parse_routes(
        {
            "targets": {"gpu": {"kind": "synthetic", "price": {"prompt": 1, "completion": 10}}},
            "models": {"chat": {"targets": ["gpu"]}},
        }
    )
    adm.ledger.price(table)
    adm.spend = LocalSpend(MemorySpend(clock))
    return adm
