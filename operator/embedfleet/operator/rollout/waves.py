"""The hub's side of a rollout: which revision each cluster should run, wave by wave, and when to roll back.
Pure: the hub's placement reconcile (hub/placing.py) reads the spokes' reports, calls these functions and
writes what they say.

Three decisions live here:

- **Revision bookkeeping** (`book`): a spec whose identity (``embedfleet.compat.identity``) differs from
  the hub's current revision opens ``rN+1`` in the hub's ``status.revisions``; the hub names revisions, the
  spokes keep the names (the copy's ``embedfleet.dev/revision`` annotation).
- **The wave plan** (`plan`): the clusters a deployment is placed on, split by ``spec.rollout.waves``
  (a cluster is in the first wave whose regions, clusters or clusterSelector match it); clusters in no wave
  form a last wave; no waves: one wave of every cluster.
- **The step** (`step`): from each cluster's report (the revision it runs, Available, RolloutBlocked,
  Degraded, error rate), the wave in progress and the time, the next state: stay, start the next wave (once
  the current one has been healthy for its soakSeconds), finish, or roll back (more failures in a wave than
  its maxFailures: every cluster gets the old revision back). `targets` then says which revision each
  cluster should run. A step applied twice at the same moment changes nothing the second time.

Why a soak clock in memory: the moment a wave became healthy is not a field of ``status.rollout`` (a
timestamp written each time health flips would be churn); a hub that restarts starts the soak again, which
errs on the safe side.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from embedfleet.compat.identity import IDENTITY_FIELDS, hash_identity, identity
from embedfleet.operator.crd import naming

#: On a spoke copy: the hub's name for the revision this copy describes (the spoke names its revision so),
#: and the vector space the hub recorded for it (so every cluster names one revision's space alike,
#: whatever its own history).
REVISION_ANNOTATION = naming.REVISION_ANNOTATION
VECTOR_SPACE_ANNOTATION = naming.VECTOR_SPACE_ANNOTATION
#: A moved cluster must report the new revision within gateTimeoutSeconds plus this: the spoke's own gate
#: times out first and says why (RolloutBlocked GateTimeout); the hub's limit is the backstop for a spoke
#: that reports nothing at all (unreachable, or its operator down).
REPORT_GRACE_S = 120.0
#: Most revisions kept in the hub's status (the oldest retired ones go first).
MAX_REVISIONS = 10

# Phases the hub writes (a subset of crd.statuses.RolloutPhase).
IDLE, WAVES, SIDE_BY_SIDE, DONE, ROLLED_BACK = "Idle", "Waves", "SideBySide", "Done", "RolledBack"


# ---------------------------------------------------------------- revisions


def _number(name: str) -> int:
    match = re.fullmatch(r"r(\d+)", name or "")
    return int(match.group(1)) if match else 0


def by_name(revisions: Iterable[Mapping[str, Any]], name: str | None) -> dict[str, Any] | None:
    for rev in revisions:
        if rev.get("name") == name:
            return dict(rev)
    return None


def book(revisions: Sequence[Mapping[str, Any]], current: str | None, fields: Mapping[str, Any], breaking: bool,
         stamp: str) -> tuple[list[dict[str, Any]], str, str]:
    """(the hub's revisions, its current revision, the revision the spec asks for).

    The first spec opens ``r1`` (Serving, its own vector space). A spec whose identity hash equals the
    current revision's asks for nothing new; one that equals the newest revision (a rollout under way, or
    one rolled back) asks for that one again; any other opens ``rN+1``: a Candidate in the current
    revision's vector space (compatible) or a new space named after it (breaking). A newer spec supersedes
    a revision still rolling out: that one is Retired (its clusters go back to the current one, then on)."""
    revs = [dict(r) for r in revisions]
    wanted = hash_identity(dict(fields))
    record = {k: fields.get(k) for k in IDENTITY_FIELDS}
    if not revs or by_name(revs, current) is None:
        name = f"r{max([_number(r.get('name', '')) for r in revs] + [0]) + 1}"
        revs.append(_revision(name, wanted, record, name, "Serving", stamp))
        return revs, name, name
    cur = by_name(revs, current)
    assert cur is not None
    if cur.get("hash") == wanted:
        return revs, str(current), str(current)
    newest = revs[-1]
    if newest.get("hash") == wanted and newest.get("name") != current:
        return revs, str(current), str(newest["name"])
    for rev in revs:
        if rev.get("state") in ("Candidate", "SideBySide"):
            rev["state"] = "Retired"
    name = f"r{max(_number(r.get('name', '')) for r in revs) + 1}"
    space = name if breaking else str(cur.get("vectorSpace") or current)
    revs.append(_revision(name, wanted, record, space, "Candidate", stamp))
    retired = [r for r in revs if r.get("state") == "Retired"]
    while len(revs) > MAX_REVISIONS and retired:
        revs.remove(retired.pop(0))
    return revs, str(current), name


def _revision(name: str, hash_: str, record: Mapping[str, Any], space: str, state: str,
              stamp: str) -> dict[str, Any]:
    out = {"name": name, "hash": hash_, **{k: v for k, v in record.items() if v is not None},
           "vectorSpace": space, "state": state, "createdAt": stamp}
    return out


def with_states(revisions: Sequence[Mapping[str, Any]], states: Mapping[str, str]) -> list[dict[str, Any]]:
    """The revisions with the given names set to the given states."""
    return [{**r, "state": states.get(str(r.get("name")), r.get("state"))} for r in revisions]


def pin(revision: Mapping[str, Any], query_revision: str | None) -> dict[str, Any]:
    """What a spoke copy carries for the revision its cluster should run: the identity fields in the spec's
    shape, the revision's name and, for a breaking rollout, the query revision the hub decided."""
    return {
        "name": revision["name"],
        "model": {"source": revision.get("source"), "revision": revision.get("modelRevision"),
                  "digest": revision.get("digest")},
        "runtime": {"dtype": revision.get("dtype"), "quantization": revision.get("quantization"),
                    "engine": revision.get("engine")},
        "queryRevision": query_revision,
        "vectorSpace": revision.get("vectorSpace"),
    }


