"""The deployments the gateway fronts: for each, its replicas, its held requests and its cold start.

`acquire` gives a request a replica at once (pick's least-wait choice among the replicas not
ejected for failing (eject.py), counted in flight before it returns), sends it to another region's
gateway when every replica here is over the spill bound and the policy names one (spill.py, "queue"),
refuses it at once with 429 `overloaded` when every replica would refuse it for its expected wait
(shed.py), or, when none can take work, spills it ("cold") or holds it until one can. When a poll
finds one, the held requests are handed out interactive first, then oldest first, each to the
least-wait replica at that moment, in the same step, so no later request overtakes them and no query
waits behind bulk work. A hold is bounded in number (--max-held) and in time (--hold-timeout); both
refusals say when to come back from the deployment's learned cold start. The shed and spill bounds
are the deployment's own (its EmbeddingDeployment's, on Kubernetes: bounds.py), else the flags.

Pinning (pinning.py): a request goes only to replicas of the vector space its name resolves to here
(or that it arrived pinned to), never to one that refused it for its space; nothing of that space able
to take it: it is held like a cold start, and refused at the hold time-out with a message saying the
name resolves to a different revision there, mid-rollout (409 `vector_space_mismatch` for a request that
came pinned, so the region that spilled it tries elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from embedfleet.compat.names import split_model
from embedfleet.gateway.bounds import Bounds, from_flag, shed_bound, spill_after
from embedfleet.gateway.coldstart import ColdStart
from embedfleet.gateway.config import GatewayConfig
from embedfleet.gateway.eject import admitted
from embedfleet.gateway.errors import Refused
from embedfleet.gateway.hold import Held, HeldQueue
from embedfleet.gateway.pick import ROUTABLE, State, expected_wait, pick, pick_in_turn
from embedfleet.gateway.pinning import (
    HEADER_VECTOR_SPACE,
    MISMATCH,
    UNAVAILABLE,
    effective_space,
    eligible,
    serves_elsewhere,
)
from embedfleet.gateway.shed import decide
from embedfleet.gateway.spill import COLD, QUEUE, Target, choose, queue_bound, should_spill, should_spill_queue
from embedfleet.gateway.upstreams import Replica, Upstreams

log = logging.getLogger("embedfleet.gateway.fleet")


@dataclass
class Deployment:
    name: str
    held: HeldQueue[asyncio.Future[Replica]]
    cold: ColdStart
    in_flight: int = 0  # requests the gateway is handling for it, held ones included
    last_request_at: float | None = None  # time.monotonic() of the latest arrival
    turn: int = 0  # --balance round-robin: requests routed so far
    vector_space: str | None = None  # the space its requests are pinned to, when the cluster says (pinning.py)
    mixed: frozenset[str] = frozenset()  # the spaces its replicas reported when that was last warned about
    bounds: Bounds = field(default_factory=Bounds)  # its own shed/spill bounds (bounds.py); unset: the flags


@dataclass(slots=True)
class Ticket:
    """One request's place in line: its arrival number, and when it was first held (if ever)."""

    arrival: int
    bulk: bool = False  # bulk work (classes.py): held behind queries, shed against the bulk bound
    held_since: float | None = None
    hold: Held | None = field(default=None, repr=False)
    may_spill: bool = True  # false for a request another region spilled here (never spilled again)
    spilled_to: Target | None = None  # the region's gateway this attempt goes to (spill.py)
    spill_reason: str = ""  # why it went there: spill.COLD or spill.QUEUE
    model: str = ""  # the model name the request asked for (messages)
    space: str | None = None  # the vector space it is pinned to (pinning.py); None: not known here, no pin
    pinned: bool = False  # it arrived carrying that pin (spilled in): this gateway does not choose another
    refused: dict[str, str] = field(default_factory=dict)  # URL -> who: answered 409 vector_space_mismatch


