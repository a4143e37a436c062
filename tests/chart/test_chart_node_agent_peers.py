"""nodeAgent.peers in the rendered chart: off by default (the agent's identity as before); on, exactly the
rights a peer lookup needs (nodes list, pods list in the release namespace), the port on the pod IP, and a
NetworkPolicy that admits only this release's agent pods to it."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart.helm import CI_VALUES, DEFAULTS, by_kind, named, template

AGENT = "embedfleet-node-agent"
AGENT_PODS = {"app.kubernetes.io/name": "embedfleet-node-agent", "app.kubernetes.io/instance": "embedfleet"}


def _agent(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = by_kind(objects, "DaemonSet")
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return container


def test_peers_are_off_by_default_and_add_nothing() -> None:
    assert DEFAULTS["nodeAgent"]["peers"]["enabled"] is False
    objects = template([CI_VALUES["standalone"]])
    assert not by_kind(objects, "NetworkPolicy")
    assert not [o for o in by_kind(objects, "Role") if o["metadata"]["name"] == AGENT]
    agent = _agent(objects)
    assert "ports" not in agent and not [a for a in agent["args"] if a.startswith("--peer")]
    assert not by_kind(objects, "Secret")  # no peer key either
    assert named(objects, "ClusterRole", AGENT)["rules"][0]["verbs"] == ["get", "patch"]


@pytest.mark.parametrize("role", ["standalone", "spoke"])
def test_peers_on_grant_the_lookup_open_the_port_to_agents_only(role: str) -> None:
    objects = template([CI_VALUES[role]], {"nodeAgent.peers.enabled": "true", "nodeAgent.peers.port": "9123",
                                           "nodeAgent.peers.bytesPerSecond": "50000000"})
    cluster_rules = named(objects, "ClusterRole", AGENT)["rules"]
    assert cluster_rules[0] == {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}
    assert not [r for r in cluster_rules if "pods" in r["resources"]]  # pods only in its own namespace
    role_obj = named(objects, "Role", AGENT)
    assert role_obj["metadata"]["namespace"] == "embedfleet-system"
    assert role_obj["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    binding = named(objects, "RoleBinding", AGENT)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": AGENT}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": AGENT, "namespace": "embedfleet-system"}]

    agent = _agent(objects)
    assert agent["ports"] == [{"name": "peers", "containerPort": 9123, "protocol": "TCP"}]
    args = set(agent["args"])
    assert {"--peer-port=9123", "--peer-host=$(POD_IP)", "--peer-rate=50000000", "--max-peers=3",
            "--peer-selector=app.kubernetes.io/name=embedfleet-node-agent,app.kubernetes.io/instance=embedfleet",
            } <= args
    # the release's peer key: one Secret, mounted read-only into the agent alone, passed as --peer-key-file
    (secret,) = [o for o in by_kind(objects, "Secret") if o["metadata"]["name"] == f"{AGENT}-peer-key"]
    assert secret["metadata"]["namespace"] == "embedfleet-system" and len(secret["data"]["key"]) >= 64
    assert "--peer-key-file=/etc/embedfleet/peer/key" in args
    (mount,) = [m for m in agent["volumeMounts"] if m["name"] == "peer-key"]
    assert mount == {"name": "peer-key", "mountPath": "/etc/embedfleet/peer", "readOnly": True}
    users = [o for o in objects for v in (o.get("spec", {}).get("template", {}).get("spec", {}).get("volumes") or [])
             if v.get("secret", {}).get("secretName") == secret["metadata"]["name"]]
    assert [o["kind"] for o in users] == ["DaemonSet"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in agent["env"]}
    assert env["POD_IP"] == "status.podIP" and env["POD_NAMESPACE"] == "metadata.namespace"
    (ds,) = by_kind(objects, "DaemonSet")
    assert AGENT_PODS.items() <= ds["spec"]["template"]["metadata"]["labels"].items()  # the selector finds them

    (policy,) = by_kind(objects, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == "embedfleet-system"
    assert policy["spec"]["podSelector"] == {"matchLabels": AGENT_PODS}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": AGENT_PODS}}],
                                          "ports": [{"protocol": "TCP", "port": 9123}]}]


def test_no_rate_limit_when_zero_and_nothing_on_a_hub() -> None:
    agent = _agent(template([CI_VALUES["standalone"]], {"nodeAgent.peers.enabled": "true",
                                                        "nodeAgent.peers.bytesPerSecond": "0"}))
    assert not [a for a in agent["args"] if a.startswith("--peer-rate")]
    hub = template([CI_VALUES["hub"]], {"nodeAgent.peers.enabled": "true"})
    assert not by_kind(hub, "NetworkPolicy") and not by_kind(hub, "DaemonSet")


def test_the_schema_refuses_a_bad_port() -> None:
    with pytest.raises(AssertionError, match="/nodeAgent/peers/port"):
        template([CI_VALUES["standalone"]], {"nodeAgent.peers.port": "70000"})
