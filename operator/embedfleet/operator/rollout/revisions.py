"""Revisions of one EmbeddingDeployment and the drift gate between them: spec + recorded status +
observations -> what status should say and which revisions run. Pure: no I/O, no clock (``now`` is given).

The model (docs/rollouts.md, "Operator: revisions, the drift gate and breaking changes"):

- every distinct identity (embedfleet.compat.identity: source, model revision, digest, dtype, quantization,
  engine) the spec has named is a revision ``rN`` recorded in ``status.revisions``; the spec's identity is
  the *target*; ``status.currentRevision`` is the one answering the bare model name, and
  ``status.queryVectorSpace`` its vector space. Names come from the hub (the spoke copy's
  ``embedfleet.dev/revision`` annotation) or, standalone, are the next unused ``rN``;
- a **compatible** target is a ``Candidate`` (one pod, vector space ``ungated``) until the gate has read
  the current and the candidate's probe outputs: pass -> it becomes current in the current's vector space
  (``Serving``), the old one ``Draining`` until the primary Deployment runs the new one, then ``Retired``;
  fail -> ``Blocked`` (RolloutBlocked=True, DriftTooHigh) and traffic stays; not gated within
  ``gateTimeoutSeconds`` -> ``Blocked`` (GateTimeout);
- a **breaking** target is ``SideBySide`` in a vector space of its own (its name) until
  ``spec.rollout.queryRevision`` names it and one of its pods is ready; then it becomes current (queries
  flip to its space at once, its side Deployment keeps answering while the primary rolls), and the old one
  drains;
- a spec back at the current revision's identity removes whatever else was live and clears RolloutBlocked.

`decide` is idempotent: fed its own output with the same observations it changes nothing, so the handler
writes status only on a real transition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from embedfleet.compat.gate import GateResult, ProbeOutputs, compare
from embedfleet.compat.identity import hash_identity, identity
from embedfleet.compat.names import revision_number, with_revision
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.crd.naming import REVISION_LABEL

#: The vector space label of a candidate the gate has not passed: no Service selecting a real space
#: ever sends it traffic.
UNGATED = "ungated"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
#: Revision states whose objects run (besides the current revision, which the primary Deployment runs).
LIVE_SIDE = ("Candidate", "SideBySide")
IDENTITY_KEYS = ("source", "modelRevision", "digest", "dtype", "quantization", "engine")
#: RolloutBlocked reasons.
DRIFT_TOO_HIGH = "DriftTooHigh"
GATE_TIMEOUT = "GateTimeout"
TIMEOUT_PREFIX = "not gated within gateTimeoutSeconds"


@dataclass(frozen=True)
class ProbeRead:
    """A revision's probe as one of its pods answered GET /v1/models/{m}/probe, or why it could not be read."""

    body: Mapping[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class Observed:
    """What the handler saw of the live objects.

    ``ready``: ready replicas of each revision's Deployment (the current revision's are the primary's);
    ``primary_revision``: the revision the primary Deployment runs once it is fully rolled out and ready
    (None while a roll is in progress); ``probes``: the probe reads of the revisions `Plan.probe_wanted`
    asked for."""

    now: datetime
    ready: Mapping[str, int] = field(default_factory=dict)
    primary_revision: str | None = None
    probes: Mapping[str, ProbeRead] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """One revision that must run: ``primary`` is the Deployment ``<name>`` (replicas: the autoscaler's),
    the others ``<name>-rN`` with ``replicas`` pods."""

    revision: str
    identity: Mapping[str, Any]
    vector_space: str
    primary: bool
    replicas: int | None = None


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    revisions: list[dict[str, Any]]
    current_revision: str
    query_vector_space: str
    rollout: dict[str, Any]
    blocked: dict[str, Any]
    runs: list[Run]
    probe_wanted: list[str]
    events: list[Event]

    def status_fields(self) -> dict[str, Any]:
        """The status keys this plan owns, in wire format."""
        return {"revisions": self.revisions, "currentRevision": self.current_revision,
                "queryVectorSpace": self.query_vector_space, "rollout": self.rollout}

    def by_name(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.revisions if r["name"] == name), None)


def format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(TIME_FORMAT)


