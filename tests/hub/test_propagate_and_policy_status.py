"""Pure parts of the hub: what a spoke needs beside a copy (namespace, API-key Secrets), and what a
PlacementPolicy's status says about the deployments it governs."""

from __future__ import annotations

from embedfleet.operator.hub.policy_status import LISTED, policy_statuses
from embedfleet.operator.hub.propagate import needs_of, referenced_secrets, secret_copy
from embedfleet.operator.scheduling import Placement


def _obj(**runtime: object) -> dict:
    return {"metadata": {"name": "d", "namespace": "ml"}, "spec": {"runtime": dict(runtime)}}


def test_secrets_travel_only_when_the_policy_says_so() -> None:
    obj = _obj(apiKeySecret={"name": "k", "key": "key"})
    assert referenced_secrets(obj) == ["ml/k"]
    assert needs_of(obj, propagate_secrets=True).secrets == ("ml/k",)
    assert needs_of(obj, propagate_secrets=False).secrets == ()
    assert needs_of(_obj(), propagate_secrets=True).secrets == ()
    assert needs_of(obj, propagate_secrets=False).namespace == "ml"


def test_a_secret_copy_keeps_labels_and_data_never_annotations() -> None:
    source = {"metadata": {"name": "k", "namespace": "ml", "labels": {"embedfleet.dev/tenant-secret": "true"},
                           "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...data...}"},
                           "resourceVersion": "7", "uid": "u"},
              "type": "Opaque", "data": {"key": "c2VjcmV0"}}
    manifest, fingerprint = secret_copy(source, "eu")
    assert manifest["metadata"] == {"name": "k", "namespace": "ml", "labels": {
        "embedfleet.dev/tenant-secret": "true", "embedfleet.dev/hub-managed": "eu"}}
    assert manifest["data"] == {"key": "c2VjcmV0"} and manifest["type"] == "Opaque"
    changed = {**source, "data": {"key": "b3RoZXI="}}
    assert secret_copy(changed, "eu")[1] != fingerprint
    assert secret_copy(source, "eu")[1] == fingerprint


def test_policy_status_lists_governed_and_conflicting_deployments() -> None:
    policies = {"eu": {"metadata": {"name": "eu", "generation": 3}}, "idle": {"metadata": {"name": "idle"}}}
    placements = {
        "ml/a": Placement({}, {}, policy="eu"),
        "ml/b": Placement({}, {}, accepted=False, policy="eu", problems=("spec.placement.mode X contradicts",)),
        "ml/c": Placement({}, {}, policy=None),
    }
    out = policy_statuses(policies, placements)
    assert out["eu"]["matchedDeployments"] == 2 and out["eu"]["deployments"] == ["ml/a", "ml/b"]
    assert out["eu"]["conflicts"] == [{"deployment": "ml/b", "message": "spec.placement.mode X contradicts"}]
    assert out["eu"]["conditions"][0]["status"] == "True" and "ml/b" in out["eu"]["conditions"][0]["message"]
    assert out["eu"]["observedGeneration"] == 3
    assert out["idle"]["matchedDeployments"] == 0 and out["idle"]["conditions"][0]["status"] == "False"


def test_policy_status_lists_are_capped_but_counts_are_not() -> None:
    placements = {f"ml/d{i:04d}": Placement({}, {}, policy="p") for i in range(LISTED * 3)}
    out = policy_statuses({"p": {"metadata": {"name": "p"}}}, placements)["p"]
    assert out["matchedDeployments"] == LISTED * 3 and len(out["deployments"]) == LISTED
