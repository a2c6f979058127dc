"""An admitted stream's ticket: built from what admission granted (`Admitted`, fixed), it
gives all of that back when the stream ends, and bills the answer.

What the stream tells it as it runs (its first token, the targets that answered, an error of
the request's own doing) is the only state it keeps; everything admission decided is in
`Ticket.admitted`, which no one changes after.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from firsttoken.admission.gate import Admitted
from firsttoken.core.stream import Outcome, Usage
from firsttoken.pricing import LegStart
from firsttoken.telemetry.metrics import key_label

if TYPE_CHECKING:
    from firsttoken.admission.admission import Admission

__all__ = ["Ticket", "billed", "sets_own_latency"]


def billed(outcome: Outcome, usage: Usage | None) -> Usage:
    """What an ended answer's key pays for: its prompt and every token generated, also when
    cut short. One that generated nothing and did not complete pays its prompt when its
    client left (the engine had read it: an upstream bills it so), else nothing (refused,
    failed before a token). `usage` None: no engine had its prompt (it waited in a queue)."""
    if usage is None:
        return Usage()
    if outcome is not Outcome.COMPLETED and usage.completion == 0:
        if outcome is Outcome.DISCONNECTED or outcome is Outcome.CANCELLED:
            return Usage(usage.prompt, 0, 0, usage.cached, usage.cache_write)
        return Usage()
    return usage


def sets_own_latency(options: Mapping[str, Any]) -> bool:
    """Whether a request's engine options chose its own time to first token (the synthetic
    engine's `ttft_ms`): its TTFT measures the request, not the engine, so the guard skips it."""
    synthetic = options.get("synthetic")
    return isinstance(synthetic, Mapping) and synthetic.get("ttft_ms") is not None


class Ticket:
    """An admitted stream's hold on what admission granted; the stream reports back through
    it."""

    # One per waiting stream: slots keep it small.
    __slots__ = (
        "admission",
        "admitted",
        "client_fault",
        "key",
        "legs",
        "prefill",
        "released",
        "ttft_s",
    )

    def __init__(
        self, admission: Admission, admitted: Admitted, client_fault: bool = False
    ) -> None:
        self.admission = admission
        self.admitted = admitted
        self.key = admitted.key  # what the registry and a reload read (`AdmissionTicket`)
        self.released = False
        # What the request decided for itself says nothing about the engine, so the guards
        # ignore it: a latency it asked for (`Admitted.own_latency`) and an error it caused
        # (`client_fault`: the stream ended with EngineError.client_fault). Otherwise one key
        # could trip the breaker or the TTFT guard for everyone.
        self.client_fault = client_fault
        self.ttft_s: float | None = None
        # The targets that answered, from which token on (for the ledger).
        self.legs = admitted.legs
        self.prefill = ""  # the hand-off's prefill's target, when it is billed ("" none)

    def first_token(self, ttft_s: float) -> None:
        self.ttft_s = ttft_s
        admitted = self.admitted
        if not self.legs:
            target = self.admission.serving(admitted.request_id)
            if target is not None:
                self.legs = (LegStart(target),)
        if not admitted.own_latency:
            # The guard judges the engine: the time admission waited on Redis (up to its 1 s
            # timeout while Redis hangs) is the store's, not the engine's.
            self.admission.shedder.record_ttft(ttft_s - admitted.admitting_s)

    def prompt_read(self) -> None:
        if not self.legs:
            target = self.admission.serving(self.admitted.request_id)
            if target is not None:
                self.legs = (LegStart(target),)

    def seam(self, meta: Mapping[str, Any]) -> None:
        """A splice or a hand-off took: the next leg's target, from the token it began at.
        Or the hand-off's prefill answered: billed with the request (`Ledger.account`)."""
        prefill = meta.get("prefill")
        if isinstance(prefill, Mapping) and isinstance(prefill.get("target"), str):
            self.prefill = prefill["target"]
            return
        seam = meta.get("failover") or meta.get("handoff")
        if not isinstance(seam, Mapping) or not isinstance(seam.get("to"), str):
            return
        if not self.legs and isinstance(seam.get("from"), str):
            self.legs = (LegStart(seam["from"]),)
        at = seam.get("at_token")
        self.legs += (LegStart(seam["to"], at if isinstance(at, int) else 0),)

    async def release(self, outcome: Outcome, usage: Usage | None = None) -> None:
        if self.released:
            return
        self.released = True
        admission, admitted = self.admission, self.admitted
        used = billed(outcome, usage)
        admission.metrics.count_key_tokens(key_label(self.key.name), used)
        # Nobody could read a record with no ledger, and it costs nothing: none is made.
        cost = 0
        if admitted.request_id and admission.ledger.counting:
            cost = self._account(outcome, used)
        # A fenced stream (moved with no usage) leaves its money hold to the instance that
        # took it over, which settles it as it does a SIGKILLed owner's (`settle_taken`).
        fenced = outcome is Outcome.MOVED and usage is None
        if admitted.spend_hold is not None and not fenced:
            await admission.spend.settle(admitted.spend_hold, cost)
        # A moved stream's hold is settled by the instance that takes it over, which knows
        # what the whole answer used (`Admission.settle_taken`): once, whoever wins the claim.
        if admitted.reservation is not None and outcome is not Outcome.MOVED:
            await admission.limits.settle(admitted.reservation, used.prompt + used.completion)
        failed = outcome is Outcome.ERROR and not self.client_fault
        # A client-caused error counts as neither: the breaker learns nothing from it (and a
        # probe that ended so gives its turn back).
        ran = outcome is Outcome.COMPLETED or failed
        if admitted.probe:
            admission.shedder.probe_done(ran, failed)
        elif ran:
            admission.shedder.record_outcome(failed)
        if admitted.lease is not None:
            await admission.limits.release(admitted.lease)

    def _account(self, outcome: Outcome, used: Usage) -> int:
        """The ledger's record of this request, and its cost in picos."""
        admitted = self.admitted
        ttft = self.ttft_s
        return self.admission.ledger.account(
            request_id=admitted.request_id,
            at=admitted.arrived_at,
            key=key_label(self.key.name),  # `open` without a keys file, as in metrics
            model=admitted.model,
            legs=self.legs,
            usage=used,
            outcome=outcome.value,
            ttft_ms=None if ttft is None else round(ttft * 1000, 3),
            duration_ms=round((time.perf_counter() - admitted.started) * 1000, 3),
            trace_id=admitted.trace_id,
            prefill=self.prefill,
        )
