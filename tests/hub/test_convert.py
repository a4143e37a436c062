"""The hub's pure pieces that decide whether a round writes anything and what its status says: the status
diff (server-stored values against what the hub wants), the conditions, and error sentences that read the
same every round."""

from __future__ import annotations

import json

import urllib3

from embedfleet.operator.hub import convert
from embedfleet.operator.hub.errors import describe
from embedfleet.operator.kube import KubeError
from embedfleet.operator.scheduling import ClusterPlacement, Placement, ReplicaRange


def _placement(**shares: int) -> Placement:
    clusters = {n: ClusterPlacement(ReplicaRange(k, k, k), "r", "cpu") for n, k in shares.items()}
    return Placement(clusters, {}, target=sum(shares.values()))


def _by_type(conds: list[dict]) -> dict[str, dict]:
    return {c["type"]: c for c in conds}


def test_status_as_the_server_stores_it_is_no_change() -> None:
    row = convert.spoke_row("eu", None, "eu-west-1", None, None)  # ready, cache, lastSeen ... are None
    stored = {k: v for k, v in row.items() if v is not None}  # the server drops nulls inside lists
    live = {"clusters": [stored], "replicas": {"desired": 2, "ready": 2, "current": 2},
            "conditions": [{"type": "Placed", "status": "True", "reason": "Placed", "message": "m",
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    wanted = {"clusters": [row], "replicas": {"desired": 2, "ready": 2, "current": 2}, "inFlight": None,
              "conditions": [{"type": "Placed", "status": "True", "reason": "Placed", "message": "m",
                              "lastTransitionTime": "2026-02-02T00:00:00Z"}]}
    assert convert.status_changes(live, wanted) == {}


def test_a_value_that_went_away_is_a_change() -> None:
    before = {"clusters": [{"name": "eu", "region": "", "min": 2, "desired": 2, "max": 2, "ready": 2,
                            "reasons": []}], "inFlight": 3.0}
    now = {"clusters": [{"name": "eu", "region": "", "min": 2, "desired": 2, "max": 2, "ready": None,
                         "reasons": []}], "inFlight": None}
    assert set(convert.status_changes(before, now)) == {"clusters", "inFlight"}


def test_conditions_name_the_cluster_and_the_error() -> None:
    placement = _placement(eu=2, us=2)
    rows = [convert.spoke_row("eu", placement.clusters["eu"], "eu-west-1", {"status": {"replicas": {"ready": 2}}},
                              None),
            convert.spoke_row("us", placement.clusters["us"], "us-east-1", None, None,
                              "propagation failed: HTTP 403 Forbidden: no")]
    conds = _by_type(convert.conditions(placement, rows, {"us": "propagation failed: HTTP 403 Forbidden: no"},
                                        {}, 3))
    assert conds["Placed"]["status"] == "False" and conds["Placed"]["reason"] == "PropagationFailed"
    assert conds["Degraded"]["status"] == "True" and "us: propagation failed: HTTP 403" in conds["Degraded"]["message"]
    assert conds["Available"]["status"] == "True" and conds["Available"]["message"].startswith("2 ready")
    assert convert.row_problem(rows[1]) == "propagation failed: HTTP 403 Forbidden: no"
    assert rows[1]["reasons"][0] == "problem: propagation failed: HTTP 403 Forbidden: no"

    unreachable = _by_type(convert.conditions(placement, rows, {"us": "unreachable: refused"}, {}, 3))
    assert unreachable["Placed"]["reason"] == unreachable["Degraded"]["reason"] == "ClusterUnreachable"

    moved = _by_type(convert.conditions(_placement(us=4), rows[:1], {}, {"eu": "LeaseExpired"}, 3))
    assert moved["Placed"]["status"] == "True"
    assert moved["Degraded"]["reason"] == "ClusterUnavailable" and "eu unavailable (LeaseExpired)" in \
        moved["Degraded"]["message"]

    healthy = _by_type(convert.conditions(placement, rows[:1], {}, {}, 3))
    assert healthy["Placed"]["status"] == "True" and healthy["Degraded"]["status"] == "False"


def test_a_rejected_spec_is_not_left_showing_placed() -> None:
    rejected = Placement({}, {}, accepted=False, problems=("regions outside the policy",))
    conds = _by_type(convert.conditions(rejected, [], {}, {}, 1))
    assert conds["Accepted"]["status"] == conds["Placed"]["status"] == "False"
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "PolicyConflict"


def test_a_deprecated_field_is_named_in_the_hub_objects_accepted() -> None:
    """As a spoke's operator does on its own objects (autoscale_target.py): still accepted, reason
    Deprecated, the mode kept in front of the sentence."""
    from embedfleet.operator.autoscale_target import in_flight_target

    spec = {"runtime": {"maxBatchRequests": 48}, "autoscaling": {"enabled": True}}
    deprecation = in_flight_target(spec).deprecation
    assert deprecation is not None
    conds = _by_type(convert.conditions(_placement(eu=1), [], {}, {}, 2, deprecation))
    assert conds["Accepted"]["status"] == "True" and conds["Accepted"]["reason"] == "Deprecated"
    assert conds["Accepted"]["message"].startswith("mode ") and "spec.runtime.maxBatchRequests (48)" in \
        conds["Accepted"]["message"]
    plain = _by_type(convert.conditions(_placement(eu=1), [], {}, {}, 2))
    assert plain["Accepted"]["reason"] == "Valid"


def test_error_sentences_read_the_same_every_round() -> None:
    body = json.dumps({"kind": "Status", "message": 'embeddingdeployments "x" is forbidden', "code": 403})
    assert describe(KubeError(403, "Forbidden", body, "PATCH /x")) == \
        'HTTP 403 Forbidden: embeddingdeployments "x" is forbidden'

    def refused(address: str) -> urllib3.exceptions.MaxRetryError:
        reason = urllib3.exceptions.NewConnectionError(
            f"<urllib3.connection.HTTPSConnection object at {address}>", "Connection refused")
        return urllib3.exceptions.MaxRetryError(None, "/api", reason)

    first, second = describe(refused("0x7f00aa")), describe(refused("0x7f11bb"))
    assert first == second and "unreachable" in first and "0x" not in first