def apply_pin(spec: dict[str, Any], annotations: dict[str, str], pinned: Mapping[str, Any]) -> None:
    """Writes a `pin` into a copy's spec and annotations (fields with no value are left out, so the hub's
    last-applied record removes them from the copy)."""
    model = {k: v for k, v in dict(spec.get("model") or {}).items() if k not in ("source", "revision", "digest")}
    model.update({k: v for k, v in pinned["model"].items() if v is not None})
    spec["model"] = model
    runtime = {k: v for k, v in dict(spec.get("runtime") or {}).items()
               if k not in ("dtype", "quantization", "engine")}
    runtime.update({k: v for k, v in pinned["runtime"].items() if v is not None})
    spec["runtime"] = runtime
    rollout = {k: v for k, v in dict(spec.get("rollout") or {}).items() if k not in ("queryRevision", "waves")}
    if pinned.get("queryRevision"):
        rollout["queryRevision"] = pinned["queryRevision"]
    if rollout:
        spec["rollout"] = rollout
    else:
        spec.pop("rollout", None)
    annotations[REVISION_ANNOTATION] = str(pinned["name"])
    if pinned.get("vectorSpace"):
        annotations[VECTOR_SPACE_ANNOTATION] = str(pinned["vectorSpace"])


# ---------------------------------------------------------------- the wave plan


@dataclass(frozen=True)
class Wave:
    name: str
    clusters: tuple[str, ...]
    max_failures: int = 0
    soak_seconds: float = 60.0


@dataclass(frozen=True)
class Member:
    """What a wave's selectors look at: a FleetCluster's region and labels."""

    region: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


def _matches(wave: Any, name: str, member: Member) -> bool:
    selector = dict(wave.cluster_selector or {})
    by_labels = bool(selector) and all(member.labels.get(k) == v for k, v in selector.items())
    return name in wave.clusters or member.region in wave.regions or by_labels


def plan(waves: Sequence[Any], members: Mapping[str, Member]) -> list[Wave]:
    """The waves (crd RolloutWave objects) over ``members`` (the clusters the deployment is placed on),
    each cluster in the first wave that matches it; the rest in a last wave (soak 0: nothing follows it).
    A wave may be empty (no placed cluster matches it); it then passes at once."""
    if not waves:
        return [Wave("all", tuple(sorted(members)), 0, 0.0)]
    left = set(members)
    out: list[Wave] = []
    for i, wave in enumerate(waves):
        picked = tuple(sorted(n for n in left if _matches(wave, n, members[n])))
        left -= set(picked)
        out.append(Wave(wave.name or f"wave-{i + 1}", picked, int(wave.max_failures), float(wave.soak_seconds)))
    if left:
        out.append(Wave("rest", tuple(sorted(left)), 0, 0.0))
    return out


# ---------------------------------------------------------------- the step


