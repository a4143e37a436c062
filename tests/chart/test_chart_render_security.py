"""The chart's RBAC and its locked-down workloads as the real `helm` renders them: no wildcards, only its
own roles bound, the operator's and the node agent's rights, the node agent's DaemonSet and the gateway
locked down, the hub's access to a spoke, the admission policy over Secret references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.chart.helm import (
    CI_VALUES,
    DEFAULTS,
    by_kind,
    gateway_deployment,
    named,
    operator_container,
    operator_deployment,
    template,
)
from tests.chart.render_helpers import CASES, IDS

# ---------------------------------------------------------------- RBAC


def _rules(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[tuple[str, str], set[str]]]:
    """{(kind, name): {(group, resource): verbs}} for every Role and ClusterRole."""
    out: dict[tuple[str, str], dict[tuple[str, str], set[str]]] = {}
    for obj in objects:
        if obj["kind"] in ("Role", "ClusterRole"):
            table: dict[tuple[str, str], set[str]] = {}
            for rule in obj["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        table.setdefault((group, resource), set()).update(rule["verbs"])
            out[(obj["kind"], obj["metadata"]["name"])] = table
    return out


@pytest.mark.parametrize(("name", "files", "sets"), CASES, ids=IDS)
def test_rbac_has_no_wildcards_and_binds_only_its_own_roles(name: str, files: list[Path],
                                                            sets: dict[str, str]) -> None:
    objects = template(files, sets)
    roles = _rules(objects)
    for obj in objects:
        for rule in obj.get("rules") or []:
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert "*" not in rule.get(key, []), f"{obj['metadata']['name']}: wildcard in {key}"
            assert not {"escalate", "impersonate", "bind"} & set(rule["verbs"])
            assert "clusterrolebindings" not in rule["resources"] and "rolebindings" not in rule["resources"]
    for binding in by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding"):
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in roles
    for (kind, role_name), table in roles.items():
        # Secrets are read (get) only, but by the hub on a spoke that opted in to API-key Secret copies.
        allowed = {"get", "create", "patch"} if role_name.endswith("-hub-access-propagate") else {"get"}
        assert table.get(("", "secrets"), allowed) == allowed, (kind, role_name)


def test_the_operator_never_reads_secrets_or_writes_nodes_outside_the_hub() -> None:
    for role in ("standalone", "spoke"):
        objects = template([CI_VALUES[role]])
        operator_roles = {(b["roleRef"]["kind"], b["roleRef"]["name"])
                          for b in by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding")
                          if {"kind": "ServiceAccount", "name": "embedfleet", "namespace": "embedfleet-system"}
                          in b["subjects"]}
        tables = _rules(objects)
        granted = {key: verbs for r in operator_roles for key, verbs in tables[r].items()}
        assert granted.get(("", "secrets"), set()) <= {"get"}  # labels of an apiKeySecret, as metadata only
        # cache status (the agents' labels) and spec.spot (which nodes are spot, which are reclaimed): read only
        assert granted.get(("", "nodes"), set()) == {"list", "watch"}
        assert ("ClusterRole", "embedfleet-cache-puller") not in tables
        # The node agent is the one identity with a node write, and holds nothing else.
        assert tables[("ClusterRole", "embedfleet-node-agent")] == {
            ("", "nodes"): {"get", "patch"},
            ("embedfleet.dev", "embeddingdeployments"): {"list", "watch"},
            ("embedfleet.dev", "modelcaches"): {"list", "watch"},
        }
        (binding,) = [b for b in by_kind(objects, "ClusterRoleBinding")
                      if b["roleRef"]["name"] == "embedfleet-node-agent"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "embedfleet-node-agent",
                                        "namespace": "embedfleet-system"}]
        node_writers = {(b["metadata"]["name"], s["name"]) for b in by_kind(objects, "ClusterRoleBinding")
                        for s in b["subjects"] if "patch" in tables[("ClusterRole", b["roleRef"]["name"])]
                        .get(("", "nodes"), set())}
        assert node_writers == {("embedfleet-node-agent", "embedfleet-node-agent")}


#: What the hub's loop calls on a spoke, by role object: its copies, what a copy needs there, its heartbeat.
HUB_COPIES = {("embedfleet.dev", "embeddingdeployments"): {"get", "list", "watch", "create", "patch", "delete"}}
HUB_PROPAGATES = {("", "namespaces"): {"get", "create"}}
HUB_SECRETS = {("", "secrets"): {"get", "create", "patch"}}


@pytest.mark.parametrize("propagate_secrets", [False, True])
def test_hub_access_is_spoke_only_and_exact(propagate_secrets: bool) -> None:
    sets = {"hubAccess.propagateSecrets": "true"} if propagate_secrets else {}
    objects = template([CI_VALUES["spoke"]], sets)
    tables = _rules(objects)
    assert tables[("ClusterRole", "embedfleet-hub-access")] == HUB_COPIES
    assert tables[("ClusterRole", "embedfleet-hub-access-propagate")] == (
        {**HUB_PROPAGATES, **HUB_SECRETS} if propagate_secrets else HUB_PROPAGATES)
    lease_role = named(objects, "Role", "embedfleet-hub-access")
    # By name only, list and watch too (the API server matches a metadata.name field selector against
    # resourceNames: tests/chart/test_hub_access_real.py).
    assert lease_role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                    "resourceNames": ["embedfleet-spoke"], "verbs": ["get", "list", "watch"]}]
    hub_roles = {(b["roleRef"]["kind"], b["roleRef"]["name"]) for b in
                 by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding")
                 if {"kind": "ServiceAccount", "name": "embedfleet-hub", "namespace": "embedfleet-system"}
                 in b["subjects"]}
    assert hub_roles == {("ClusterRole", "embedfleet-hub-access"), ("ClusterRole", "embedfleet-hub-access-propagate"),
                         ("Role", "embedfleet-hub-access")}
    secret_rights = {verb for role in hub_roles for verb in tables[role].get(("", "secrets"), set())}
    assert secret_rights == ({"get", "create", "patch"} if propagate_secrets else set())
    subjects = named(objects, "ClusterRoleBinding", "embedfleet-hub-access")["subjects"]
    assert subjects == [{"kind": "ServiceAccount", "name": "embedfleet-hub", "namespace": "embedfleet-system"}]
    extra = template([CI_VALUES["spoke"]], {
        "hubAccess.serviceAccount.create": "false",
        "hubAccess.subjects[0].kind": "User", "hubAccess.subjects[0].name": "arn:aws:iam::1:role/hub",
        "hubAccess.subjects[1].kind": "ServiceAccount", "hubAccess.subjects[1].name": "hub",
    })
    assert not [sa for sa in by_kind(extra, "ServiceAccount") if sa["metadata"]["name"] == "embedfleet-hub"]
    for kind, name in (("RoleBinding", "embedfleet-hub-access"), ("ClusterRoleBinding", "embedfleet-hub-access"),
                       ("ClusterRoleBinding", "embedfleet-hub-access-propagate")):
        assert named(extra, kind, name)["subjects"] == [
            {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "arn:aws:iam::1:role/hub"},
            {"kind": "ServiceAccount", "name": "hub", "namespace": "embedfleet-system"}]
    for role in ("standalone", "hub"):
        assert not [o for o in template([CI_VALUES[role]], sets) if "hub-access" in o["metadata"]["name"]]
    assert not [o for o in template([CI_VALUES["spoke"]], {"hubAccess.enabled": "false"})
                if "hub-access" in o["metadata"]["name"]]


def test_the_admission_policy_governs_every_secret_reference() -> None:
    """platform.secrets covers each spec.runtime field that names a Secret (platform.SECRET_REF_FIELDS): the
    ValidatingAdmissionPolicy has a rule per field, naming it, like the operator's own check."""
    from embedfleet.operator import platform

    vap = next(p for p in by_kind(template([]), "ValidatingAdmissionPolicy")
               if p["metadata"]["name"].endswith("-embeddingdeployments"))
    secret_rules = [v for v in vap["spec"]["validations"] if "variables.secretsAllowed" in v["expression"]]
    by_field = {rule["message"].split(":")[0]: rule for rule in secret_rules}
    assert sorted(by_field) == sorted(f"spec.runtime.{field}" for field in platform.SECRET_REF_FIELDS)
    for field in platform.SECRET_REF_FIELDS:
        rule = by_field[f"spec.runtime.{field}"]
        assert f"has(object.spec.runtime.{field})" in rule["expression"] and rule["reason"] == "Forbidden"
        assert rule["message"] == platform.deployment_problems(
            {"runtime": {field: {"name": "s", "key": "k"}}},
            platform.PlatformPolicy(secrets=platform.SecretRules(allowed=False)))[0]


