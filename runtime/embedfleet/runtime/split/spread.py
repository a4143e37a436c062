"""Which engine process a front sends a request to, when a split server runs several (`--engines N`).

A pure decision, so that it can be tested on its own (tests/runtime/test_split_spread.py). Each engine keeps
its own queue, batches and admission; the front sees each one's load as of its last STATE frame (at most
`engine_side.STATE_S` old) plus what it has itself sent there since and not had answered. It picks the engine
whose work would start soonest: the expected wait the engine reported, plus the front's own unanswered tokens
and this request's at the engine's drain rate. Counting its own unanswered work is what keeps a front from
sending every request of a burst to the engine that looked idle in the last snapshot.

A tenant with a quota goes to one engine, the same for every front (a hash of its name), while that engine
can take work: its quota is kept by that engine alone, so it stays one quota per pod. Were its requests
spread, each engine would keep a bucket of its own and the tenant would get N quotas.
"""

from __future__ import annotations

import zlib
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


def home_engine(tenant: str, engines: int) -> int:
    """The engine a tenant with a quota is kept on: the same in every front and every restart."""
    return zlib.crc32(tenant.encode("utf-8")) % max(1, engines)


def pick_engine(candidates: Sequence[Candidate], tokens: int, engines: int,
                quota_tenant: str | None = None) -> int | None:
    """The index of the engine to send `tokens` to, among `candidates` (the engines whose link is up and
    whose model is loaded), or None when there are none. `quota_tenant`: a tenant whose quota the engines
    keep; it goes to its home engine when that is a candidate (else, while it restarts, to the best other)."""
    if not candidates:
        return None
    if quota_tenant is not None:
        home = home_engine(quota_tenant, engines)
        for c in candidates:
            if c.index == home:
                return home
    open_ = [c for c in candidates if not c.saturated] or list(candidates)

    def start(c: Candidate) -> tuple[float, int, int]:
        return (c.wait + (c.unanswered + tokens) / max(c.tokens_per_s, 1.0), c.unanswered, c.index)

    return min(open_, key=start).index