@dataclass(frozen=True)
class Report:
    """What one cluster's copy reports (status of the spoke's EmbeddingDeployment); None: not known."""

    current: str | None = None  # status.currentRevision
    live: frozenset[str] = frozenset()  # revisions it serves (current and side by side)
    available: bool | None = None
    blocked: str | None = None  # RolloutBlocked=True: its reason and message
    degraded: str | None = None  # Degraded=True for ProbeDrift: its message
    error_rate: float | None = None


@dataclass(frozen=True)
class Rollout:
    """The hub's rollout of one deployment: ``old`` is the revision being replaced (the hub's current),
    ``new`` the one rolled out (equal: nothing under way)."""

    old: str
    new: str
    phase: str = IDLE
    wave: int = 0
    wave_started: float | None = None
    healthy_since: float | None = None  # the soak clock of the wave in progress
    failures: tuple[tuple[str, str], ...] = ()  # (cluster, why) that caused a rollback
    message: str = ""


@dataclass(frozen=True)
class Limits:
    max_error_rate: float = 0.05
    report_timeout: float = 600.0  # a moved cluster must report the new revision within this
    breaking: bool = False


def _moved(rollout: Rollout, waves: Sequence[Wave]) -> set[str]:
    if rollout.phase in (WAVES, SIDE_BY_SIDE, DONE) and rollout.new != rollout.old:
        last = rollout.wave if rollout.phase == WAVES else len(waves) - 1
        return {c for w in waves[:last + 1] for c in w.clusters}
    return set()


def targets(rollout: Rollout, waves: Sequence[Wave]) -> dict[str, str]:
    """cluster -> the revision it should run: the new one for the waves started so far (all of them once
    done), the old one everywhere else and everywhere after a rollback."""
    moved = _moved(rollout, waves)
    return {c: rollout.new if c in moved else rollout.old for w in waves for c in w.clusters}


def runs_new(report: Report, new: str, breaking: bool) -> bool:
    return report.current == new or (breaking and new in report.live)


def failure(report: Report, new: str, limits: Limits, waited: float | None) -> str | None:
    """Why a cluster that was sent the new revision fails its wave, or None. ``waited``: seconds since its
    wave started (it must report the new revision within ``limits.report_timeout``)."""
    if report.blocked:
        return f"RolloutBlocked: {report.blocked}"
    if report.error_rate is not None and report.error_rate > limits.max_error_rate:
        return f"error rate {report.error_rate:.3f} above {limits.max_error_rate:g}"
    if runs_new(report, new, limits.breaking):
        if report.available is False:
            return f"Available=False on {new}"
        if report.degraded:
            return f"Degraded: {report.degraded}"
        return None
    if waited is not None and waited > limits.report_timeout:
        return f"did not report {new} within {limits.report_timeout:g}s"
    return None


def _healthy(report: Report, new: str, limits: Limits) -> bool:
    return runs_new(report, new, limits.breaking) and report.available is True


def _once(rollout: Rollout, waves: Sequence[Wave], reports: Mapping[str, Report], now: float,
          limits: Limits) -> Rollout:
    if rollout.new == rollout.old:
        return rollout if rollout.phase in (IDLE, DONE) else replace(
            rollout, phase=DONE, wave=0, wave_started=None, healthy_since=None, failures=(),
            message=f"{rollout.new} serving on every cluster")
    if rollout.phase in (ROLLED_BACK, DONE):  # done: the hub makes the new revision its current one
        return rollout
    if rollout.phase not in (WAVES, SIDE_BY_SIDE):  # a new revision: its first wave starts
        return replace(rollout, phase=WAVES, wave=0, wave_started=now, healthy_since=None, failures=(),
                       message=f"{rollout.new}: wave 1/{len(waves)} ({waves[0].name if waves else '-'})")
    current = min(rollout.wave, len(waves) - 1) if rollout.phase == WAVES else len(waves) - 1
    failed: list[tuple[str, str]] = []
    for index, wave in enumerate(waves[:current + 1]):
        waited = now - rollout.wave_started if index == current and rollout.wave_started is not None else None
        if rollout.phase != WAVES:
            waited = None
        why = {c: failure(reports.get(c, Report()), rollout.new, limits, waited) for c in wave.clusters}
        bad = sorted((c, w) for c, w in why.items() if w)
        if len(bad) > wave.max_failures:
            failed += bad
    if failed:
        names = ", ".join(f"{c} ({w})" for c, w in failed)
        return replace(rollout, phase=ROLLED_BACK, healthy_since=None, failures=tuple(failed),
                       message=f"{rollout.new} rolled back to {rollout.old}: {names}")
    if rollout.phase == SIDE_BY_SIDE:
        return rollout
    wave = waves[current]
    pending = [c for c in wave.clusters
               if not _healthy(reports.get(c, Report()), rollout.new, limits)
               and not failure(reports.get(c, Report()), rollout.new, limits, None)]
    if pending:
        return replace(rollout, healthy_since=None) if rollout.healthy_since is not None else rollout
    since = rollout.healthy_since if rollout.healthy_since is not None else now
    if wave.clusters and now - since < wave.soak_seconds:
        return rollout if rollout.healthy_since == since else replace(rollout, healthy_since=since)
    if current + 1 < len(waves):
        nxt = waves[current + 1]
        return replace(rollout, wave=current + 1, wave_started=now, healthy_since=None,
                       message=f"{rollout.new}: wave {current + 2}/{len(waves)} ({nxt.name})")
    if limits.breaking:
        return replace(rollout, phase=SIDE_BY_SIDE, healthy_since=None,
                       message=f"{rollout.new} side by side on every cluster; {rollout.old} answers the bare "
                       f"name until spec.rollout.queryRevision is {rollout.new}")
    return replace(rollout, phase=DONE, healthy_since=None,
                   message=f"{rollout.new} serving on every cluster")