# ---------------------------------------------------------------- locked-down workloads


@pytest.mark.parametrize("role", ["standalone", "spoke"])
def test_node_agent_daemonset_is_locked_down(role: str) -> None:
    """One DaemonSet in the release namespace; the platform's cache root as its hostPath; the init
    container is the only root step and holds CAP_CHOWN alone; the agent is uid 10001, read-only root
    filesystem, every capability dropped, off control-plane nodes, with the operator's platform policy."""
    objects = template([CI_VALUES[role]], {"nodeAgent.maxPullBytes": "50000000000",
                                           "nodeAgent.retentionSeconds": "120"})
    (ds,) = by_kind(objects, "DaemonSet")
    assert ds["metadata"]["namespace"] == "embedfleet-system"
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "embedfleet-node-agent"
    (volume,) = [v for v in pod["volumes"] if "hostPath" in v]
    assert volume["hostPath"] == {"path": DEFAULTS["platform"]["cacheRoot"], "type": "DirectoryOrCreate"}
    (prepare,) = pod["initContainers"]
    assert prepare["command"][:3] == ["embedfleet", "cache", "prepare"] and "--owner=10001:10001" in prepare["command"]
    assert prepare["securityContext"] == {
        "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}
    (agent,) = pod["containers"]
    assert agent["command"] == ["embedfleet", "cache", "agent"]
    assert {"--cache-root=/cache", "--retention-seconds=120", "--max-pull-bytes=50000000000"} <= set(agent["args"])
    security = agent["securityContext"]
    assert security["runAsUser"] == 10001 and security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True and security["capabilities"] == {"drop": ["ALL"]}
    assert not security["allowPrivilegeEscalation"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    operator_env = {e["name"]: e.get("value") for e in operator_container(objects)["env"]}
    assert env["EMBEDFLEET_PLATFORM_POLICY"]["value"] == operator_env["EMBEDFLEET_PLATFORM_POLICY"]
    assert env["EMBEDFLEET_DEFAULT_RUNTIME_IMAGE"]["value"] == operator_env["EMBEDFLEET_DEFAULT_RUNTIME_IMAGE"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    control_plane = {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"}
    assert terms[0]["matchExpressions"] == [control_plane]  # not the removed master label
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # Its pods are not the operator's: the Deployment's selector must not match them.
    deployment = operator_deployment(objects)
    operator_selector = deployment["spec"]["selector"]["matchLabels"].items()
    assert not operator_selector <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert not by_kind(template([CI_VALUES[role]], {"nodeAgent.enabled": "false"}), "DaemonSet")
    assert not by_kind(template([CI_VALUES["hub"]]), "DaemonSet")


@pytest.mark.parametrize("role", ["standalone", "spoke"])
def test_gateway_is_ha_locked_down_and_may_only_read_and_scale(role: str) -> None:
    """Two replicas behind a Service with a PodDisruptionBudget, non-root with a read-only root; its
    identity reads EmbeddingDeployments and EndpointSlices and may change nothing but their scale."""
    objects = template([], {"role": role})
    gateway = gateway_deployment(objects)
    assert gateway is not None and gateway["spec"]["replicas"] == 2
    pod = gateway["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "embedfleet-gateway"
    assert gateway["spec"]["template"]["metadata"]["labels"]["embedfleet.dev/component"] == "gateway"
    (container,) = pod["containers"]
    assert container["command"] == ["embedfleet", "gateway", "--kubernetes"]
    assert {"--port=8000", "--max-held=256", "--hold-timeout=60"} <= set(container["args"])
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]} and not security["allowPrivilegeEscalation"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    # the operator's selector does not take the gateway's pods, and the operator knows the gateway port
    operator_selector = operator_deployment(objects)["spec"]["selector"]["matchLabels"].items()
    assert not operator_selector <= gateway["spec"]["template"]["metadata"]["labels"].items()
    operator_env = {e["name"]: e.get("value") for e in operator_container(objects)["env"]}
    assert operator_env["EMBEDFLEET_GATEWAY_PORT"] == "8000"
    service = named(objects, "Service", "embedfleet-gateway")
    assert service["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]
    assert named(objects, "PodDisruptionBudget", "embedfleet-gateway")["spec"]["minAvailable"] == 1
    assert _rules(objects)[("ClusterRole", "embedfleet-gateway")] == {
        ("embedfleet.dev", "embeddingdeployments"): {"get", "list", "watch"},
        ("embedfleet.dev", "embeddingdeployments/scale"): {"get", "patch"},
        ("discovery.k8s.io", "endpointslices"): {"list", "watch"},
    }
    (binding,) = [b for b in by_kind(objects, "ClusterRoleBinding") if b["roleRef"]["name"] == "embedfleet-gateway"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "embedfleet-gateway",
                                    "namespace": "embedfleet-system"}]
    scoped = template([], {"role": role, "watchNamespaces": "{team-a,team-b}"})
    assert sorted(b["metadata"]["namespace"] for b in by_kind(scoped, "RoleBinding")
                  if b["roleRef"]["name"] == "embedfleet-gateway") == ["team-a", "team-b"]
    assert "--namespace=team-a" in gateway_deployment(scoped)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert gateway_deployment(template([CI_VALUES[role]])) is not None
    assert gateway_deployment(template([CI_VALUES[role]], {"gateway.enabled": "false"})) is None
    assert gateway_deployment(template([CI_VALUES["hub"]])) is None
