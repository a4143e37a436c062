"""Which engine process a front sends a request to, when a split server runs several (`--engines N`).

A pure decision, so that it can be tested on its own (tests/runtime/test_split_spread.py). Each engine keeps
its own queue, batches and admission; the front sees each one's load as of its last STATE frame (at most
`engine_side.STATE_S` old) plus what it has itself sent there since and not had answered. It picks the engine
whose work would start soonest: the expected wait the engine reported, plus the front's own unanswered tokens
and this request's at the engine's drain rate. Counting its own unanswered work is what keeps a front from
sending every request of a burst to the engine that looked idle in the last snapshot.

A tenant with a quota goes to the first engine that is up (engine 0, unless it is restarting): its quota is
kept by that engine alone, so it stays one quota per pod, and engine 0 is also where the pod's async job
workers run and charge the same tenant's bucket. Were its requests spread, each engine would keep a bucket of
its own and the tenant would get N quotas; while engine 0 restarts they all go to the next one, so for those
seconds the tenant has at most two buckets. Such a tenant is served by one engine's capacity at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One engine as a front sees it: `index` among the pod's engines; `wait` the expected wait it
    reported for this class of work (s); `tokens_per_s` its drain rate; `unanswered` this front's tokens
    sent to it and not yet answered; `saturated` its queue is at its bound."""
    index: int
    wait: float
    tokens_per_s: float
    unanswered: int
    saturated: bool = False


def pick_engine(candidates: Sequence[Candidate], tokens: int, quota: bool = False) -> int | None:
    """The index of the engine to send `tokens` to, among `candidates` (the engines whose link is up and
    whose model is loaded), or None when there are none. `quota`: the request's tenant has a quota the
    engines keep: it goes to the lowest-numbered candidate, whatever the loads."""
    if not candidates:
        return None
    if quota:
        return min(c.index for c in candidates)
    open_ = [c for c in candidates if not c.saturated] or list(candidates)

    def start(c: Candidate) -> tuple[float, int, int]:
        return (c.wait + (c.unanswered + tokens) / max(c.tokens_per_s, 1.0), c.unanswered, c.index)

    return min(open_, key=start).index
