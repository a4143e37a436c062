"""What the hub writes on its own API server after a placement pass: each hub EmbeddingDeployment's status (a row
per spoke from what its copy is after the pass's writes), its Events, and the PlacementPolicies' status.

Separate from placement and from the spoke writes because it only ever talks to the hub, and because its
rules are about saying things once: a status is patched only when a value changed
(``convert.status_changes``), an Event only when a problem, a share or a rollout phase differs from the
status last written (so also once across hub restarts), and an object deleted since it was read is skipped,
not a failed reconcile. The FleetClusters' status (clusters.py) is patched through the same ``patch_status``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from embedfleet.operator import status as st
from embedfleet.operator.autoscale_target import DEPRECATION_REASON
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import PLACEMENT_POLICY_KIND
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.errors import SPOKE_ERRORS
from embedfleet.operator.hub.informer import Informer, object_key
from embedfleet.operator.hub.policy_status import policy_statuses
from embedfleet.operator.hub.stamps import wall
from embedfleet.operator.hub.state import SpokeView
from embedfleet.operator.hub.writes import Outcome
from embedfleet.operator.kube import Kube, KubeError
from embedfleet.operator.rollout import waves
from embedfleet.operator.scheduling import Placement
from embedfleet.operator.scheduling.explain import placement_line

log = logging.getLogger(__name__)

ED = naming.EMBEDDING_DEPLOYMENT_KIND


class Reporter:
    """Status and Events of the hub's objects. ``informers`` is the controller's dict of hub informers (by
    collection name; filled on first use), which tells whether an object was deleted meanwhile."""

    def __init__(self, hub: Kube, informers: Mapping[str, Informer]) -> None:
        self.hub = hub
        self.informers = informers
        #: (informer, object key) -> the resourceVersion of this hub's last status write to it, until a view
        #: of the object shows it (`settled`; only deployments are checked: other kinds keep one entry each)
        self._written: dict[tuple[str, str], str] = {}

    def settled(self, informer: str, obj: Mapping[str, Any]) -> bool:
        """Whether ``obj`` (a view of the object, read at the round's start) already shows this hub's own last
        status write to it. A status computed from a view that does not (the watch event of the write had not
        arrived) repeats that write with new transition times, and its Events again: such an object waits
        for the next round. Judged on the object's own resourceVersion, not on how far the watch has got
        since it was read. Versions that are not integers (never issued by an etcd-backed API server) are
        not compared: the write goes through, as it did before this check."""
        key = (informer, object_key(obj))
        written = self._written.get(key)
        if not written:
            return True
        seen = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if not (seen.isdigit() and written.isdigit()) or int(seen) >= int(written):
            del self._written[key]
            return True
        return False

    def reconcile(self, obj: dict[str, Any], placement: Placement, target: int,
                  views: Mapping[str, SpokeView], outcomes: Mapping[str, Mapping[str, Outcome]],
                  decision: waves.Decision | None = None, deprecation: str | None = None) -> None:
        """Status and Events of one hub object from what each spoke's copy is after this pass's writes
        (``deprecation``: the sentence for a deprecated field its spec relies on, said in ``Accepted``)."""
        if not self.settled("deployments", obj):
            return
        key = object_key(obj)
        status = obj.get("status") or {}
        old_rows = {r["name"]: r for r in status.get("clusters") or []}
        rows: list[dict[str, Any]] = []
        failures: dict[str, str] = {}
        unavailable: dict[str, str] = {}
        for name, view in sorted(views.items()):
            share = placement.share(name, view.region)
            if view.copies is not None and not view.skipped:
                outcome = outcomes.get(name, {}).get(key)
                refused = view.link.refused.get(key) if view.link is not None else None
                if outcome is None and refused is not None and share is not None:  # refused, not retried yet
                    outcome = Outcome(view.copies.get(key), refused[1])
                live = outcome.live if outcome is not None else view.copies.get(key)
                problem = outcome.problem if outcome is not None else convert.refusal_of(live)
                if share is not None or live is not None or problem:
                    rows.append(convert.spoke_row(name, share, view.region, live, view.last_seen, problem))
                if problem:
                    failures[name] = problem
            elif view.skipped and view.health.available:
                row = old_rows.get(name)
                if view.held:  # breaker open: say so
                    rows.append(convert.spoke_row(name, share, view.region, None, view.last_seen, view.held))
                    failures[name] = view.held
                elif row is not None:  # its writes are still running: the row as the hub last wrote it
                    rows.append(dict(row))
                    if convert.row_problem(row):
                        failures[name] = str(convert.row_problem(row))
                elif share is not None:  # a new share whose first write is still running there
                    rows.append(convert.spoke_row(name, share, view.region, None, view.last_seen))
            elif view.health.available:  # in its grace period, but its watch is down
                if share is not None or name in old_rows:
                    problem = f"unreachable: {view.error or 'not read yet'}"
                    rows.append(convert.spoke_row(name, share, view.region, None, view.last_seen, problem))
                    failures[name] = problem
            elif name in old_rows:  # it held a copy; its replicas moved, the copy there waits for its return
                problem = (f"unavailable ({view.health.reason}): replicas moved elsewhere; its copy there is "
                           "brought to its new share when it returns")
                rows.append(convert.spoke_row(name, None, view.region, None, view.last_seen, problem))
                unavailable[name] = view.health.reason
        self._events(obj, old_rows, rows, placement)
        generation = obj["metadata"].get("generation")
        conds = convert.conditions(placement, rows, failures, unavailable, generation, deprecation)
        line = placement_line(placement)
        for cond in conds:  # where it runs, what its embeddings cost there, what was left out and why
            if line and cond.get("type") == "Placed":
                cond["message"] = f"{cond.get('message') or ''}; {line}"
        self._deprecation_event(obj, status, conds)
        if decision is not None:
            self._rollout_events(obj, status.get("rollout") or {}, decision.status["rollout"])
            if decision.blocked is not None:
                conds.append(st.condition("RolloutBlocked", *decision.blocked, generation))
        wanted: dict[str, Any] = {
            "observedGeneration": generation,
            "conditions": st.merge_conditions(status.get("conditions"), conds, wall()),
            **(decision.status if decision is not None else {}),
        }
        ready = sum(int(r.get("ready") or 0) for r in rows if not convert.row_problem(r))
        inflight = [r["inflight"] for r in rows if r.get("inflight") is not None]
        wanted.update({
            "clusters": rows,
            "targetReplicas": target,
            "replicas": {"desired": placement.placed, "ready": ready,
                         "current": sum(int(r.get("desired") or 0) for r in rows)},
            "inFlight": sum(inflight) if inflight else None,
        })
        self.write_status(obj, wanted)

    def _deprecation_event(self, obj: dict[str, Any], status: Mapping[str, Any],
                           conds: list[dict[str, Any]]) -> None:
        """One Warning Event when ``Accepted`` comes to name a deprecation it did not name in the status last
        written (so once, also across hub restarts)."""
        def accepted(conditions: Any) -> Mapping[str, Any]:
            return next((c for c in conditions or [] if c.get("type") == "Accepted"), {})

        new, old = accepted(conds), accepted(status.get("conditions"))
        if new.get("reason") != DEPRECATION_REASON:
            return
        if old.get("reason") == DEPRECATION_REASON and old.get("message") == new.get("message"):
            return
        self._event(obj, DEPRECATION_REASON, str(new.get("message", "")).split("; ", 1)[-1], "Warning")

    def _rollout_events(self, obj: dict[str, Any], before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
        """An Event when a rollout's wave or phase changes (compared with the status last written: once)."""
        if (before.get("revision"), before.get("phase"), before.get("wave")) == \
                (after.get("revision"), after.get("phase"), after.get("wave")):
            return
        phase = after.get("phase")
        if phase == waves.ROLLED_BACK:
            self._event(obj, "RolledBack", str(after.get("message")), "Warning")
        elif phase in (waves.WAVES, waves.SIDE_BY_SIDE, waves.DONE):
            self._event(obj, "Rollout", str(after.get("message")), "Normal")

    def write_policy_statuses(self, live: Mapping[str, dict[str, Any]], placements: Mapping[str, Placement]) -> None:
        for name, wanted in policy_statuses(live, placements).items():
            pp = live[name]
            status = pp.get("status") or {}
            wanted = {**wanted, "conditions": st.merge_conditions(status.get("conditions"), wanted["conditions"],
                                                                  wall())}
            changes = convert.status_changes(status, wanted)
            if changes:
                self.patch_status("policies", PLACEMENT_POLICY_KIND, pp, changes)

    def _events(self, obj: dict[str, Any], old_rows: Mapping[str, Mapping[str, Any]], rows: list[dict[str, Any]],
                placement: Placement) -> None:
        """Events for what changed since the status the hub last wrote (so each is sent once, also across
        hub restarts): a cluster's problem appearing or clearing, and shares moving between clusters."""
        new_rows = {r["name"]: r for r in rows}
        for name in sorted(set(old_rows) | set(new_rows)):
            before, after = convert.row_problem(old_rows.get(name)), convert.row_problem(new_rows.get(name))
            if after and after != before:
                reason = {"propagation": "PropagationFailed", "unreachable": "ClusterUnreachable",
                          "writes": "ClusterUnreachable", "refused": "PropagationFailed"}.get(
                    after.split(" ", 1)[0].rstrip(":"), "ClusterUnavailable")
                self._event(obj, reason, f"{name}: {after}", "Warning")
            elif before and not after and name in new_rows:
                self._event(obj, "Propagated", f"{name}: share in place again", "Normal")
        old = {n: int(r.get("desired") or 0) for n, r in old_rows.items() if int(r.get("desired") or 0)}
        new = placement.desired() if placement.accepted else {}
        if old and old != new:
            def fmt(shares: Mapping[str, int]) -> str:
                return ", ".join(f"{n}={k}" for n, k in sorted(shares.items())) or "none"

            self._event(obj, "Rescheduled", f"{fmt(old)} -> {fmt(new)}", "Normal")

    def _event(self, obj: dict[str, Any], reason: str, message: str, type_: str) -> None:
        try:
            self.hub.event({**obj, "apiVersion": naming.API_VERSION, "kind": ED}, reason, message, type_)
        except SPOKE_ERRORS as exc:
            log.warning("could not record event %s on %s: %s", reason, object_key(obj), exc)
        log.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s %s: %s", object_key(obj), reason,
                message)

    def write_status(self, obj: dict[str, Any], wanted: dict[str, Any]) -> None:
        if not self.settled("deployments", obj):
            return
        changes = convert.status_changes(obj.get("status"), wanted)
        if changes and self.patch_status("deployments", ED, obj, changes):
            log.info("status of %s: %s", object_key(obj), json.dumps(changes, sort_keys=True)[:2000])

    def patch_status(self, informer: str, kind: str, obj: dict[str, Any], changes: Mapping[str, Any]) -> bool:
        """Patch a hub object's status; False when it is gone. A placement pass reads a snapshot and then spends
        time writing to spokes, so the object may have been deleted since: skip it once the watch said so,
        and take the server's 404 (deleted between that check and the patch) as the same news, not as a
        failed reconcile."""
        meta = obj["metadata"]
        watching = self.informers.get(informer)
        if watching is None or watching.holds(obj):
            try:
                written = self.hub.patch_status(kind, meta["name"], meta.get("namespace"), changes)
                self._remember(informer, obj, written)
                return True
            except KubeError as exc:
                if exc.status != 404:
                    raise
        log.info("%s %s was deleted since it was read; its status is not written", kind, object_key(obj))
        return False

    def _remember(self, informer: str, obj: Mapping[str, Any], written: Any) -> None:
        """Keep the version of a status write until a view of the object shows it (`settled` drops it then;
        an object deleted before that leaves one entry, until the hub process ends)."""
        version = str(((written or {}).get("metadata") or {}).get("resourceVersion") or "") \
            if isinstance(written, Mapping) else ""
        if version:
            self._written[(informer, object_key(obj))] = version
