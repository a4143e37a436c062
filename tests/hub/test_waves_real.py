"""Hub waves and rollback on the real test control plane: a hub and two spokes in different regions
(tests/hub/fleet.py), the chart's operator on each, a deployment whose rollout goes wave by wave by region.

Everything is real, the spokes' side included: what each spoke reports (``status.currentRevision``,
``status.revisions``, ``RolloutBlocked``) is what its own operator decides about the copy the hub wrote.
kwok runs no runtimes, so no probe answers on these spokes: a breaking change (no gate: side by side, then
flipped by ``queryRevision``) goes through every wave, and a compatible change is blocked by the spoke's
gate with ``GateTimeout`` (the gate refusing different weights on real runtimes is tested in
tests/operator/test_rollout_real.py, and failing a wave so in tests/hub/test_waves_gate_real.py). Tests in
this module share the fleet and run in file order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.hub.fleet import DIGEST, Fleet, embedding, errors, hub_user, running_fleet, writes
from tests.kube.controlplane import wait_until

REGIONS = {"eu": "eu-west-1", "us": "us-east-1"}
NAME, NS = "search", "ml"
REVISION = "embedfleet.dev/revision"
#: Waves by region; the first soaks long enough for the test to look at the second meanwhile.
ROLLOUT = {"gateTimeoutSeconds": 10,
           "waves": [{"name": "eu-first", "regions": ["eu-west-1"], "soakSeconds": 8},
                     {"name": "us-next", "regions": ["us-east-1"], "soakSeconds": 0}]}
OTHER_WEIGHTS = "sha256:" + "cd" * 32


def _prepare(fleet: Fleet) -> None:
    fleet.namespace(NS)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory.mktemp("waves"), REGIONS, prepare=_prepare) as fleet:
        yield fleet


def _copy(fleet: Fleet, spoke: str) -> dict[str, Any]:
    return fleet.copy(spoke, NAME, NS) or {}


def _revision_of(fleet: Fleet, spoke: str) -> tuple[str | None, str | None, str | None]:
    """(annotation, dtype, digest) of the spoke's copy: which revision the hub told it to run."""
    obj = _copy(fleet, spoke)
    spec = obj.get("spec") or {}
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(REVISION), \
        (spec.get("runtime") or {}).get("dtype"), (spec.get("model") or {}).get("digest")


def _rollout(fleet: Fleet) -> dict[str, Any]:
    return (fleet.hub_object(NAME, NS).get("status") or {}).get("rollout") or {}


def _wait(fleet: Fleet, predicate: Any, what: str, timeout: float = 60) -> Any:
    try:
        return wait_until(predicate, timeout, what, interval=0.3)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nhub status: {json.dumps(fleet.hub_object(NAME, NS).get('status'))}\n"
                             f"copies: eu={_revision_of(fleet, 'eu')} us={_revision_of(fleet, 'us')}\n"
                             f"{fleet.logs()}") from exc


def _spoke_status(fleet: Fleet, spoke: str) -> dict[str, Any]:
    return _copy(fleet, spoke).get("status") or {}


def _spoke_revisions(fleet: Fleet, spoke: str) -> dict[str, str]:
    """name -> state, as the spoke's operator reports its revisions."""
    return {r["name"]: r["state"] for r in _spoke_status(fleet, spoke).get("revisions") or []}


def _told_query_revision(fleet: Fleet, spoke: str, revision: str) -> bool:
    copy_ = _copy(fleet, spoke)
    carried = ((copy_.get("spec") or {}).get("rollout") or {}).get("queryRevision") == revision
    return carried or (copy_.get("status") or {}).get("currentRevision") == revision


def _patch_hub(fleet: Fleet, spec: dict[str, Any]) -> None:
    fleet.hub.kubectl("patch", "embeddingdeployment", NAME, "-n", NS, "--type=merge",
                      "-p", json.dumps({"spec": spec}))


def test_first_revision_is_r1_everywhere(fleet: Fleet) -> None:
    fleet.marks()
    fleet.hub.apply(embedding(NAME, NS, replicas=2, placement={"mode": "ActiveActive", "minRegions": 2},
                              rollout=ROLLOUT))
    fleet.wait_settled(NAME, NS, {"eu": 1, "us": 1})
    for spoke in REGIONS:
        assert _revision_of(fleet, spoke) == ("r1", "float32", DIGEST)
        copy_ = _copy(fleet, spoke)
        assert copy_["metadata"]["annotations"]["embedfleet.dev/vector-space"] == "r1"
        assert "waves" not in (copy_["spec"].get("rollout") or {})  # the hub's own
    status = fleet.hub_object(NAME, NS)["status"]
    assert status["currentRevision"] == "r1" and status["queryVectorSpace"] == "r1"
    assert [(r["name"], r["state"], r["dtype"]) for r in status["revisions"]] == [("r1", "Serving", "float32")]
    assert status["rollout"]["phase"] == "Idle"
    _wait(fleet, lambda: {n: r.get("revision") for n, r in fleet.rows(NAME, NS).items()}
          == {"eu": "r1", "us": "r1"}, "rows showing the revision each spoke reports")


