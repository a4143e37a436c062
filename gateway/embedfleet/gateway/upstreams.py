"""The replicas behind each deployment, and what the gateway knows of each.

A replica's state (pick.State), its last reported expected wait, the requests this gateway has in
flight to it and its mean service time. Three sources keep them fresh: a cheap poll of every
replica's `GET /load` (every --poll-interval, faster while requests are held), the
`x-embedfleet-expected-wait` and `server-timing` headers on every answer, and what happens to a
request (a 503 `draining` marks the replica draining at once, a refused connection marks it down).
Each replica's vector space (pinning.py) is learned from its `GET /v1/models` when a poll first finds
it up (again after it was down: a restarted process may serve another revision; at most every
SPACE_RETRY_S while it reports none), and from the `x-embedfleet-vector-space` header of its answers.

The replica set of a deployment is replaced at run time by `set_replicas`: from --upstream flags
locally, from watched EndpointSlices on Kubernetes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from embedfleet.gateway.eject import Ejection
from embedfleet.gateway.pick import ROUTABLE, State
from embedfleet.gateway.pinning import HEADER_VECTOR_SPACE, label, space_of_cards, spaces_of_header

log = logging.getLogger("embedfleet.gateway.upstreams")

SERVICE_ALPHA = 0.2  # weight of the newest answer in a replica's mean service time
DEFAULT_SERVICE_S = 0.01  # before a replica's first answer
SPACE_RETRY_S = 5.0  # a replica whose /v1/models named no vector space is asked again after this long
RUNTIME_STATES = {"ready": State.READY, "saturated": State.BUSY, "draining": State.DRAINING}


@dataclass(eq=False, slots=True)
class Replica:
    deployment: str
    url: str
    state: State = State.DOWN
    reported_wait_s: float = 0.0  # the replica's expected queue wait, as last reported
    reported_at: float = -math.inf  # time.monotonic() of that report
    in_flight: int = 0  # requests this gateway has sent it and not finished
    service_s: float = DEFAULT_SERVICE_S  # mean of its answers' server-timing
    marked_at: float = -math.inf  # when a request's outcome last set `state` (a poll begun before is stale)
    detail: str = "not polled yet"
    ejection: Ejection = field(default_factory=Ejection)  # failures in a row, and when an ejection ends (eject.py)
    vector_space: str | None = None  # the space it serves the deployment's model in, as it last said (pinning.py)
    space_asked_at: float = -math.inf  # when its GET /v1/models was last read for that

    def report_wait(self, wait_s: float, at: float) -> None:
        if at >= self.reported_at and math.isfinite(wait_s):
            self.reported_wait_s, self.reported_at = max(0.0, wait_s), at

    def report_service(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.service_s += SERVICE_ALPHA * (seconds - self.service_s)


def read_load(doc: Any, deployment: str) -> tuple[State, float | None, str]:
    """A runtime's `GET /load` document -> (state, expected wait for `deployment`'s model, detail)."""
    if not isinstance(doc, dict):
        return State.DOWN, None, "GET /load answered something other than a JSON object"
    status = doc.get("status")
    if doc.get("draining"):
        state = State.DRAINING
    elif isinstance(status, str):
        state = RUNTIME_STATES.get(status, State.DOWN)
    else:
        state = State.READY if doc.get("ready") else State.DOWN
    models = doc.get("models") if isinstance(doc.get("models"), dict) else {}
    waits = {name: m.get("expected_wait_s") for name, m in models.items() if isinstance(m, dict)}
    waits = {name: float(w) for name, w in waits.items() if isinstance(w, int | float) and not isinstance(w, bool)}
    wait = waits.get(deployment, max(waits.values(), default=None))
    return state, wait, str(status or ("ready" if state is State.READY else "not ready"))


def server_timing(value: str | None) -> dict[str, float]:
    """`server-timing: total;dur=12.5, queue;dur=0.3` -> {"total": 0.0125, "queue": 0.0003} (seconds): the
    entries with a readable `dur`, by name; {} when absent."""
    parts: dict[str, float] = {}
    for metric in (value or "").split(","):
        name, _, params = metric.strip().partition(";")
        for param in params.split(";"):
            key, _, dur = param.strip().partition("=")
            if key == "dur":
                try:
                    parts[name.strip()] = float(dur) / 1000
                except ValueError:
                    pass
    return parts


def server_timing_s(value: str | None) -> float | None:
    """`server-timing: total;dur=12.5` -> 0.0125 (seconds); None when absent or unreadable."""
    return server_timing(value).get("total")

class Upstreams:
    def __init__(self, session: aiohttp.ClientSession, *, poll_interval: float, held_poll_interval: float,
                 poll_timeout: float, on_change: Callable[[str], None], holding: Callable[[], bool],
                 now: Callable[[], float] = time.monotonic) -> None:
        self.session = session  # for polls only: a poll never waits behind work for a connection
        self.poll_interval = poll_interval
        self.held_poll_interval = held_poll_interval
        self.poll_timeout = aiohttp.ClientTimeout(total=poll_timeout)
        self.on_change = on_change  # called with a deployment's name when its replicas may take more work
        self.holding = holding  # true while requests are held: poll faster
        self.now = now
        self.deployments: dict[str, dict[str, Replica]] = {}
        self.models: dict[str, str] = {}  # deployment -> the model name its requests ask for (a card's id)
        self._wake = asyncio.Event()
        self._down_polls: dict[str, asyncio.Task] = {}  # URL -> its poll in flight, for replicas that are down
        # told of every poll that failed (URL, why): the work client gives up its connections there that hear
        # nothing from the host (wire.py, `WireClient.suspect`)
        self.on_failed_poll: Callable[[str, str], object] | None = None

    def set_replicas(self, deployment: str, urls: Iterable[str]) -> None:
        """The replicas of `deployment` are now exactly `urls`; known ones keep their state, new ones
        are down until polled (at once), removed ones get no new work."""
        old = self.deployments.get(deployment, {})
        new = {url: old.get(url) or Replica(deployment, url) for url in dict.fromkeys(u.rstrip("/") for u in urls)}
        self.deployments[deployment] = new
        for url in new.keys() - old.keys():
            log.info("%s: replica %s added", deployment, url)
        for url in old.keys() - new.keys():
            log.info("%s: replica %s removed", deployment, url)
        self.poll_now()

    def replicas(self, deployment: str) -> Collection[Replica]:
        return self.deployments.get(deployment, {}).values()

    def _set_state(self, replica: Replica, state: State, detail: str) -> None:
        if replica.state is not state:
            level = logging.INFO if state in (State.READY, State.DRAINING) or replica.state is State.READY \
                else logging.DEBUG
            log.log(level, "%s: replica %s %s -> %s (%s)", replica.deployment, replica.url, replica.state.value,
                    state.value, detail)
        replica.state, replica.detail = state, detail

    def mark(self, replica: Replica, state: State, detail: str) -> None:
        """What a request found (draining, down); holds until a poll begun after now says otherwise."""
        replica.marked_at = self.now()
        self._set_state(replica, state, detail)

    def answered(self, replica: Replica, headers) -> None:
        """Read the load a replica reports on its answer."""
        wait = headers.get("x-embedfleet-expected-wait")
        if wait is not None:
            try:
                replica.report_wait(float(wait), self.now())
            except ValueError:
                pass
        took = server_timing_s(headers.get("server-timing"))
        if took is not None:
            replica.report_service(took)
        spaces = spaces_of_header(headers.get(HEADER_VECTOR_SPACE))
        if len(spaces) == 1 and replica.vector_space not in spaces:
            self.learned(replica, label(next(iter(spaces))), "its answer")

    def learned(self, replica: Replica, space: str | None, source: str) -> None:
        """`replica` serves `space` (None: it did not say); a change may let held requests go to it."""
        if space is None or space == replica.vector_space:
            return
        log.info("%s: replica %s serves vector space %s (%s)", replica.deployment, replica.url, space, source)
        replica.vector_space = space
        self.on_change(replica.deployment)

    def poll_now(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Poll every replica until cancelled."""
        try:
            while True:
                self._wake.clear()
                try:
                    await self.poll_once()
                except Exception:  # a bug here must not stop every later poll
                    log.exception("poll failed")
                interval = self.held_poll_interval if self.holding() else self.poll_interval
                try:
                    await asyncio.wait_for(self._wake.wait(), interval)
                except TimeoutError:
                    pass
        finally:
            for task in list(self._down_polls.values()):
                task.cancel()

    async def poll_once(self) -> None:
        """One round: the replicas that are up are polled together and waited for; each one that is down is
        polled on its own (at most one poll per address at a time) and never waited for, so an address that
        does not answer (a starting pod's endpoint on a node that went NotReady stays in its EndpointSlice
        until the pod is evicted) cannot hold every round for --poll-timeout. Either way a result counts when
        it arrives."""
        by_url: dict[str, list[Replica]] = {}
        for replicas in self.deployments.values():
            for replica in replicas.values():
                by_url.setdefault(replica.url, []).append(replica)
        if not by_url:
            return
        started = self.now()
        up = {url: group for url, group in by_url.items() if any(r.state is not State.DOWN for r in group)}
        for url in by_url.keys() - up.keys() - self._down_polls.keys():
            task = asyncio.get_running_loop().create_task(self._poll_down(url), name=f"poll-{url}")
            self._down_polls[url] = task
            task.add_done_callback(lambda _task, url=url: self._down_polls.pop(url, None))
        if up:
            await self._apply(list(up.values()), await asyncio.gather(*(self._fetch_load(url) for url in up)),
                              started)

    async def _poll_down(self, url: str) -> None:
        """One poll of a replica that is down, applied when it answers (or fails) to the replicas at `url` then."""
        started = self.now()
        result = await self._fetch_load(url)
        group = [replica for replicas in self.deployments.values() if (replica := replicas.get(url)) is not None]
        if group:
            try:
                await self._apply([group], [result], started)
            except Exception:  # a bug here must not go unseen in a task nobody awaits
                log.exception("poll of %s failed", url)

    async def _apply(self, groups: list[list[Replica]], results: list[tuple[Any, str | None]],
                     started: float) -> None:
        """What a round's polls begun at `started` found, for each group of replicas sharing a URL."""
        changed: set[str] = set()
        seen: list[tuple[Replica, State, str]] = []
        for replicas, (doc, problem) in zip(groups, results, strict=True):
            for replica in replicas:
                if problem is None:
                    state, wait, detail = read_load(doc, replica.deployment)
                    if wait is not None:
                        replica.report_wait(wait, started)
                else:
                    state, detail = State.DOWN, problem
                seen.append((replica, state, detail))
            if problem is not None and replicas and self.on_failed_poll is not None:
                self.on_failed_poll(replicas[0].url, problem)
        # A replica coming up is asked its vector space before it is routable: no request goes to it unpinned.
        ask = [r for r, state, _ in seen if state in ROUTABLE and (r.state not in ROUTABLE or (
            r.vector_space is None and started - r.space_asked_at >= SPACE_RETRY_S))]
        if ask:
            await self._learn_spaces(ask, started)
        for replica, state, detail in seen:
            if started < replica.marked_at:
                continue  # a request saw newer news than this poll
            was = replica.state
            self._set_state(replica, state, detail)
            if state is not was:
                changed.add(replica.deployment)
        for deployment in changed:
            self.on_change(deployment)

    async def _learn_spaces(self, replicas: list[Replica], at: float) -> None:
        """Read each replica's vector space from its GET /v1/models (one request per URL)."""
        by_url: dict[str, list[Replica]] = {}
        for replica in replicas:
            replica.space_asked_at = at
            by_url.setdefault(replica.url, []).append(replica)
        docs = await asyncio.gather(*(self._fetch(f"{url}/v1/models") for url in by_url))
        for group, (doc, _) in zip(by_url.values(), docs, strict=True):
            for replica in group:
                model = self.models.get(replica.deployment, replica.deployment)
                self.learned(replica, space_of_cards(doc, model), "GET /v1/models")

    async def _fetch_load(self, url: str) -> tuple[Any, str | None]:
        return await self._fetch(f"{url}/load")

    async def _fetch(self, url: str) -> tuple[Any, str | None]:
        path = url.split("/", 3)[-1]
        try:
            async with self.session.get(url, timeout=self.poll_timeout) as resp:
                if resp.status != 200:
                    return None, f"GET /{path} answered {resp.status}"
                return orjson.loads(await resp.read()), None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            return None, f"GET /{path} failed: {type(exc).__name__}: {exc}"
