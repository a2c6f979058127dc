"""Admission: who may start a stream now — auth, limits, load shedding — decided up front.

`Admission` (admission.py) authenticates a request's key and passes it through the gate
(gate.py: one `Limit` after another, each refusing or holding; a refusal gives back what the
limits before it held). What passed is one frozen `Admitted`; its `Ticket` (ticket.py) is
built from it and gives it all back when the stream ends, billing the answer. Keys, limits,
money, shedding: keys.py, limits.py (redis_limits.py), spend.py (redis_spend.py),
shedding.py.
"""

from firsttoken.admission.admission import Admission, key_revoked
from firsttoken.admission.gate import Admitted
from firsttoken.admission.keys import ApiKey, KeyRing
from firsttoken.admission.shedding import LoadShedder
from firsttoken.admission.ticket import Ticket, billed, sets_own_latency

__all__ = [
    "Admission",
    "Admitted",
    "ApiKey",
    "KeyRing",
    "LoadShedder",
    "Ticket",
    "billed",
    "key_revoked",
    "sets_own_latency",
]
