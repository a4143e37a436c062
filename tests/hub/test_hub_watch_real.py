"""The watch-driven hub on the real test control plane (a hub and two spokes, three kube-apiservers on one
etcd, the chart's operators as the chart's identities; tests/hub/fleet.py):

- a copy edited on a spoke behind the hub's back shows in the hub's view and is restored;
- a hung spoke (its API server stopped with SIGSTOP: connections accepted, never answered) delays only
  itself: the other spoke gets its copy at once; when it wakes, it gets each write exactly once;
- a spoke refusing the hub's kubeconfig is ``CredentialsValid=False``, not a dead spoke: nothing fails over;
- a deployment's namespace is created on the spokes; a referenced Secret the policy does not copy, and the
  spoke lacks, is a ``Placed=False`` that says so; one the policy copies arrives with its labels and data
  (never in an annotation), where the spoke's chart allows it, and a spoke that does not is named;
- a PlacementPolicy's status lists the deployments it governs and those that contradict it.

Tests in this module share the fleet and run in file order.
"""

from __future__ import annotations

import base64
import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.hub.fleet import SYSTEM, Fleet, embedding, errors, hub_identity, hub_user, running_fleet
from tests.kube.controlplane import wait_until

REGIONS = {"eu": "eu-west-1", "us": "us-east-1"}
NS = "apps"
BOTH = {"mode": "ActiveActive", "minRegions": 2}
WRITE_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # The hub may read tenants' API-key Secrets, and spoke eu lets it write them there; us does not.
    values = {"hub": {"hub.propagateSecrets": "true"}, "eu": {"hubAccess.propagateSecrets": "true"}}
    # A write timeout far beyond the seconds a healthy spoke's write takes on a loaded machine: a hub that waited
    # for the hung spoke is then told apart from a slow one by a margin no machine's mood closes.
    with running_fleet(tmp_path_factory.mktemp("watch-fleet"), REGIONS, values,
                       prepare=lambda f: f.namespace(NS, {"team": "apps"}),
                       hub_env={"EMBEDFLEET_HUB_WRITE_TIMEOUT": str(WRITE_TIMEOUT_S)}) as fleet:
        yield fleet


def _no_unexpected_errors(fleet: Fleet, *allow: tuple[int, str]) -> None:
    for name, spoke in fleet.spokes.items():
        assert errors(spoke.audit(), hub_user(name), allow) == [], name
    assert errors(fleet.hub.audit(), f"system:serviceaccount:{SYSTEM}:ef-hub-embedfleet") == []


def _creates(fleet: Fleet, spoke: str, name: str) -> list[str]:
    """The hub's creates of copy ``name`` that the spoke answered, done (2xx) or refused as a duplicate
    (409). A create the client gave up on is cancelled by the server (504): it wrote nothing."""
    return [str(e) for e in fleet.spokes[spoke].audit() if e.user == hub_user(spoke) and e.verb == "create"
            and e.resource == "embeddingdeployments" and e.name == name and e.code != 504]


def test_a_copy_changed_behind_the_hubs_back_is_restored(fleet: Fleet) -> None:
    fleet.marks()
    fleet.hub.apply(embedding("pair", NS, replicas=2, placement=BOTH))
    fleet.wait_settled("pair", NS, {"eu": 1, "us": 1})
    fleet.spokes["eu"].kubectl("patch", "embeddingdeployment", "pair", "-n", NS, "--type=merge",
                               "-p", '{"spec":{"replicas":3}}')
    wait_until(lambda: fleet.copies("pair", NS).get("eu") == 1, 15, "the hand edit reverted by the hub")
    _no_unexpected_errors(fleet)