def _parse_time(text: str | None) -> datetime | None:
    try:
        return datetime.strptime(text or "", TIME_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        return None


def _clean(record: Mapping[str, Any]) -> dict[str, Any]:
    """No None values: the API server drops them, and a record with them would differ from what it stored
    (a write on every converge)."""
    out = {}
    for key, value in record.items():
        if value is None:
            continue
        out[key] = _clean(value) if isinstance(value, Mapping) else value
    return out


def _next_name(revisions: Sequence[Mapping[str, Any]]) -> str:
    numbers = [revision_number(r["name"]) for r in revisions if _is_revision(r.get("name"))]
    return f"r{max(numbers, default=0) + 1}"


def _is_revision(name: Any) -> bool:
    try:
        revision_number(str(name))
    except ValueError:
        return False
    return True


def _record(name: str, ident: Mapping[str, Any], digest: str, vector_space: str, state: str, now: str
            ) -> dict[str, Any]:
    return _clean({"name": name, "hash": digest, **{k: ident.get(k) for k in IDENTITY_KEYS},
                   "vectorSpace": vector_space, "state": state, "createdAt": now})


def _gate_status(result: GateResult) -> dict[str, Any]:
    return _clean(result.as_status())


def decide(
    name: str,
    spec: EmbeddingDeploymentSpec,
    status: Mapping[str, Any] | None,
    observed: Observed,
    *,
    hub_revision: str | None = None,
    hub_vector_space: str | None = None,
) -> Plan:
    """The next revisions/currentRevision/queryVectorSpace/rollout, the RolloutBlocked condition, the runs
    and the events of the transitions made. ``hub_revision`` (and ``hub_vector_space``) are the spoke
    copy's annotations: the hub's name for the spec's identity (and the vector space it recorded)."""
    status = status or {}
    now = format_time(observed.now)
    revs = [_clean(r) for r in status.get("revisions") or [] if _is_revision(r.get("name"))]
    before = {r["name"]: dict(r) for r in revs}
    served = spec.model.served_model_name or name
    ident = identity(spec)
    digest = hash_identity(ident)
    events: list[Event] = []
    rollout_spec = spec.rollout

    def find(rev_name: str | None) -> dict[str, Any] | None:
        return next((r for r in revs if r["name"] == rev_name), None)

    # -- the target: the revision the spec names
    named = find(hub_revision) if hub_revision and _is_revision(hub_revision) else None
    if hub_revision and _is_revision(hub_revision) and (
            named is None or named["hash"] == digest or named["name"] != status.get("currentRevision")):
        target = named
        if target is not None and target["hash"] != digest:  # the hub re-used a name: its word stands
            revs.remove(target)
            target = None
        name_for_new = hub_revision
    else:  # standalone, or the hub's name is this spoke's current revision with another identity (a
        # spoke that ran before it joined): never replace what serves; the change gets a name of its own
        current_record = find(status.get("currentRevision"))
        matches = [r for r in revs if r["hash"] == digest]
        target = current_record if current_record in matches else (matches[-1] if matches else None)
        name_for_new = _next_name(revs)
    if target is None:
        target = _record(name_for_new, ident, digest, "", "Retired", now)  # a fresh record, revived below
        target.pop("vectorSpace")
        revs.append(target)

    # -- the current revision; the first one (or a status from before revisions) is the target itself
    current = find(status.get("currentRevision"))
    if current is None:
        current = target
        own = current.get("vectorSpace")
        current.update(state="Serving", vectorSpace=hub_vector_space or (own if own and own != UNGATED
                                                                          else current["name"]))
        for other in revs:
            if other is not current and other["state"] != "Retired":
                other["state"] = "Retired"

    # -- everything neither current nor the target stops
    for other in revs:
        if other is current or other is target:
            continue
        if other["state"] in (*LIVE_SIDE, "Blocked"):
            other["state"] = "Retired"

    if target is not current:
        breaking = spec.compatibility == "breaking"
        if target["state"] in ("Retired", "Draining", "Serving"):  # new, or named again: starts over
            target.update(state="SideBySide" if breaking else "Candidate", createdAt=now)
            target.pop("gate", None)
            target.pop("fingerprint", None)
            if breaking:
                own = target.get("vectorSpace")
                target["vectorSpace"] = hub_vector_space or (own if own and own != UNGATED else target["name"])
            else:
                target["vectorSpace"] = UNGATED
            how = (f"serving {with_revision(served, target['name'])} side by side in vector space "
                   f"{target['vectorSpace']}" if breaking else f"gating it against {current['name']}")
            events.append(Event("Normal", "RolloutStarted", f"revision {target['name']} ({_describe(target)}): {how}"))
        elif breaking and target["state"] in ("Candidate", "Blocked"):  # the user declared a re-index
            target.update(state="SideBySide", vectorSpace=hub_vector_space or target["name"], createdAt=now)
            events.append(Event("Normal", "RolloutStarted",
                                f"revision {target['name']} is breaking now: serving "
                                f"{with_revision(served, target['name'])} side by side in vector space "
                                f"{target['vectorSpace']}"))

    probe_wanted: list[str] = []
    waiting = ""
    if target is not current and target["state"] == "Candidate":
        waiting, promoted = _gate(target, current, spec, observed, probe_wanted, events)
        if promoted:
            current["state"] = "Draining"
            current = target
    flip_wanted = target is not current and target["state"] == "SideBySide" \
        and rollout_spec.query_revision == target["name"]
    if flip_wanted and observed.ready.get(target["name"], 0) == 0:
        # Flipping to a space no ready pod serves would leave the bare name with no endpoint at all.
        waiting = f"waiting for a ready {target['name']} pod before flipping queries to it"
    elif flip_wanted:
        target["state"] = "Serving"
        current["state"] = "Draining"
        events.append(Event("Normal", "QueriesFlipped",
                            f"the bare model name {served} now answers from {target['name']} (vector space "
                            f"{target['vectorSpace']}); {current['name']} drains"))
        current = target

    # -- draining revisions retire once the primary Deployment runs the current one
    for other in revs:
        if other is not current and other["state"] == "Draining" and observed.primary_revision == current["name"]:
            other["state"] = "Retired"
    current["state"] = "Serving"

    # -- fingerprints of serving revisions, read once
    for rev in (current, target):
        if rev["state"] in ("Serving", "SideBySide") and not rev.get("fingerprint"):
            read = observed.probes.get(rev["name"])
            if read is not None and read.body is not None and read.body.get("fingerprint"):
                rev["fingerprint"] = str(read.body["fingerprint"])
            elif rev["name"] not in probe_wanted and observed.ready.get(rev["name"], 0) > 0:
                probe_wanted.append(rev["name"])

    for rev in revs:
        rev["servedNames"] = _served_names(rev, current, served)
    revs = [_clean(r) for r in revs]
    revs.sort(key=lambda r: revision_number(r["name"]))
    current = next(r for r in revs if r["name"] == current["name"])
    target = next(r for r in revs if r["name"] == target["name"])

    runs = _runs(spec, revs, current, target, observed)
    rollout = _rollout(status.get("rollout") or {}, revs, current, target, served, waiting)
    blocked = _blocked(target, current["name"])
    for rev in revs:
        old = before.get(rev["name"])
        if rev["state"] == "Blocked" and (old is None or old.get("state") != "Blocked"):
            events.append(Event("Warning", "RolloutBlocked", blocked["message"]))
    return Plan(revs, current["name"], current["vectorSpace"], rollout, blocked, runs, probe_wanted, events)


def _describe(rev: Mapping[str, Any]) -> str:
    parts = [str(rev.get("source"))]
    if rev.get("modelRevision"):
        parts.append(f"revision {rev['modelRevision']}")
    if rev.get("digest"):
        parts.append(str(rev["digest"])[:19])
    parts.append(f"{rev.get('dtype')}/{rev.get('quantization')}/{rev.get('engine')}")
    return ", ".join(parts)


def _gate(target: dict[str, Any], current: dict[str, Any], spec: EmbeddingDeploymentSpec, observed: Observed,
          probe_wanted: list[str], events: list[Event]) -> tuple[str, bool]:
    """Gate a Candidate: (what it waits for, promoted?). Sets the target's state, gate and fingerprints."""
    timeout = spec.rollout.gate_timeout_seconds
    started = _parse_time(target.get("createdAt")) or observed.now
    elapsed = (observed.now - started).total_seconds()
    waiting = f"waiting for a ready {target['name']} pod"
    if observed.ready.get(target["name"], 0) > 0:
        probe_wanted.extend([current["name"], target["name"]])
        old, new = observed.probes.get(current["name"]), observed.probes.get(target["name"])
        if old is not None and new is not None and old.body is not None and new.body is not None:
            try:
                result = compare(ProbeOutputs.from_json(dict(old.body)), ProbeOutputs.from_json(dict(new.body)),
                                 spec.rollout.min_cosine)
            except (KeyError, TypeError, ValueError) as exc:
                result = GateResult(False, None, None, False, [f"unreadable probe answer: {exc}"])
            target["gate"] = _gate_status(result)
            for rev, read in ((current, old), (target, new)):
                if read.body.get("fingerprint"):
                    rev["fingerprint"] = str(read.body["fingerprint"])
            if result.passed:
                target.update(state="Serving", vectorSpace=current["vectorSpace"])
                events.append(Event("Normal", "RevisionPromoted",
                                    f"revision {target['name']} passed the drift gate against {current['name']} "
                                    f"({result.message}); it serves vector space {current['vectorSpace']} now"))
                return "", True
            target["state"] = "Blocked"
            return "", False
        errors = [f"{rev}: {read.error}" for rev, read in ((current["name"], old), (target["name"], new))
                  if read is not None and read.error]
        waiting = "waiting for probes" + (f" ({'; '.join(errors)})" if errors else "")
    if elapsed >= timeout:
        target["state"] = "Blocked"
        target["gate"] = {"passed": False, "message": f"{TIMEOUT_PREFIX}={timeout:g}: {waiting}"}
        return "", False
    return waiting, False


def _served_names(rev: Mapping[str, Any], current: Mapping[str, Any], served: str) -> list[str]:
    if rev["name"] == current["name"]:
        return [served, with_revision(served, rev["name"])]
    if rev["state"] in LIVE_SIDE:
        return [with_revision(served, rev["name"])]
    return []


def side_replicas(spec: EmbeddingDeploymentSpec) -> int:
    """Pods of a side-by-side revision: autoscaling.minReplicas, at least one."""
    return max(1, spec.autoscaling.min_replicas)


def _identity_of(rev: Mapping[str, Any]) -> dict[str, Any]:
    return {k: rev.get(k) for k in IDENTITY_KEYS}


def _runs(spec: EmbeddingDeploymentSpec, revs: list[dict[str, Any]], current: dict[str, Any],
          target: dict[str, Any], observed: Observed) -> list[Run]:
    runs = [Run(current["name"], _identity_of(current), current["vectorSpace"], True)]
    if target is not current and target["state"] == "Candidate":
        runs.append(Run(target["name"], _identity_of(target), UNGATED, False, 1))
    elif target is not current and target["state"] == "SideBySide":
        runs.append(Run(target["name"], _identity_of(target), target["vectorSpace"], False, side_replicas(spec)))
    # After a flip to a new vector space, the side Deployment answers it until the primary has rolled.
    flipped_from = [r for r in revs if r["state"] == "Draining" and r["vectorSpace"] != current["vectorSpace"]]
    if flipped_from and observed.primary_revision != current["name"]:
        runs.append(Run(current["name"], _identity_of(current), current["vectorSpace"], False, side_replicas(spec)))
    return runs


def _rollout(previous: Mapping[str, Any], revs: list[dict[str, Any]], current: dict[str, Any],
             target: dict[str, Any], served: str, waiting: str) -> dict[str, Any]:
    draining = [r["name"] for r in revs if r["state"] == "Draining"]
    if target is not current and target["state"] == "Candidate":
        phase, revision, message = "Gating", target["name"], waiting
    elif target is not current and target["state"] == "Blocked":
        phase, revision = "Blocked", target["name"]
        message = (target.get("gate") or {}).get("message", "")
    elif target is not current and target["state"] == "SideBySide":
        phase, revision = "SideBySide", target["name"]
        message = waiting or (f"{with_revision(served, target['name'])} serves vector space {target['vectorSpace']} "
                              f"beside {current['name']}; set spec.rollout.queryRevision: {target['name']} to "
                              "flip queries")
    elif draining:
        phase, revision = "Promoting", current["name"]
        message = f"the primary Deployment rolls to {current['name']}; {', '.join(draining)} draining"
    else:
        phase, revision, message = "Idle", current["name"], f"{current['name']} serves {served}"
    rev = next(r for r in revs if r["name"] == revision)
    started = previous.get("startedAt") if previous.get("revision") == revision else None
    if phase == "Idle":
        started = None
    return _clean({"phase": phase, "revision": revision, "startedAt": started or (
        rev.get("createdAt") if phase != "Idle" else None), "message": message[:4000]})


def _blocked(target: Mapping[str, Any], current: str) -> dict[str, Any]:
    """The RolloutBlocked condition (no time: status.merge_conditions stamps it). The reason follows from
    the recorded gate: a measurement that failed is DriftTooHigh; none at all, a timeout."""
    if target["state"] != "Blocked":
        return {"type": "RolloutBlocked", "status": "False", "reason": "NotBlocked",
                "message": "no rollout is blocked"}
    gate = target.get("gate") or {}
    timed_out = gate.get("minCosine") is None and gate.get("orderKept") is None and str(
        gate.get("message", "")).startswith(TIMEOUT_PREFIX)
    message = f"revision {target['name']}: {gate.get('message') or 'blocked'}; traffic stays on {current}"
    return {"type": "RolloutBlocked", "status": "True", "reason": GATE_TIMEOUT if timed_out else DRIFT_TOO_HIGH,
            "message": message[:4000]}


def needs_observation(spec: EmbeddingDeploymentSpec, status: Mapping[str, Any] | None,
                      hub_revision: str | None = None) -> bool:
    """Whether `decide` could use pods or probes now: a change in progress, or a serving revision whose
    fingerprint is not known yet. In steady state (False) a converge lists no pods and reads no probe."""
    status = status or {}
    revs = [r for r in status.get("revisions") or [] if _is_revision(r.get("name"))]
    current = next((r for r in revs if r["name"] == status.get("currentRevision")), None)
    if current is None or current.get("hash") != hash_identity(identity(spec)) or not current.get("fingerprint"):
        return True
    if hub_revision and hub_revision != current["name"]:
        return True
    return any(r.get("state") in (*LIVE_SIDE, "Draining") for r in revs)


def recorded_runs(spec: EmbeddingDeploymentSpec, status: Mapping[str, Any] | None) -> tuple[list[Run], str] | None:
    """(runs, query vector space) as status records them, without deciding anything: what an owned
    object's event is compared with. None before status records a current revision."""
    status = status or {}
    revs = [r for r in status.get("revisions") or [] if _is_revision(r.get("name"))]
    current = next((r for r in revs if r["name"] == status.get("currentRevision")), None)
    if current is None:
        return None
    runs = [Run(current["name"], _identity_of(current), current["vectorSpace"], True)]
    for rev in revs:
        if rev["state"] == "Candidate":
            runs.append(Run(rev["name"], _identity_of(rev), UNGATED, False, 1))
        elif rev["state"] == "SideBySide":
            runs.append(Run(rev["name"], _identity_of(rev), rev["vectorSpace"], False, side_replicas(spec)))
    if any(r["state"] == "Draining" and r["vectorSpace"] != current["vectorSpace"] for r in revs):
        runs.append(Run(current["name"], _identity_of(current), current["vectorSpace"], False, side_replicas(spec)))
    return runs, current["vectorSpace"]


def rolled_revision(deployment: Mapping[str, Any] | None) -> str | None:
    """The revision a primary Deployment runs once its roll is complete and every pod is ready (the
    pod template's revision label); None while a roll is in progress or nothing is known."""
    if deployment is None:
        return None
    meta, spec, dep_status = deployment.get("metadata") or {}, deployment.get("spec") or {}, \
        deployment.get("status") or {}
    wanted = int(spec.get("replicas") or 0)
    if int(dep_status.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return None
    counts = [int(dep_status.get(k) or 0) for k in ("replicas", "updatedReplicas", "readyReplicas")]
    if any(count != wanted for count in counts):
        return None
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(REVISION_LABEL)


def poll_wanted(status: Mapping[str, Any] | None, now: datetime, gate_timeout_seconds: float) -> bool:
    """Whether the owner should be converged again soon without an event: a candidate is gated, a
    promotion rolls, or a side-by-side revision's fingerprint is still unread while it is younger than
    the gate timeout (a runtime reported Ready may take a while to answer its probe). The current
    revision's fingerprint is not polled for: the gate reads it, and so does any converge (the periodic
    resync among them), so a fleet of idle deployments whose pods do not answer costs no polling."""
    status = status or {}
    if ((status.get("rollout") or {}).get("phase")) in ("Gating", "Promoting"):
        return True
    for rev in status.get("revisions") or []:
        created = _parse_time(rev.get("createdAt"))
        if rev.get("state") == "SideBySide" and not rev.get("fingerprint") and created is not None and \
                (now - created).total_seconds() < gate_timeout_seconds:
            return True
    return False