class Fleet:
    def __init__(self, config: GatewayConfig, poll_session: aiohttp.ClientSession,
                 rng: random.Random | None = None, now: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.now = now
        self.deployments: dict[str, Deployment] = {}
        # Kubernetes mode: served model name -> deployment ("<namespace>/<name>"); empty: names are models
        self.aliases: dict[str, str] = {}
        self.on_hold: Callable[[Deployment], None] | None = None  # a request found no replica (waking)
        self.spill: dict[str, list[Target]] = {}  # deployment -> other regions' gateways, policy's order
        self.upstreams = Upstreams(poll_session, poll_interval=config.poll_interval,
                                   held_poll_interval=config.held_poll_interval, poll_timeout=config.poll_timeout,
                                   on_change=self._replicas_changed, holding=self.holding, now=now)
        self._arrivals = 0
        for name, urls in config.upstreams.items():
            self.set_replicas(name, urls)
            self.deployments[name].vector_space = config.vector_spaces.get(name)
            if name in config.bounds:
                self.deployments[name].bounds = from_flag(name, config.bounds[name])
        for name, targets in config.spill.items():
            self.set_spill(name, [Target(region, url) for region, url in targets])

    # -- the replica set (flags now, EndpointSlices on Kubernetes)

    def set_replicas(self, name: str, urls: list[str]) -> None:
        """`name`'s replicas are now `urls` (an empty list keeps the deployment known: requests for it
        are held until a replica appears)."""
        if name not in self.deployments:
            self.deployments[name] = Deployment(name, HeldQueue(self.config.max_held),
                                                ColdStart(default_s=self.config.cold_start_default))
        self.upstreams.set_replicas(name, urls)

    def set_spill(self, name: str, targets: list[Target]) -> None:
        """Where `name` may spill (the policy's choice; empty: nowhere). Known targets keep their state."""
        old = {(t.region, t.url): t for t in self.spill.get(name, [])}
        if [(t.region, t.url) for t in targets] != list(old):
            # once per change (the cluster's watch hands over every deployment's targets on each event)
            log.info("%s may spill to %s", name, ", ".join(f"{t.region} ({t.url})" for t in targets) or "nowhere")
        self.spill[name] = [old.get((t.region, t.url), t) for t in targets]

    def set_routes(self, routes: dict[str, tuple[str, list[str]]], spaces: dict[str, str | None] | None = None,
                   bounds: dict[str, Bounds] | None = None) -> None:
        """Kubernetes mode (kube.py): served model name -> (deployment, replica URLs), the whole set, and
        each deployment's vector space and own bounds. A deployment that left the cluster is forgotten
        unless requests are still held for it (they then wait out their hold and are refused as any cold
        start is)."""
        self.aliases = {model: key for model, (key, _) in routes.items()}
        for model, (key, urls) in routes.items():
            self.set_replicas(key, urls)
            self.upstreams.models[key] = model
            self.deployments[key].vector_space = (spaces or {}).get(key)
            self.deployments[key].bounds = (bounds or {}).get(key) or Bounds()
        live = set(self.aliases.values())
        for key in [k for k, d in self.deployments.items() if k not in live]:
            self.upstreams.set_replicas(key, [])
            if not len(self.deployments[key].held) and not self.deployments[key].in_flight:
                del self.deployments[key]
                self.upstreams.deployments.pop(key, None)

    # -- requests

    def resolve(self, model: str | None, pin: str | None = None) -> Deployment:
        """The deployment serving `model`; when the body names none, the only deployment there is. A
        request pinned to a vector space (`pin`) that the name's own deployment does not serve goes to the
        deployment of the same model in that space, if there is one here (`bge` pinned to r2's space ->
        `bge@r2`): a region a flip behind still answers from the right index."""
        if model is None:
            if len(self.deployments) == 1:
                return next(iter(self.deployments.values()))
            raise Refused(400, "the request names no model and this gateway serves several: set `model` to one of "
                          f"{self._names()}", "model_required")
        deployment = self.deployments.get(self.aliases.get(model, "") if self.aliases else model)
        if deployment is None:
            raise Refused(404, f"the model {model!r} does not exist here; this gateway serves {self._names()}",
                          "model_not_found")
        if pin is not None and self.space_of(deployment) != pin:
            base = split_model(model)[0]
            for name in self._names():
                sibling = self.deployments.get(self.aliases.get(name, "") if self.aliases else name)
                if sibling is not None and split_model(name)[0] == base and self.space_of(sibling) == pin:
                    return sibling
        return deployment

    def _names(self) -> list[str]:
        """The names requests may ask for."""
        return sorted(self.aliases) if self.aliases else sorted(self.deployments)

    def space_of(self, deployment: Deployment) -> str | None:
        """The vector space `deployment`'s requests are pinned to (pinning.effective_space); warns once per
        change when its replicas report several (only the chosen one's replicas get its requests)."""
        replicas = self.upstreams.replicas(deployment.name)
        space = effective_space(deployment.vector_space, replicas)
        seen = frozenset(r.vector_space for r in replicas if r.vector_space is not None)
        if len(seen | ({space} if space else set())) > 1 and seen != deployment.mixed:
            log.warning("%s: its replicas serve the vector spaces %s; requests go only to those of %s (the first "
                        "routable listed, or the cluster's choice), never mixed", deployment.name,
                        ", ".join(sorted(seen)), space)
        deployment.mixed = seen
        return space

    def begin(self, deployment: Deployment) -> Ticket:
        deployment.in_flight += 1
        deployment.last_request_at = self.now()
        self._arrivals += 1
        return Ticket(self._arrivals)

    def end(self, deployment: Deployment) -> None:
        deployment.in_flight -= 1

    async def acquire(self, deployment: Deployment, ticket: Ticket, deadline: float | None) -> Replica:
        """A replica for the request, counted in flight (give it back with `done`), at once or after a
        hold, or another region's gateway (spill.py). Refused: 429 overloaded (shed.py), 503 hold_full /
        cold_start with Retry-After, or 504 when `deadline` passes."""
        target = self._queue_spill_target(deployment, ticket, self.now())
        if target is not None:  # every replica here is over the bound: another region, before shedding
            return self._spill_to(deployment, ticket, target, QUEUE)
        candidates = admitted(self._eligible(deployment, ticket), self.now())  # (once for both)
        self._shed(deployment, ticket, candidates)
        replica = self._pick(deployment, ticket, candidates)
        if replica is not None:
            replica.in_flight += 1
            return replica
        now = self.now()
        if ticket.pinned and ticket.space is not None and (
                deployment.vector_space not in (None, ticket.space)
                or serves_elsewhere(self.upstreams.replicas(deployment.name), ticket.space)):
            raise self._mismatch(deployment, ticket)  # nothing here serves that space: do not hold it
        target = self._spill_target(deployment, ticket, now)
        if target is not None:
            if self.on_hold is not None:  # wake this region's replicas for the requests after it
                self.on_hold(deployment)
            return self._spill_to(deployment, ticket, target, COLD)
        if ticket.held_since is None:
            ticket.held_since = now
        future: asyncio.Future[Replica] = asyncio.get_running_loop().create_future()
        ticket.hold = Held(ticket.arrival, ticket.held_since, future, ticket.bulk, ticket)
        if not deployment.held.admit(ticket.hold):
            raise Refused(503, f"{deployment.name} has no replica ready and already holds {deployment.held.bound} "
                          "requests (--max-held); retry later", "hold_full", self._retry_after(deployment, now))
        self.upstreams.poll_now()  # a replica that just came up is found now, not at the next tick
        if self.on_hold is not None:
            self.on_hold(deployment)
        hold_until = ticket.held_since + self.config.hold_timeout
        until = hold_until if deadline is None else min(hold_until, deadline)
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(0.0, until - now))
        except TimeoutError:
            if future.done():  # released in the same instant
                return future.result()
            deployment.held.remove(ticket.hold)
            now = self.now()
            if deadline is not None and deadline <= hold_until:
                raise Refused(504, "the request's deadline passed while no replica of "
                              f"{deployment.name} was ready", "deadline_exceeded") from None
            if self._kept_off(deployment, ticket):
                raise self._mismatch(deployment, ticket) from None
            deployment.cold.observe_at_least(now - ticket.held_since)
            raise Refused(503, f"{deployment.name} has had no replica ready for {now - ticket.held_since:.0f}s "
                          "(--hold-timeout); it is starting from cold, retry later", "cold_start",
                          self._retry_after(deployment, now, ticket.held_since)) from None
        except asyncio.CancelledError:  # the client left while held
            if future.done() and not future.cancelled():
                future.result().in_flight -= 1
            else:
                deployment.held.remove(ticket.hold)
            raise

    @staticmethod
    def _spill_to(deployment: Deployment, ticket: Ticket, target: Target, reason: str) -> Replica:
        """Another region's gateway, as if it were a replica (the proxy marks the request and counts it)."""
        ticket.spilled_to, ticket.spill_reason = target, reason
        return Replica(deployment.name, target.url, state=State.READY, in_flight=1)

    def _spill_targets(self, deployment: Deployment, ticket: Ticket) -> list[Target]:
        """Where this request may go: the policy's targets, less those that refused its vector space."""
        if not ticket.may_spill:
            return []
        return [t for t in self.spill.get(deployment.name, []) if t.url not in ticket.refused]

    def _spill_target(self, deployment: Deployment, ticket: Ticket, now: float) -> Target | None:
        """Cold: nothing here can take the request and its cold start is expected to last too long."""
        targets = self._spill_targets(deployment, ticket)
        if not targets:
            return None
        cold_for = 0.0 if ticket.held_since is None else now - ticket.held_since
        remaining = deployment.cold.expected_s() - cold_for
        routable = any(r.state in ROUTABLE for r in self._eligible(deployment, ticket))
        after = spill_after(deployment.bounds, self.config).seconds
        if not should_spill(routable, not ticket.may_spill, remaining, after, targets):
            return None
        return choose(targets, now)

    def _queue_spill_target(self, deployment: Deployment, ticket: Ticket, now: float) -> Target | None:
        """Queue: every replica here that may take the request is over the spill bound for its class."""
        targets = self._spill_targets(deployment, ticket)
        if not targets:
            return None
        bound = queue_bound(spill_after(deployment.bounds, self.config).seconds,
                            shed_bound(deployment.bounds, self.config, ticket.bulk).seconds, ticket.bulk)
        replicas = admitted(self._eligible(deployment, ticket), now)
        if not should_spill_queue(replicas, bound, ticket.bulk, not ticket.may_spill, targets):
            return None
        return choose(targets, now)

    def _eligible(self, deployment: Deployment, ticket: Ticket | None) -> list[Replica]:
        """The replicas that may take this request: of its vector space (fixed here at its first pick, if
        known by then) and not among those that refused it for its space."""
        replicas = list(self.upstreams.replicas(deployment.name))
        if ticket is None:
            return replicas
        if ticket.space is None:
            ticket.space = self.space_of(deployment)
        return [r for r in replicas if eligible(r, ticket.space) and r.url not in ticket.refused]

    def _kept_off(self, deployment: Deployment, ticket: Ticket) -> bool:
        """Was the request kept from an answer by its pin (refusals, or only other spaces able to take it)?"""
        return bool(ticket.refused) or (ticket.space is not None and any(
            r.state in ROUTABLE and not eligible(r, ticket.space) for r in self.upstreams.replicas(deployment.name)))

    def _mismatch(self, deployment: Deployment, ticket: Ticket) -> Refused:
        """The refusal of a request no replica of its vector space could take: 409 for one that came
        pinned (the region that spilled it tries another), 503 for one this gateway pinned itself."""
        here = sorted({r.vector_space for r in self.upstreams.replicas(deployment.name) if r.vector_space}
                      | ({deployment.vector_space} if deployment.vector_space else set()))
        elsewhere = sorted({who for who in ticket.refused.values() if who != "replica"})
        model = ticket.model or deployment.name
        if ticket.pinned:
            return Refused(409, f"the request is pinned to vector space {ticket.space!r} ({HEADER_VECTOR_SPACE}), "
                           f"but the model {model!r} resolves to {', '.join(map(repr, here)) or 'no vector space'} "
                           "here: mid-rollout, this region serves another revision under that name, whose vectors "
                           "are not interchangeable", MISMATCH)
        spill = f"; the regions it could spill to ({', '.join(elsewhere)}) resolve it to a different revision" \
            if elsewhere else ""
        return Refused(503, f"the model {model!r} resolves to vector space {ticket.space!r} here, and no replica of "
                       f"that space could take the request: mid-rollout, the name resolves to a different revision "
                       f"on the replicas that can answer{spill}; retry later, or ask for a revision by name "
                       "(<model>@rN)", UNAVAILABLE, self._retry_after(deployment, self.now()))

    def _pick(self, deployment: Deployment, ticket: Ticket | None = None,
              candidates: list[Replica] | None = None) -> Replica | None:
        """The replica for the next request, of those not ejected and of its vector space (`candidates`,
        when the caller has them): the least-wait one, or the next in turn with --balance round-robin (a
        baseline for benchmarks)."""
        replicas = admitted(self._eligible(deployment, ticket), self.now()) if candidates is None else candidates
        if self.config.balance == "round-robin":
            deployment.turn += 1
            return pick_in_turn(replicas, deployment.turn)
        return pick(replicas, self.rng)

    def _shed(self, deployment: Deployment, ticket: Ticket, candidates: list[Replica]) -> None:
        """429 `overloaded` now when every replica that may take the request (`candidates`) would refuse
        it for its expected wait."""
        bound = shed_bound(deployment.bounds, self.config, ticket.bulk)
        shed = decide(candidates, bound.seconds, ticket.bulk)
        if shed is not None:
            raise Refused(429, f"every replica of {deployment.name} is overloaded: the least loaded expects "
                          f"{shed.least_wait_s:.1f}s of queued work, over the bound of {bound.seconds:g}s "
                          f"({bound.source}); retry in {shed.retry_after}s", "overloaded", shed.retry_after)

    def done(self, replica: Replica) -> None:
        replica.in_flight -= 1

    def outcome(self, replica: Replica, failed: bool) -> bool:
        """What a request found on `replica` (eject.is_failure); True when this failure ejects it."""
        if not failed:
            replica.ejection.succeeded()
            return False
        if not self.config.eject_after:
            return False
        now = self.now()
        if not replica.ejection.failed(now, self.config.eject_after, self.config.eject_base, self.config.eject_max):
            return False
        log.warning("%s: replica %s ejected for %.0fs after failing requests", replica.deployment, replica.url,
                    replica.ejection.until - now)
        return True

    def _retry_after(self, deployment: Deployment, now: float, cold_since: float | None = None) -> int:
        """Seconds until the deployment is expected to be ready: the learned cold start less how long it
        has been cold (since its oldest held request, or `cold_since`)."""
        since = [h.since for h in (deployment.held.oldest(),) if h is not None]
        if cold_since is not None:
            since.append(cold_since)
        return deployment.cold.retry_after(now - min(since) if since else 0.0)

    def _replicas_changed(self, name: str) -> None:
        """Hand every held request of `name`, oldest first, to the least-wait replica at that moment."""
        deployment = self.deployments.get(name)
        if deployment is None or not len(deployment.held):
            return
        replicas = self.upstreams.replicas(name)
        if not any(r.state in ROUTABLE for r in replicas):
            return
        now = self.now()
        oldest = deployment.held.oldest()
        released = False
        for held in list(deployment.held):  # release order; each goes only where its pin allows
            replica = self._pick(deployment, held.owner if isinstance(held.owner, Ticket) else None)
            if replica is None:
                continue
            deployment.held.remove(held)
            replica.in_flight += 1
            held.item.set_result(replica)
            released = True
        if released:
            deployment.cold.observe(now - oldest.since)

    def replica_waits(self) -> dict[str, dict[str, float]]:
        """Per deployment, per replica URL: the expected wait the gateway routes by (pick.expected_wait)."""
        return {name: {r.url: expected_wait(r) for r in self.upstreams.replicas(name)} for name in self.deployments}

    def holding(self) -> bool:
        return any(len(d.held) for d in self.deployments.values())

    def snapshot(self) -> dict[str, dict]:
        """Per deployment: in flight (held included), held, replicas able to take work, replicas, and
        seconds since the latest request (None: none yet). What an autoscaler reads."""
        now = self.now()
        out = {}
        for name, d in self.deployments.items():
            replicas = self.upstreams.replicas(name)
            out[name] = {
                "in_flight": d.in_flight, "held": len(d.held),
                "ready_replicas": sum(r.state in ROUTABLE for r in replicas), "replicas": len(replicas),
                "last_request_age_s": None if d.last_request_at is None else round(now - d.last_request_at, 3),
                "expected_cold_start_s": round(d.cold.expected_s(), 3),
            }
        return out