def test_a_hung_spoke_delays_only_itself_and_gets_each_write_once(fleet: Fleet) -> None:
    fleet.marks()
    apiserver = next(p for p in fleet.spokes["us"].procs if p.name == "us-apiserver")
    os.kill(apiserver.popen.pid, signal.SIGSTOP)
    try:
        created = time.monotonic()
        fleet.hub.apply(embedding("second", NS, replicas=2, placement=BOTH))
        # The hub's writes to the hung spoke time out after WRITE_TIMEOUT_S (EMBEDFLEET_HUB_WRITE_TIMEOUT); the
        # other spoke does not wait for them.
        wait_until(lambda: fleet.copy("eu", "second", NS) is not None, WRITE_TIMEOUT_S - 10,
                   "the healthy spoke's copy, before the hung spoke's write could have timed out")
        waited = time.monotonic() - created
        time.sleep(max(0.0, 4.0 - waited))  # long enough for the hub to have tried the hung spoke
    finally:
        os.kill(apiserver.popen.pid, signal.SIGCONT)
    assert waited < WRITE_TIMEOUT_S - 10, f"the healthy spoke waited {waited:.1f}s for the hung one"
    fleet.wait_settled("second", NS, {"eu": 1, "us": 1})
    # Once: one create that landed (2xx, or 409 for one the hub had already made). A create the hung server
    # answered 504 (the client gave up) is usually cancelled, but can still be written when the server
    # wakes (seen in CI): the hub then sees the copy in its watch and creates nothing more.
    attempts = [e for e in fleet.spokes["us"].audit() if e.user == hub_user("us") and e.verb == "create"
                and e.resource == "embeddingdeployments" and e.name == "second"]
    landed = [str(e) for e in attempts if e.code != 504]
    assert attempts and len(landed) <= 1, [str(e) for e in attempts]
    assert len(_creates(fleet, "eu", "second")) == 1, _creates(fleet, "eu", "second")
    _no_unexpected_errors(fleet)


def _fleet_condition(fleet: Fleet, cluster: str, type_: str) -> dict:
    fc = fleet.hub.get_json("fleetcluster", cluster) or {}
    return {c["type"]: c for c in (fc.get("status") or {}).get("conditions") or []}.get(type_) or {}


def test_refused_credentials_are_reported_not_failed_over(fleet: Fleet) -> None:
    fleet.wait_settled("pair", NS, {"eu": 1, "us": 1})
    fleet.marks()
    spoke = fleet.spokes["eu"]
    bad = spoke.kubeconfig_for("not-a-valid-token", fleet.workdir / "bad.kubeconfig", namespace=SYSTEM,
                               user=hub_identity("eu"))
    fleet.hub.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "eu-kubeconfig", "namespace": SYSTEM},
                     "data": {"kubeconfig": base64.b64encode(bad.read_bytes()).decode()}})
    wait_until(lambda: _fleet_condition(fleet, "eu", "CredentialsValid").get("status") == "False", 30,
               "CredentialsValid=False on the FleetCluster")
    cond = _fleet_condition(fleet, "eu", "CredentialsValid")
    assert cond["reason"] == "Unauthorized" and "401" in cond["message"], cond
    # Longer than lease + grace (5 s + 5 s): a dead spoke would have failed over by now.
    time.sleep(12)
    assert _fleet_condition(fleet, "eu", "Available").get("status") == "True"
    assert fleet.copies("pair", NS) == {"eu": 1, "us": 1}
    assert fleet.events("pair", NS, "Rescheduled") == [] or all(
        "eu=1" in e["message"].split("->")[-1] for e in fleet.events("pair", NS, "Rescheduled"))
    assert {n: r.get("desired") for n, r in fleet.rows("pair", NS).items()} == {"eu": 1, "us": 1}

    fleet.join("eu")  # the good kubeconfig again
    wait_until(lambda: _fleet_condition(fleet, "eu", "CredentialsValid").get("status") == "True", 30,
               "CredentialsValid=True again")
    fleet.wait_settled("pair", NS, {"eu": 1, "us": 1})
    _no_unexpected_errors(fleet)


def test_the_namespace_is_created_and_a_missing_secret_is_named(fleet: Fleet) -> None:
    fleet.marks()
    fleet.hub.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "only-on-hub"}})
    fleet.hub.apply(embedding("fresh", "only-on-hub", replicas=2, placement=BOTH))
    fleet.wait_settled("fresh", "only-on-hub", {"eu": 1, "us": 1})
    for name, spoke in fleet.spokes.items():
        ns = spoke.get_json("namespace", "only-on-hub")
        assert ns["metadata"]["labels"].get("embedfleet.dev/hub-managed") == name

    keyed = embedding("keyed", NS, replicas=2, placement=BOTH)
    keyed["spec"]["runtime"]["apiKeySecret"] = {"name": "tenant-keys", "key": "key"}
    fleet.hub.apply(keyed)

    def refused() -> dict | None:
        placed = fleet.condition("keyed", NS, "Placed")
        return placed if placed.get("status") == "False" and "refused by the spoke" in placed.get(
            "message", "") else None

    placed = wait_until(refused, 60, "Placed=False quoting the spokes' refusal")
    assert "tenant-keys" in placed["message"] and "propagateSecrets" in placed["message"], placed
    _no_unexpected_errors(fleet)