def step(rollout: Rollout, waves: Sequence[Wave], reports: Mapping[str, Report], now: float,
         limits: Limits) -> Rollout:
    """The rollout after looking at the reports at ``now`` (repeated until nothing changes, so empty waves
    and waves with soak 0 pass in one call, and a second call at the same moment changes nothing)."""
    if not waves:
        waves = [Wave("all", (), 0, 0.0)]
    for _ in range(3 * len(waves) + 4):
        nxt = _once(rollout, waves, reports, now, limits)
        if nxt == rollout:
            return rollout
        rollout = nxt
    return rollout


def flipped(rollout: Rollout, waves: Sequence[Wave], reports: Mapping[str, Report],
            query_revision: str | None) -> bool:
    """A breaking rollout side by side everywhere whose query revision the user set to the new one, and
    every cluster reports it current: the new revision is the hub's current one."""
    return (rollout.phase == SIDE_BY_SIDE and query_revision == rollout.new
            and all(reports.get(c, Report()).current == rollout.new for w in waves for c in w.clusters))


def query_for(rollout: Rollout, query_revision: str | None) -> str | None:
    """The queryRevision a breaking rollout's copies carry: the user's, only once every wave runs the new
    revision side by side (before that a cluster could flip while another has no such revision)."""
    if rollout.phase == SIDE_BY_SIDE and query_revision == rollout.new:
        return query_revision
    return None


def status_of(rollout: Rollout, waves: Sequence[Wave], stamp_of: Any) -> dict[str, Any]:
    """``status.rollout`` (camelCase); ``stamp_of`` turns a wall time into the status's timestamp form."""
    out: dict[str, Any] = {"phase": rollout.phase, "revision": rollout.new, "message": rollout.message[:4096],
                           "wave": None, "wavesTotal": None, "waveStartedAt": None}
    if rollout.phase in (WAVES, SIDE_BY_SIDE, ROLLED_BACK):
        out["wave"] = rollout.wave
        out["wavesTotal"] = len(waves)
        out["waveStartedAt"] = stamp_of(rollout.wave_started) if rollout.wave_started is not None else None
    return out


# ---------------------------------------------------------------- reading and deciding (for the hub)


def _condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return {}


def report_of(copy: Mapping[str, Any] | None, new: str) -> Report:
    """What a spoke's copy reports about revision ``new``. Its conditions count only once the spoke has
    judged the spec the hub last wrote (observedGeneration) for that revision (the copy's annotation): a
    RolloutBlocked left from an older attempt is not this revision's failure."""
    if not copy:
        return Report()
    meta = copy.get("metadata") or {}
    status = copy.get("status") or {}
    current = status.get("currentRevision")
    live = frozenset(str(r.get("name")) for r in status.get("revisions") or []
                     if r.get("state") in ("Serving", "SideBySide"))
    judged = ((meta.get("annotations") or {}).get(REVISION_ANNOTATION) == new
              and status.get("observedGeneration") is not None
              and int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0))
    if not judged:
        return Report(current=current, live=live)
    available = _condition(status, "Available").get("status")
    blocked_c = _condition(status, "RolloutBlocked")
    blocked = None
    if blocked_c.get("status") == "True":
        blocked = f"{blocked_c.get('reason') or 'Blocked'}: {blocked_c.get('message') or ''}".strip(": ")
    else:
        rev = by_name(status.get("revisions") or [], new)
        if rev is not None and rev.get("state") == "Blocked":
            blocked = f"{new} Blocked on the spoke: {((rev.get('gate') or {}).get('message')) or ''}".strip(": ")
    degraded_c = _condition(status, "Degraded")
    degraded = (str(degraded_c.get("message") or "ProbeDrift")
                if degraded_c.get("status") == "True" and degraded_c.get("reason") == "ProbeDrift" else None)
    return Report(current=current, live=live, available=None if available is None else available == "True",
                  blocked=blocked, degraded=degraded)