def test_a_breaking_change_goes_wave_by_wave_then_flips(fleet: Fleet) -> None:
    _patch_hub(fleet, {"compatibility": "breaking", "runtime": {"dtype": "bfloat16"}})
    _wait(fleet, lambda: _revision_of(fleet, "eu") == ("r2", "bfloat16", DIGEST), "eu sent r2")
    rollout = _wait(fleet, lambda: _rollout(fleet) if _rollout(fleet).get("revision") == "r2" else None,
                    "the hub's rollout of r2")
    assert (rollout["phase"], rollout["wave"], rollout["wavesTotal"]) == ("Waves", 0, 2), rollout
    assert "eu-first" in rollout["message"]
    status = fleet.hub_object(NAME, NS)["status"]
    assert [(r["name"], r["state"], r["vectorSpace"]) for r in status["revisions"]] == [
        ("r1", "Serving", "r1"), ("r2", "Candidate", "r2")]  # breaking: a vector space of its own
    assert _copy(fleet, "eu")["metadata"]["annotations"]["embedfleet.dev/vector-space"] == "r2"

    # eu's operator runs r2 side by side; while eu soaks (8 s) us keeps r1.
    _wait(fleet, lambda: _spoke_revisions(fleet, "eu").get("r2") == "SideBySide", "eu running r2 side by side")
    assert _revision_of(fleet, "us") == ("r1", "float32", DIGEST)
    assert _rollout(fleet)["wave"] == 0
    assert _spoke_status(fleet, "eu")["currentRevision"] == "r1"  # the bare name stays on r1

    _wait(fleet, lambda: _revision_of(fleet, "us") == ("r2", "bfloat16", DIGEST), "us sent r2 after the soak")
    _wait(fleet, lambda: _rollout(fleet).get("phase") == "SideBySide", "r2 side by side on every cluster")
    assert _spoke_revisions(fleet, "us").get("r2") == "SideBySide"
    assert fleet.hub_object(NAME, NS)["status"]["currentRevision"] == "r1"
    for spoke in REGIONS:  # the hub passes no queryRevision before the user sets one
        assert "queryRevision" not in (_copy(fleet, spoke)["spec"].get("rollout") or {})

    _patch_hub(fleet, {"rollout": {"queryRevision": "r2"}})
    # The copies carry queryRevision only until every spoke has flipped: then the rollout is Done and the
    # hub drops it (r2 is simply current). That window is about one hub round, so a spoke counts as told
    # when its copy carries r2 or its own operator already flipped the bare name to r2, which it does only
    # on reading queryRevision from the copy.
    _wait(fleet, lambda: all(_told_query_revision(fleet, s, "r2") for s in REGIONS),
          "queryRevision passed to every spoke")
    _wait(fleet, lambda: _rollout(fleet).get("phase") == "Done", "the flip done everywhere", timeout=90)
    status = fleet.hub_object(NAME, NS)["status"]
    assert status["currentRevision"] == "r2" and status["queryVectorSpace"] == "r2"
    assert [(r["name"], r["state"]) for r in status["revisions"]] == [("r1", "Retired"), ("r2", "Serving")]
    for spoke in REGIONS:
        assert _spoke_status(fleet, spoke)["currentRevision"] == "r2"
    _wait(fleet, lambda: {n: r.get("revision") for n, r in fleet.rows(NAME, NS).items()}
          == {"eu": "r2", "us": "r2"}, "rows showing r2")
    assert fleet.condition(NAME, NS, "RolloutBlocked")["status"] == "False"
    assert fleet.events(NAME, NS, "Rollout"), "the waves are Events on the hub object"


def test_a_failing_wave_rolls_back(fleet: Fleet) -> None:
    _patch_hub(fleet, {"compatibility": "compatible", "model": {"digest": OTHER_WEIGHTS}})
    _wait(fleet, lambda: _revision_of(fleet, "eu") == ("r3", "bfloat16", OTHER_WEIGHTS), "eu sent r3")
    assert _revision_of(fleet, "us") == ("r2", "bfloat16", DIGEST)
    # eu's operator gates r3: no probe answers within gateTimeoutSeconds, so it reports RolloutBlocked.
    _wait(fleet, lambda: _rollout(fleet).get("phase") == "RolledBack", "the rollback", timeout=90)
    _wait(fleet, lambda: _revision_of(fleet, "eu") == ("r2", "bfloat16", DIGEST), "eu given r2 back")
    assert _revision_of(fleet, "us") == ("r2", "bfloat16", DIGEST)  # never moved
    status = fleet.hub_object(NAME, NS)["status"]
    assert status["currentRevision"] == "r2"
    assert [(r["name"], r["state"]) for r in status["revisions"]] == [
        ("r1", "Retired"), ("r2", "Serving"), ("r3", "Blocked")]
    blocked = fleet.condition(NAME, NS, "RolloutBlocked")
    assert blocked["status"] == "True" and blocked["reason"] == "RolledBack"
    assert "eu (RolloutBlocked: GateTimeout" in blocked["message"], blocked
    assert len(fleet.events(NAME, NS, "RolledBack")) == 1
    _wait(fleet, lambda: _spoke_status(fleet, "eu").get("currentRevision") == "r2", "eu still serving r2")
    assert _rollout(fleet)["phase"] == "RolledBack"  # the same spec is not tried again
    for spoke in REGIONS:
        assert errors(fleet.spokes[spoke].audit(), hub_user(spoke)) == []
    assert errors(fleet.hub.audit(), fleet.hub_proc.user) == []

    # Rolled back and settled, the hub writes nothing more (a handful of its 1 s rounds).
    time.sleep(3)
    fleet.marks()
    time.sleep(6)
    assert writes(fleet.hub.audit(), fleet.hub_proc.user) == []
    for spoke in REGIONS:
        assert writes(fleet.spokes[spoke].audit(), hub_user(spoke)) == []
