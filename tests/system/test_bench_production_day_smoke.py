"""A bad production day at a small size (bench/production_day.py), every fault kind once: three
instances with --redis --durable behind nginx, two upstreams on one route, two normal keys and
an abusive one, a SQLite ledger each, and the four formats' clients (the official openai SDK
for chat and Responses, the anthropic SDK, the native client with resume). Whatever a fault
did to a stream, its client was told: none ended short without an error, none completed with
a wrong text, none hung; and no process logged a traceback."""

from __future__ import annotations

import asyncio

import pytest

from bench.production_day import FAULT_KINDS, Options, report, run_day


# 30 s of load and ~15 s to start and stop seven processes; a machine shared with other work
# can take three times as long to start them.
@pytest.mark.timeout(240)
def test_on_a_bad_day_every_client_gets_its_answer_or_is_told() -> None:
    opts = Options(
        minutes=0.5,
        streams=16,
        fault_every_s=5,
        first_fault_s=2,  # the five kinds at 2, 7, 12, 17, 22 s; one more at 27 s
        tokens_min=30,
        tokens_max=80,
        variants=6,
        abusers=2,
        hang_s=20,
        client_procs=0,  # in this process: no other to start on a busy machine
    )
    summary = asyncio.run(run_day(opts, log=print))
    print(report(summary))
    assert [f["kind"] for f in summary["faults"]][: len(FAULT_KINDS)] == list(FAULT_KINDS)
    for fmt, k in summary["formats"].items():
        assert k["started"] >= 10, (fmt, k)
        bad = {"short": k["short"], "wrong": k["wrong"], "hung": k["hung"]}
        assert bad == {"short": 0, "wrong": 0, "hung": 0}, (fmt, k, summary["examples"])
    tracebacks = {name: k["tracebacks"] for name, k in summary["logs"].items()}
    assert not any(tracebacks.values()), summary["logs"]
