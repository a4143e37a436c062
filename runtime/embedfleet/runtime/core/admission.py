"""Admission by expected wait, as one pure function.

Counting requests or queued tokens says nothing about how long a new request will wait: 2,000,000
tokens is seconds of work on a GPU and minutes on two CPU cores. So every request is judged by when
it is expected to finish: the tokens the engine must run before its last input leaves (the work
queued ahead of it, plus its own) divided by the engine's measured drain rate. Beyond the caller's
bound it is refused now, with a `Retry-After` taken from the same estimate, instead of being
accepted and answered after the client has given up.

Two exceptions keep the rule honest:
- an empty queue always admits (a request that alone is longer than the bound could otherwise never
  run; its own size is limited by --max-client-batch-size and --max-batch-tokens instead);
- an unmeasured rate (0) admits: nothing is known, and the hard caps still hold.
A deadline is stricter than the bound: work that cannot finish before it is refused at once, even
on an empty queue, because running it would only waste the engine on an answer nobody reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Reason = Literal["admitted", "expected_wait", "deadline"]


@dataclass(frozen=True, slots=True)
class Decision:
    admit: bool
    expected_s: float  # estimated seconds until the request's last input leaves the engine
    retry_after: int  # whole seconds to wait before trying again; 0 when admitted
    reason: Reason


def decide(ahead_tokens: int, own_tokens: int, tokens_per_s: float, max_wait_s: float | None,
           deadline_s: float | None = None) -> Decision:
    """Admit, or refuse with the reason and a retry time.

    `ahead_tokens`: tokens the engine runs before this request (queued ahead and in the engine now);
    `max_wait_s`: the bound for this kind of request (None: no bound); `deadline_s`: seconds the
    client still waits (None: no deadline).

    Properties (tested with hypothesis): monotone (more work ahead never turns a refusal into an
    admission); with a measured rate and work ahead, an admitted request's estimate is within both
    the bound and the deadline; a refusal's `retry_after` is at least 1 and is the least whole number
    of seconds after which, with the queue draining at the measured rate and nothing new arriving,
    the same request would be admitted by the bound.
    """
    if tokens_per_s <= 0:
        return Decision(True, 0.0, 0, "admitted")
    expected = (ahead_tokens + own_tokens) / tokens_per_s
    if deadline_s is not None and expected > deadline_s:
        return Decision(False, expected, max(1, math.ceil(expected - deadline_s)), "deadline")
    if max_wait_s is not None and ahead_tokens > 0 and expected > max_wait_s:
        # Time until enough of the queue has drained, or the whole of it (an empty queue admits).
        drain = min(expected - max_wait_s, ahead_tokens / tokens_per_s)
        return Decision(False, expected, max(1, math.ceil(drain)), "expected_wait")
    return Decision(True, expected, 0, "admitted")
