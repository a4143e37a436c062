"""The engine's drain rate (tokens per second) that admission divides the work ahead by.

A rate averaged over a long time is right on a machine whose speed does not change, and wrong by
as much as the machine has changed since: when a neighbour process takes a core, the engine's
threads run at the pace of the one that shares it, batches take several times as long, and work
admitted on the old rate is answered long past its bound. So three figures are kept, and the most
pessimistic one is believed:

- long run: time-decayed sums of tokens drained and seconds taken (about `smooth_s` seconds of
  draining), their ratio; a lone tiny batch weighs as little as it takes;
- recent: the tokens that left the engine in the last `window_s` seconds of wall clock, over the
  seconds spent draining them, and the same over the last `batches` batches alone, so that a slowed
  engine is seen within a batch or two;
- running: a batch still in the engine that has taken longer than the rate predicts lowers the rate
  to what it has done so far (its tokens over its elapsed time, less any pauses in which queries'
  batches ran: preemption), before it ends.

A batch's seconds are wall clock: its engine time, plus the gap before it while work was already
waiting (time the event loop spent before it could plan the batch drains nothing either). A batch of
fewer tokens than one engine call's fixed cost (--batch-overhead-tokens) is left out by the bookkeeping:
a lone query is a dozen tokens and mostly fixed cost, a run of them read as a rate several times below
what the bulk batches that follow drain at, and a backfill was refused for waits ten times its real
one. Such batches run when little of their class is queued (a query alone, or beside a backfill):
their time says little of what a queue drains at.

`estimate` is the decision, a pure function of the figures; `DrainRate` keeps the figures.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

SMOOTH_S = 2.0  # the long-run rate decays over about this much draining
WINDOW_S = 3.0  # the recent rate: batches that ended in about this much wall clock
BATCHES = 2  # ... and the last this many batches in that window alone
SEED_RUNS = 2  # timed runs of the start-up seed batch, the faster believed (`timed_seed`); each adds to a start


@dataclass(frozen=True, slots=True)
class Drained:
    """One batch that left the engine: when, how many tokens, and the wall seconds they took."""

    ended: float
    tokens: int
    seconds: float


def estimate(long_run: float, window: tuple[float, float] = (0.0, 0.0), last: tuple[float, float] = (0.0, 0.0),
             running_tokens: int = 0, running_s: float = 0.0) -> float:
    """The rate to judge work by: the least of the long-run rate, the recent figures (`window`: the
    tokens and seconds of the batches that ended in the last seconds; `last`: the same of the last few
    batches alone; (0, 0) where there are none) and what the batch in the engine (`running_tokens`,
    running for `running_s` seconds of its own) has done so far. 0 while nothing is measured.

    Properties (tested with hypothesis): never above the long-run rate, nor above any recent figure;
    slower recent batches never raise it; a running batch that has taken longer than the rate allows
    brings the rate down to its tokens over its elapsed time, and one within it changes nothing.
    """
    rate = long_run
    for tokens, seconds in (window, last):
        if tokens > 0 and seconds > 0:
            figure = tokens / seconds
            rate = figure if rate <= 0 else min(rate, figure)
    if rate > 0 and running_tokens > 0 and running_s * rate > running_tokens:
        rate = running_tokens / running_s
    return rate


class DrainRate:
    """The figures `estimate` reads, kept as batches leave the engine: O(1) per batch and per read
    (running sums over the window; old batches leave it as time passes, each once). The estimate without
    the running batch changes only when a batch arrives or leaves the window, so it is kept between the
    two; a read then only checks the window's oldest batch and the running batch (admission, the gate and
    the planner read the rate several times per request)."""

    def __init__(self, smooth_s: float = SMOOTH_S, window_s: float = WINDOW_S, batches: int = BATCHES) -> None:
        self.smooth_s = smooth_s
        self.window_s = window_s
        self.batches = batches
        self.long_run = 0.0
        self._sum_tokens = 0.0  # time-decayed sums of tokens drained and seconds taken; their ratio is long_run
        self._sum_seconds = 0.0
        self._window: deque[Drained] = deque()
        self._window_tokens = 0
        self._window_seconds = 0.0
        self._base: float | None = None  # estimate() with no running batch; None: to be worked out again

    def seed(self, tokens: int, seconds: float) -> None:
        """A timed batch before any traffic (start-up): the long-run rate only, forgotten after a few seconds of
        real draining; the recent figures are measured, never seeded."""
        self._decay_in(tokens, seconds)

    def observe(self, ended: float, tokens: int, seconds: float) -> None:
        """A batch left the engine at `ended` with `tokens`, after `seconds` of draining."""
        if seconds <= 0 or tokens <= 0:
            return
        self._decay_in(tokens, seconds)
        self._window.append(Drained(ended, tokens, seconds))
        self._window_tokens += tokens
        self._window_seconds += seconds
        self._forget(ended)

    def rate(self, now: float, running_tokens: int = 0, running_s: float = 0.0) -> float:
        """The rate at `now` (the clock of `observe`'s `ended`): `estimate` of the figures, the same value."""
        self._forget(now)
        rate = self._base
        if rate is None:
            last = list(islice(reversed(self._window), self.batches))
            rate = self._base = estimate(self.long_run, (self._window_tokens, self._window_seconds),
                                         (sum(b.tokens for b in last), sum(b.seconds for b in last)))
        if rate > 0 and running_tokens > 0 and running_s * rate > running_tokens:
            return running_tokens / running_s  # as estimate() treats a running batch
        return rate

    def _forget(self, now: float) -> None:
        window = self._window
        if not window or window[0].ended >= now - self.window_s:
            return
        while window and window[0].ended < now - self.window_s:
            old = window.popleft()
            self._window_tokens -= old.tokens
            self._window_seconds -= old.seconds
        if not window:
            self._window_tokens, self._window_seconds = 0, 0.0  # no float residue
        self._base = None

    def _decay_in(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        keep = math.exp(-seconds / self.smooth_s)
        self._sum_tokens = keep * self._sum_tokens + tokens
        self._sum_seconds = keep * self._sum_seconds + seconds
        self.long_run = self._sum_tokens / self._sum_seconds
        self._base = None


def timed_seed(run: Callable[[list], object], batch: Sequence, runs: int = SEED_RUNS,
               clock: Callable[[], float] = time.perf_counter) -> tuple[int, float]:
    """Tokens and seconds of `batch` on the engine (`run`), to seed the drain rate at start-up.

    Run `runs` times, each timed, and the fastest run is the figure: a start-up batch is tens of
    milliseconds, and one scheduler hiccup on a busy machine (another process holding a core for a time
    slice) can make a single run several times slower than the engine is. Seeded from that run, admission
    would refuse the first requests for a wait the engine never had. The first run at a new shape also pays
    one-off allocations, so it is rarely the fastest: two runs cost what one untimed and one timed run did,
    and a hiccup in either is not believed. The recent and running figures still lower the rate within a
    batch when the machine really is slow.
    """
    tokens = sum(len(row) for row in batch)
    fastest = math.inf
    for _ in range(max(1, runs)):
        started = clock()
        run(list(batch))
        fastest = min(fastest, clock() - started)
    return tokens, fastest