def test_a_policy_status_lists_what_it_governs_and_what_contradicts_it(fleet: Fleet) -> None:
    fleet.hub.apply({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "PlacementPolicy",
                     "metadata": {"name": "apps-active"},
                     "spec": {"namespaceSelector": {"matchLabels": {"team": "apps"}}, "mode": "ActiveActive"}})
    fleet.hub.apply(embedding("contrary", NS, replicas=1,
                              placement={"mode": "RegionLocked", "regions": ["eu-west-1"]}))

    def status() -> dict | None:
        pp = fleet.hub.get_json("placementpolicy", "apps-active") or {}
        st = pp.get("status") or {}
        return st if any(c["deployment"] == f"{NS}/contrary" for c in st.get("conflicts") or []) else None

    st = wait_until(status, 30, "the policy's status")
    assert f"{NS}/pair" in st["deployments"] and f"{NS}/contrary" in st["deployments"]
    assert st["matchedDeployments"] >= 3
    conflict = next(c for c in st["conflicts"] if c["deployment"] == f"{NS}/contrary")
    assert "RegionLocked" in conflict["message"]
    cond = {c["type"]: c for c in st["conditions"]}["Conflicts"]
    assert cond["status"] == "True" and f"{NS}/contrary" in cond["message"]


def test_a_policy_that_propagates_secrets_copies_them_where_the_spoke_allows(fleet: Fleet) -> None:
    fleet.marks()
    fleet.namespace("keys", {"keys": "copied"})
    fleet.hub.apply(
        {"apiVersion": "embedfleet.dev/v1alpha1", "kind": "PlacementPolicy", "metadata": {"name": "copy-keys"},
         "spec": {"namespaceSelector": {"matchLabels": {"keys": "copied"}}, "priority": 50,
                  "propagateSecrets": True}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {
            "name": "tenant-keys", "namespace": "keys", "labels": {"embedfleet.dev/tenant-secret": "true"}},
         "stringData": {"key": "s3cr3t"}})
    keyed = embedding("keyed", "keys", replicas=2, placement=BOTH)
    keyed["spec"]["runtime"]["apiKeySecret"] = {"name": "tenant-keys", "key": "key"}
    fleet.hub.apply(keyed)

    copied = wait_until(lambda: fleet.spokes["eu"].get_json("secret", "tenant-keys", "-n", "keys"), 60,
                        "the Secret copied to eu")
    assert base64.b64decode(copied["data"]["key"]) == b"s3cr3t"
    assert copied["metadata"]["labels"] == {"embedfleet.dev/tenant-secret": "true",
                                            "embedfleet.dev/hub-managed": "eu"}
    assert "s3cr3t" not in str(copied["metadata"].get("annotations") or {})
    assert fleet.spokes["us"].get_json("secret", "tenant-keys", "-n", "keys") is None
    # A rotated key reaches the spoke (the hub compares every EMBEDFLEET_HUB_SECRET_RECHECK, 2 s here).
    fleet.hub.kubectl("patch", "secret", "tenant-keys", "-n", "keys", "--type=merge", "-p",
                      '{"stringData":{"key":"r0tated"}}')
    wait_until(lambda: base64.b64decode((fleet.spokes["eu"].get_json("secret", "tenant-keys", "-n", "keys")
                                         or {}).get("data", {}).get("key", "")) == b"r0tated", 30,
               "the rotated key on eu")

    def us_refused() -> dict | None:
        row = fleet.rows("keyed", "keys").get("us") or {}
        return row if any("403" in r and "secrets" in r for r in row.get("reasons") or []) else None

    row = wait_until(us_refused, 60, "us, whose chart grants no Secret right, named in status")
    assert row["reasons"][0].startswith("problem: propagation failed")
    # A refusal is retried every 30 s, not every 1 s round, and its problem stays in status meanwhile.
    fleet.spokes["us"].audit_mark()
    time.sleep(5)
    assert len(errors(fleet.spokes["us"].audit(), hub_user("us"))) <= 1
    assert us_refused() is not None
    wait_until(lambda: fleet.copy("eu", "keyed", "keys") is not None, 30, "eu's copy beside its Secret")
    # The refused Secret read is the only 403, on us; nothing else was refused anywhere.
    forbidden = errors(fleet.spokes["us"].audit(since_mark=False), hub_user("us"))
    assert forbidden and all("secrets" in f for f in forbidden), forbidden
    assert errors(fleet.spokes["eu"].audit(), hub_user("eu")) == []