def from_status(status: Mapping[str, Any], current: str, wanted: str, wave_started: float | None,
                healthy_since: float | None) -> Rollout:
    """The rollout as the hub object's status (and the loop's soak clock) records it."""
    recorded = dict(status.get("rollout") or {})
    if recorded.get("revision") == wanted and recorded.get("phase") in (WAVES, SIDE_BY_SIDE, ROLLED_BACK, DONE):
        return Rollout(current, wanted, str(recorded["phase"]), int(recorded.get("wave") or 0), wave_started,
                       healthy_since, message=str(recorded.get("message") or ""))
    if wanted == current and (not recorded or recorded.get("phase") == IDLE):
        return Rollout(current, wanted, IDLE, message=str(recorded.get("message") or ""))
    return Rollout(current, wanted, "Pending")


@dataclass(frozen=True)
class Decision:
    """What the hub does this round about one deployment's revision."""

    rollout: Rollout
    waves: list[Wave]
    pins: dict[str, dict[str, Any]]  # cluster -> `pin` of the revision it should run
    status: dict[str, Any]  # revisions, currentRevision, queryVectorSpace, rollout
    blocked: tuple[bool, str, str] | None  # RolloutBlocked (status, reason, message); None: leave it out


def decide(status: Mapping[str, Any], spec: Any, members: Mapping[str, Member], copies: Mapping[str, Any],
           now: float, healthy_since: float | None, stamp_of: Any, parse: Any) -> Decision:
    """One round's rollout decision for a hub object: book the spec's revision, plan the waves over the
    placed clusters (``members``), step with the reports the copies give, and say what each cluster runs
    and what the hub's status shows. ``stamp_of``/``parse``: wall seconds <-> status timestamps."""
    breaking = spec.compatibility == "breaking"
    revisions, current, wanted = book(status.get("revisions") or [], status.get("currentRevision"),
                                      identity(spec), breaking, stamp_of(now))
    waves = plan(spec.rollout.waves, members)
    recorded = dict(status.get("rollout") or {})
    started = parse(recorded.get("waveStartedAt")) if recorded.get("revision") == wanted else None
    rollout = from_status(status, current, wanted, started, healthy_since)
    limits = Limits(spec.rollout.max_error_rate, spec.rollout.gate_timeout_seconds + REPORT_GRACE_S, breaking)
    reports = {c: report_of(copies.get(c), wanted) for c in members}
    rollout = step(rollout, waves, reports, now, limits)
    query = spec.rollout.query_revision
    if flipped(rollout, waves, reports, query):
        rollout = replace(rollout, phase=DONE, message=f"{wanted} answers the bare name on every cluster")
    if rollout.phase == DONE and rollout.new != current:  # the new revision is the hub's current one
        revisions = with_states(revisions, {current: "Retired", wanted: "Serving"})
        current = wanted
        rollout = replace(rollout, old=wanted)
    elif rollout.phase == ROLLED_BACK:
        revisions = with_states(revisions, {wanted: "Blocked"})
    elif rollout.phase == SIDE_BY_SIDE:
        revisions = with_states(revisions, {wanted: "SideBySide"})
    cur = by_name(revisions, current) or {}
    query_pin = query_for(rollout, query) if breaking else None
    pins = {c: pin(by_name(revisions, rev) or cur, query_pin) for c, rev in targets(rollout, waves).items()}
    out = {"revisions": revisions, "currentRevision": current,
           "queryVectorSpace": cur.get("vectorSpace") or current,
           "rollout": status_of(rollout, waves, stamp_of)}
    blocked: tuple[bool, str, str] | None = None
    if rollout.phase == ROLLED_BACK:
        blocked = (True, "RolledBack", rollout.message)
    elif rollout.phase != IDLE or _condition(status, "RolloutBlocked"):
        blocked = (False, "Progressing" if rollout.phase in (WAVES, SIDE_BY_SIDE) else "Healthy", rollout.message)
    return Decision(rollout, waves, pins, out, blocked)
