"""The chart rendered by the real `helm` (lint, template, the values schema as helm applies it) and every
rendered object judged by a real API server (`kubectl apply --dry-run=server --validate=strict`)."""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from embedfleet.operator import cli as operator_cli
from tests.chart.helm import (
    CHART,
    CI_VALUES,
    DEFAULTS,
    ROLES,
    SCHEMA,
    by_kind,
    fullname,
    gateway_deployment,
    helm,
    install_crds,
    named,
    operator_container,
    operator_deployment,
    template,
    template_text,
)
from tests.kube import gateway_api
from tests.kube.controlplane import ROOT, Cluster

#: (id, values files, --set): the defaults, each ci/ file, and each role on defaults.
CASES = [("defaults", [], {})]
CASES += [(f"ci/{role}", [path], {}) for role, path in CI_VALUES.items()]
CASES += [(f"role={role}", [], {"role": role}) for role in ROLES]
#: The opt-ins that add objects or rights: the hub may copy Secrets; a spoke's and a hub's timing flags.
CASES += [("spoke+propagateSecrets", [CI_VALUES["spoke"]], {"hubAccess.propagateSecrets": "true"}),
          ("spoke+timing", [CI_VALUES["spoke"]], {"spoke.heartbeatInterval": "2", "spoke.leaseDuration": "7"}),
          ("hub+timing", [CI_VALUES["hub"]], {"hub.interval": "3", "hub.rampSeconds": "0",
                                              "hub.spokeWriteTimeout": "4"})]
IDS = [case[0] for case in CASES]


def _nested(sets: Mapping[str, str]) -> dict[str, Any]:
    """`--set a.b=1` as helm reads it: nested maps, the value typed (ints and booleans; helm keeps "2.5" a
    string, which no case here sets)."""
    out: dict[str, Any] = {}
    for dotted, text in sets.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(text)
    return out


def merged_values(files: list[Path], sets: Mapping[str, str]) -> dict[str, Any]:
    """The release's .Values the way helm merges them: maps key by key, anything else (lists too) replaced."""
    out: dict[str, Any] = json.loads(json.dumps(DEFAULTS))
    for override in [yaml.safe_load(p.read_text()) or {} for p in files] + [_nested(sets)]:
        stack: list[tuple[dict[str, Any], dict[str, Any]]] = [(out, override)]
        while stack:
            base, over = stack.pop()
            for key, value in over.items():
                if isinstance(value, dict) and isinstance(base.get(key), dict):
                    stack.append((base[key], value))
                else:
                    base[key] = value
    return out


# ---------------------------------------------------------------- lint and values


@pytest.mark.parametrize(("name", "files", "sets"), CASES, ids=IDS)
def test_helm_lint_strict(name: str, files: list[Path], sets: dict[str, str]) -> None:
    args = ["lint", str(CHART), "--strict"]
    for path in files:
        args += ["-f", str(path)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    done = helm(*args)
    assert "0 chart(s) failed" in done.stdout


def test_ci_values_cover_every_role() -> None:
    assert {(yaml.safe_load(p.read_text()) or {}).get("role") for p in CI_VALUES.values()} == set(ROLES)


def _schema_paths(schema: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, sub in (schema.get("properties") or {}).items():
        yield f"{prefix}{key}"
        if sub.get("type") == "object" and "properties" in sub:
            yield from _schema_paths(sub, f"{prefix}{key}.")


def _has_path(values: Mapping[str, Any], dotted: str) -> bool:
    node: Any = values
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def test_values_yaml_and_schema_are_in_sync() -> None:
    """Every default satisfies the schema, and every key the schema knows has a default in values.yaml
    (the schema refuses keys values.yaml lacks, so together: the same keys)."""
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(DEFAULTS, SCHEMA)
    for case_files in CI_VALUES.values():
        jsonschema.validate(merged_values([case_files], {}), SCHEMA)
    optional = {"image", "imagePullSecrets", "podAnnotations", "podLabels", "nodeSelector", "tolerations",
                "affinity", "priorityClassName", "serviceAccount.annotations"}
    missing = [p for p in _schema_paths(SCHEMA) if not _has_path(DEFAULTS, p) and p not in optional]
    assert missing == [], f"in values.schema.json but not values.yaml: {missing}"


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        ({"role": "boss"}, "role"),
        ({"replicas": "two"}, "replicas"),
        ({"prometheusUrl": "prometheus:9090"}, "prometheusUrl"),
        ({"unknownKey": "1"}, "unknownKey"),
        ({"image.pullPolicy": "Sometimes"}, "pullPolicy"),
        ({"resources.requests.cpu": "lots"}, "cpu"),
        ({"watchNamespaces[0]": "Not_A_Namespace"}, "watchNamespaces"),
        ({"role": "hub", "watchNamespaces[0]": "apps"}, "watchNamespaces"),
        ({"replicas": "2", "leaderElection.enabled": "false"}, "replicas"),
        ({"leaderElection.retryPeriod": "12"}, "retryPeriod < renewDeadline < leaseDuration"),
        ({"hubAccess.subjects[0].kind": "Robot", "hubAccess.subjects[0].name": "r"}, "kind"),
        ({"hubAccess.subjects[0].kind": "User", "hubAccess.subjects[0].name": "u",
          "hubAccess.subjects[0].namespace": "x"}, "subjects"),
        ({"role": "spoke", "hubAccess.serviceAccount.create": "false"}, "hubAccess.enabled with no identity"),
        ({"hubAccess.propagateSecrets": "yes"}, "propagateSecrets"),
        ({"hub.interval": "0"}, "interval"),
        ({"hub.spokeWriteTimeout": "-1"}, "spokeWriteTimeout"),
        ({"hub.rampSeconds": "-1"}, "rampSeconds"),
        ({"hub.every": "1"}, "every"),
        ({"spoke.heartbeatInterval": "0"}, "heartbeatInterval"),
        ({"spoke.leaseDuration": "0"}, "leaseDuration"),
        ({"role": "spoke", "spoke.heartbeatInterval": "30", "spoke.leaseDuration": "30"},
         "need heartbeatInterval < leaseDuration"),
        ({"gateway.httpRoute.enabled": "true"}, "gateway.httpRoute.enabled needs gateway.httpRoute.parentRefs"),
        ({"gateway.httpRoute.hostnames[0]": "Bad_Host"}, "hostnames"),
        ({"gateway.httpRoute.parentRefs[0].name": "gw", "gateway.httpRoute.parentRefs[0].port": "80"}, "port"),
        ({"gateway.httpRoute.pathPrefixes[0]": "v1"}, "pathPrefixes"),
        ({"gateway.httpRoute.requestTimeout": "90"}, "requestTimeout"),
        ({"runtimeImage.tag": "no spaces"}, "tag"),
        ({"runtimeImage.repository": "ghcr.io/embedfleet/runtime:1"}, "repository"),
        ({"runtimeImage.repository": "docker.io/evil/runtime"},
         "runtimeImage: docker.io/evil/runtime:0.1.0 is not allowed by platform.allowedImages (ghcr.io/embedfleet/)"),
    ],
    ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None,
)
def test_helm_refuses_nonsense_values(sets: dict[str, str], says: str) -> None:
    args = ["template", "x", str(CHART)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    done = helm(*args, check=False)
    assert done.returncode != 0, done.stdout[:2000]
    assert says in done.stderr, done.stderr


# ---------------------------------------------------------------- what renders


@pytest.mark.parametrize(("name", "files", "sets"), CASES, ids=IDS)
def test_operator_pod_is_non_root_read_only_and_probed(name: str, files: list[Path], sets: dict[str, str]) -> None:
    objects = template(files, sets)
    deployment = operator_deployment(objects)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    container = operator_container(objects)
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    probe = container["livenessProbe"]["httpGet"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])
    assert f"--liveness=http://0.0.0.0:{port}{probe['path']}" in container["args"]
    # Readiness on the same server (operator/health.py serves both from process start, standbys included).
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": probe["port"]}
    assert probe["path"] != "/readyz"
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert pod["serviceAccountName"] == fullname("embedfleet")


@pytest.mark.parametrize(("name", "files", "sets"), CASES, ids=IDS)
def test_operator_args_are_accepted_by_the_cli(name: str, files: list[Path], sets: dict[str, str]) -> None:
    values = merged_values(files, sets)
    objects = template(files, sets, release="search", namespace="ops")
    container = operator_container(objects)
    assert container["command"] == ["embedfleet", "operator", "run"]
    parser = argparse.ArgumentParser()
    operator_cli.add_arguments(parser)
    args = parser.parse_args(["run", *container["args"]])
    assert args.role == values["role"]
    assert (args.namespaces or []) == values["watchNamespaces"]
    assert args.all_namespaces == (not values["watchNamespaces"])
    assert (args.prometheus_url or "") == values["prometheusUrl"]
    election = values["leaderElection"]
    assert args.leader_elect == election["enabled"]
    assert args.lease_duration == election["leaseDuration"] and args.retry_period == election["retryPeriod"]
    if election["enabled"]:
        # The Lease lives in the release namespace, one per release, and the chart's Role names it.
        assert args.leader_election_namespace == "ops"
        assert args.leader_election_id == "search-embedfleet-operator"
        leases = named(objects, "Role", "search-embedfleet-leases")
        names = {n for rule in leases["rules"] for n in rule.get("resourceNames", [])}
        assert args.leader_election_id in names
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "EMBEDFLEET_PULLER_CLUSTER_ROLE" not in env  # the operator binds no role any more
    assert {"POD_NAME", "POD_NAMESPACE"} <= env.keys()
    # Timing reaches the operator of its own role only, and only when set (else the operator's default).
    for (section, key), dest in TIMING.items():
        value = values[section][key] if section == values["role"] else None
        assert getattr(args, dest) == value, (section, key)


#: Chart value -> the `embedfleet operator run` argument it renders as (dest), for its role's operator only.
TIMING = {("hub", "interval"): "hub_interval", ("hub", "rampSeconds"): "hub_ramp_seconds",
          ("hub", "spokeWriteTimeout"): "spoke_write_timeout", ("spoke", "heartbeatInterval"): "heartbeat_interval",
          ("spoke", "leaseDuration"): "heartbeat_lease_duration"}
ALL_TIMING = {"hub.interval": "3", "hub.rampSeconds": "0", "hub.spokeWriteTimeout": "4",
              "spoke.heartbeatInterval": "2", "spoke.leaseDuration": "7"}


@pytest.mark.parametrize("role", ROLES)
def test_timing_values_render_as_flags_for_their_role_only(role: str) -> None:
    """Every timing value set: the hub's operator gets the hub's three flags, a spoke's the heartbeat's
    two, a standalone operator none; and the CLI exports them as the variables the loops read."""
    container = operator_container(template(sets={"role": role, **ALL_TIMING}))
    timing = sorted(a for a in container["args"] if a.startswith(("--hub-", "--spoke-", "--heartbeat-")))
    expected = {
        "hub": ["--hub-interval=3", "--hub-ramp-seconds=0", "--spoke-write-timeout=4"],
        "spoke": ["--heartbeat-interval=2", "--heartbeat-lease-duration=7"],
        "standalone": [],
    }[role]
    assert timing == expected
    parser = argparse.ArgumentParser()
    operator_cli.add_arguments(parser)
    exported = operator_cli.interval_env(parser.parse_args(["run", *container["args"]]))
    assert exported == {
        "hub": {"EMBEDFLEET_HUB_INTERVAL": "3", "EMBEDFLEET_HUB_RAMP_SECONDS": "0",
                "EMBEDFLEET_HUB_WRITE_TIMEOUT": "4"},
        "spoke": {"EMBEDFLEET_HEARTBEAT_INTERVAL": "2", "EMBEDFLEET_LEASE_DURATION": "7"},
        "standalone": {},
    }[role]


@pytest.mark.parametrize("role", ROLES)
def test_timing_left_empty_renders_no_flag(role: str) -> None:
    """The defaults are empty: the operator's own defaults apply (one home for them, the code that reads
    them), and an environment a test or a wrapper sets is not overridden by a chart default."""
    assert all(DEFAULTS[section][key] is None for section, key in TIMING)
    args = operator_container(template(sets={"role": role}))["args"]
    assert not [a for a in args if a.startswith(("--hub-", "--spoke-", "--heartbeat-"))]


def test_fractional_timing_renders_as_written(tmp_path: Path) -> None:
    """A values file's 0.5 reaches the flag as 0.5 (helm's --set would keep it a string, which the schema
    refuses: use -f or --set-json for fractions)."""
    values = tmp_path / "timing.yaml"
    values.write_text(yaml.safe_dump({"role": "hub", "hub": {"interval": 0.5, "spokeWriteTimeout": 2.5}}))
    args = operator_container(template([values]))["args"]
    assert "--hub-interval=0.5" in args and "--spoke-write-timeout=2.5" in args
    assert not [a for a in args if a.startswith("--hub-ramp-seconds")]


def test_role_region_and_namespaces_reach_the_operator() -> None:
    objects = template([CI_VALUES["spoke"]])
    args = operator_container(objects)["args"]
    assert "--role=spoke" in args and "--region=eu-west-1" in args and "--cloud=aws" in args
    assert "--namespace=embeddings" in args and "--namespace=search" in args
    # The gateway names its region on the requests it spills (x-embedfleet-spilled-from).
    gateway_args = gateway_deployment(objects)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--region=eu-west-1" in gateway_args and "--namespace=search" in gateway_args
    bindings = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["name"] == "embedfleet-namespaced"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["embeddings", "search"]
    assert not [b for b in by_kind(objects, "ClusterRoleBinding") if b["metadata"]["name"].endswith("-namespaced")]
    # Without a server to ask (helm template), every watched namespace renders, kept on uninstall.
    namespaces = by_kind(objects, "Namespace")
    assert sorted(n["metadata"]["name"] for n in namespaces) == ["embeddings", "search"]
    assert all(n["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for n in namespaces)
    assert not by_kind(template([CI_VALUES["spoke"]], {"createWatchNamespaces": "false"}), "Namespace")


def _runtime_image_env(objects: list[dict[str, Any]]) -> str:
    env = operator_container(objects)["env"]
    (value,) = [e["value"] for e in env if e["name"] == "EMBEDFLEET_DEFAULT_RUNTIME_IMAGE"]
    return value


def test_the_default_runtime_image_is_the_app_versions_unless_set() -> None:
    """EMBEDFLEET_DEFAULT_RUNTIME_IMAGE: runtimeImage.repository with runtimeImage.tag, or appVersion when the tag is
    empty (the default), so a chart upgrade moves deployments that name no image to its own runtime."""
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert DEFAULTS["runtimeImage"] == {"repository": "ghcr.io/embedfleet/runtime", "tag": ""}
    assert _runtime_image_env(template()) == f"ghcr.io/embedfleet/runtime:{app_version}"
    tagged = template(sets={"runtimeImage.tag": "0.2.0-rc1"})
    assert _runtime_image_env(tagged) == "ghcr.io/embedfleet/runtime:0.2.0-rc1"
    mirror = {"runtimeImage.repository": "mirror.example:5000/ml/runtime", "runtimeImage.tag": "v7",
              "platform.allowedImages[0]": "mirror.example:5000/ml/"}
    assert _runtime_image_env(template(sets=mirror)) == "mirror.example:5000/ml/runtime:v7"
    # The platform's allow-list governs the default too: the same rules as the operator's.
    exact = {"runtimeImage.tag": "v7", "platform.allowedImages[0]": "ghcr.io/embedfleet/runtime:v7"}
    assert _runtime_image_env(template(sets=exact)) == "ghcr.io/embedfleet/runtime:v7"
    repo = {"runtimeImage.tag": "v7", "platform.allowedImages[0]": "ghcr.io/embedfleet/runtime"}
    assert _runtime_image_env(template(sets=repo)) == "ghcr.io/embedfleet/runtime:v7"
    for allowed in ("ghcr.io/embedfleet", "ghcr.io/embedfleet/runtime:8", "ghcr.io/embedfleet/run"):
        done = helm("template", "x", str(CHART), "--set", f"platform.allowedImages[0]={allowed}", check=False)
        assert done.returncode != 0 and "is not allowed by platform.allowedImages" in done.stderr, allowed


@pytest.mark.parametrize(("files", "sets", "replicas"), [
    ([], {}, 1), ([], {"replicas": "2"}, 2), ([CI_VALUES["hub"]], {}, 2), ([CI_VALUES["spoke"]], {"replicas": "3"}, 3),
    ([], {"replicas": "0"}, 0)])
def test_operator_pdb_only_with_standbys(files: list[Path], sets: dict[str, str], replicas: int) -> None:
    """Several replicas (a leader and standbys): a PodDisruptionBudget keeps one through a drain, and never
    blocks evicting a replica that is not Ready. One replica: no budget (it would block every drain)."""
    objects = template(files, sets)
    deployment = operator_deployment(objects)
    assert deployment["spec"]["replicas"] == replicas
    budgets = [b for b in by_kind(objects, "PodDisruptionBudget")
               if b["metadata"]["labels"].get("app.kubernetes.io/component") != "gateway"]
    if replicas <= 1:
        assert budgets == []
        return
    (budget,) = budgets
    assert budget["metadata"]["name"] == deployment["metadata"]["name"]
    assert budget["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    # it takes the operator's pods and no other workload's
    for other in [*by_kind(objects, "DaemonSet"), *(d for d in by_kind(objects, "Deployment") if d is not deployment)]:
        assert not budget["spec"]["selector"]["matchLabels"].items() <= other["spec"]["template"]["metadata"][
            "labels"].items()


def test_without_leader_election_one_replica_is_replaced_not_rolled() -> None:
    objects = template(sets={"leaderElection.enabled": "false"})
    deployment = operator_deployment(objects)
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "--no-leader-elect" in operator_container(objects)["args"]
    assert not [r for r in by_kind(objects, "Role") if r["metadata"]["name"].endswith("-leases")]
    hub = operator_deployment(template([CI_VALUES["hub"]]))
    assert hub["spec"]["replicas"] == 2 and "strategy" not in hub["spec"]


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
        assert granted.get(("", "nodes"), set()) == {"list"}  # cache status: read the agents' labels
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


def _agent_container(objects: list[dict[str, Any]]) -> Mapping[str, Any]:
    (ds,) = by_kind(objects, "DaemonSet")
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    return agent


@pytest.mark.parametrize("role", ["standalone", "spoke"])
def test_node_agent_is_probed_on_its_heartbeat_files(role: str, tmp_path: Path) -> None:
    """The agent serves no port: exec probes read the files it keeps in --health-dir on its /tmp emptyDir.
    The liveness command, run here as the kubelet runs it, passes on a fresh `alive`, fails on one older
    than nodeAgent.stuckSeconds and on none at all; readiness is the `ready` file."""
    from embedfleet.operator.cache import cli as cache_cli

    agent = _agent_container(template([CI_VALUES[role]], {"nodeAgent.stuckSeconds": "120"}))
    parser = argparse.ArgumentParser()
    cache_cli.add_arguments(parser)
    args = parser.parse_args(["agent", *agent["args"]])
    assert args.health_dir == Path("/tmp/health") and not args.once
    assert any(m["mountPath"] == "/tmp" for m in agent["volumeMounts"])  # the emptyDir, writable
    assert agent["readinessProbe"]["exec"]["command"] == ["test", "-e", "/tmp/health/ready"]
    live = agent["livenessProbe"]
    assert live["failureThreshold"] * live["periodSeconds"] < 120  # the file's age is the real bound
    command = [part.replace("/tmp/health", str(tmp_path)) for part in live["exec"]["command"]]
    assert command[:2] == ["sh", "-c"]
    alive = tmp_path / "alive"

    def probe() -> int:
        return subprocess.run(command, capture_output=True, timeout=10).returncode

    assert probe() != 0  # no heartbeat yet
    alive.touch()
    assert probe() == 0
    old = time.time() - 121
    os.utime(alive, (old, old))
    assert probe() != 0
    default = _agent_container(template([CI_VALUES[role]]))["livenessProbe"]["exec"]["command"][-1]
    assert default.endswith(f"-lt {DEFAULTS['nodeAgent']['stuckSeconds']}")


@pytest.mark.parametrize(("name", "files", "sets"), CASES, ids=IDS)
def test_no_workload_uses_the_deprecated_master_node_label(name: str, files: list[Path], sets: dict[str, str]) -> None:
    """node-role.kubernetes.io/master is gone from Kubernetes (control-plane replaced it): no pod template
    selects or avoids nodes by it. (The admission policy still refuses tenants' selectors on that key, as the
    operator does, so a node that carries it stays off limits.)"""
    for obj in template(files, sets):
        if obj["kind"] != "ValidatingAdmissionPolicy":
            assert "node-role.kubernetes.io/master" not in json.dumps(obj), (obj["kind"], obj["metadata"]["name"])


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


def route_values(tmp_path: Path, **route: Any) -> Path:
    """A values file turning the HTTPRoute on with `route` (lists of maps are awkward with --set)."""
    path = tmp_path / f"route-values-{len(list(tmp_path.glob('route-values-*')))}.yaml"
    path.write_text(yaml.safe_dump({"gateway": {"httpRoute": {"enabled": True, **route}}}))
    return path


SHARED_GATEWAY = [{"name": "shared", "namespace": "gateway-infra", "sectionName": "https"}, {"name": "local"}]


@pytest.mark.parametrize(("name", "files", "sets"), CASES, ids=IDS)
def test_no_httproute_unless_asked(name: str, files: list[Path], sets: dict[str, str]) -> None:
    """Off by default: a cluster without the Gateway API CRDs installs the chart as before."""
    assert DEFAULTS["gateway"]["httpRoute"]["enabled"] is False
    assert not by_kind(template(files, sets), "HTTPRoute")


@pytest.mark.parametrize("role", ["standalone", "spoke"])
def test_httproute_attaches_to_the_gateways_and_routes_to_the_gateway_service(tmp_path: Path, role: str) -> None:
    values = route_values(tmp_path, parentRefs=SHARED_GATEWAY, hostnames=["embed.example.com", "*.ml.example.com"])
    objects = template([CI_VALUES[role], values], {"gateway.service.port": "8081"}, release="search",
                       namespace="ops")
    (route,) = by_kind(objects, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["metadata"]["namespace"] == "ops"
    service = named(objects, "Service", "search-embedfleet-gateway")
    assert route["metadata"]["name"] == service["metadata"]["name"]
    spec = route["spec"]
    assert spec["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "shared", "namespace": "gateway-infra",
         "sectionName": "https"},
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "local"},
    ]
    assert spec["hostnames"] == ["embed.example.com", "*.ml.example.com"]
    (rule,) = spec["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    (backend,) = rule["backendRefs"]
    (port,) = service["spec"]["ports"]
    assert backend == {"group": "", "kind": "Service", "name": service["metadata"]["name"], "port": port["port"]}
    assert port["port"] == 8081
    assert "timeouts" not in rule

    narrow = template([route_values(tmp_path, parentRefs=[{"name": "gw"}], pathPrefixes=["/v1", "/rerank"],
                                    requestTimeout="90s")], {"role": role})
    (route,) = by_kind(narrow, "HTTPRoute")
    assert "hostnames" not in route["spec"]
    (rule,) = route["spec"]["rules"]
    assert [m["path"]["value"] for m in rule["matches"]] == ["/v1", "/rerank"]
    assert rule["timeouts"] == {"request": "90s"}


def test_httproute_needs_parent_refs(tmp_path: Path) -> None:
    done = helm("template", "x", str(CHART), "-f", str(route_values(tmp_path, hostnames=["a.example.com"])),
                check=False)
    assert done.returncode != 0
    assert "gateway.httpRoute.enabled needs gateway.httpRoute.parentRefs" in done.stderr, done.stderr


def test_httproute_only_where_the_gateway_runs(tmp_path: Path) -> None:
    """A hub runs no gateway, so it renders no route (even with the route on and no parentRefs); neither
    does a cluster with the gateway turned off."""
    values = route_values(tmp_path, parentRefs=[{"name": "gw"}])
    assert not by_kind(template([CI_VALUES["hub"], values]), "HTTPRoute")
    assert not by_kind(template([CI_VALUES["hub"], route_values(tmp_path)]), "HTTPRoute")
    assert not by_kind(template([values], {"gateway.enabled": "false"}), "HTTPRoute")
    assert len(by_kind(template([values]), "HTTPRoute")) == 1


def test_httproute_values_schema_follows_the_gateway_api(tmp_path: Path) -> None:
    """The values schema refuses what the pinned Gateway API's HTTPRoute CRD refuses, with its own patterns
    and limits (so a bump of the pin that changes them shows here)."""
    (version,) = [v for v in gateway_api.crd("httproutes")["spec"]["versions"] if v["name"] == "v1"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    ours = SCHEMA["properties"]["gateway"]["properties"]["httpRoute"]["properties"]
    hostname = spec["hostnames"]["items"]
    assert (ours["hostnames"]["items"]["pattern"], ours["hostnames"]["items"]["maxLength"]) == (
        hostname["pattern"], hostname["maxLength"])
    assert ours["hostnames"]["maxItems"] == spec["hostnames"]["maxItems"]
    parent = spec["parentRefs"]["items"]["properties"]
    for key in ("name", "namespace", "sectionName"):
        theirs = {k: parent[key][k] for k in ("pattern", "minLength", "maxLength") if k in parent[key]}
        assert {k: ours["parentRefs"]["items"]["properties"][key].get(k) for k in theirs} == theirs, key
    assert ours["parentRefs"]["maxItems"] == spec["parentRefs"]["maxItems"]
    timeout = spec["rules"]["items"]["properties"]["timeouts"]["properties"]["request"]["pattern"]
    assert ours["requestTimeout"]["pattern"] == f"^$|{timeout}"


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


def test_two_releases_never_share_an_object() -> None:
    """Cluster-scoped names carry the release; two releases in one namespace share no namespaced name."""
    seen: dict[tuple[str, str, str], str] = {}
    for release, namespace in (("a", "team"), ("b", "team"), ("c", "other")):
        for role in ROLES:
            for obj in template([CI_VALUES[role]], release=release, namespace=namespace):
                if obj["kind"] == "Namespace":
                    continue  # shared on purpose: whoever created it owns it (see namespaces.yaml)
                key = (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
                owner = f"{release}/{role}"
                assert seen.setdefault(key, release) == release, f"{key} rendered by {seen[key]} and {owner}"


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


# ---------------------------------------------------------------- CRDs and notes


def test_chart_crds_equal_the_generated_ones() -> None:
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    packaged = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert generated and packaged == generated, "run: cp crds/*.yaml charts/embedfleet/crds/"
    _, mismatch, errors = filecmp.cmpfiles(ROOT / "crds", CHART / "crds", generated, shallow=False)
    assert mismatch == [] and errors == [], "run: cp crds/*.yaml charts/embedfleet/crds/"


def test_crds_only_under_crds_dir() -> None:
    """Helm installs crds/ before rendering templates; a CRD among the templates (and an object of it in
    the same pass) is what a real install refuses."""
    for _, files, sets in CASES:
        assert not by_kind(template(files, sets), "CustomResourceDefinition")
    shown = helm("show", "crds", str(CHART)).stdout
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(shown) if d}
    assert names == {yaml.safe_load(p.read_text())["metadata"]["name"] for p in (CHART / "crds").glob("*.yaml")}


@pytest.mark.parametrize("role", ROLES)
def test_notes_render(role: str) -> None:
    done = helm("install", "embedfleet", str(CHART), "-n", "embedfleet-system", "--dry-run=client",
                "-f", str(CI_VALUES[role]))
    notes = done.stdout.split("NOTES:", 1)[1]
    assert f"role:        {role}" in notes
    assert "Lease embedfleet-system/embedfleet-operator" in notes
    assert "kubectl apply --server-side --force-conflicts -f charts/embedfleet/crds/" in notes
    assert ("create token embedfleet-hub" in notes) == (role == "spoke")


def test_release_name_shapes_the_object_names() -> None:
    deployment = operator_deployment(template(release="search"))
    assert deployment["metadata"]["name"] == "search-embedfleet"
    long = template(release="x" * 53)  # helm allows 53
    assert all(len(o["metadata"]["name"]) <= 63 for o in long
               if o["kind"] in ("Deployment", "ServiceAccount", "DaemonSet"))


# ---------------------------------------------------------------- judged by the API server


@pytest.fixture
def crds(kube_cluster: Cluster) -> Cluster:
    install_crds(kube_cluster)
    return kube_cluster


@pytest.mark.parametrize(("name", "files", "sets"), CASES, ids=IDS)
def test_every_object_passes_server_side_dry_run(crds: Cluster, unique: str, name: str, files: list[Path],
                                                 sets: dict[str, str]) -> None:
    """What the API server says about every rendered object (schema, unknown fields, RBAC escalation
    checks on roles and bindings), without creating anything. A dry run cannot create a namespace for
    the next object, so the release namespace and any watched namespaces exist first."""
    cluster = crds
    namespace = f"dry-{unique}"
    sets = dict(sets)
    values = merged_values(files, sets)
    watched = [f"{ns}-{unique}" for ns in values["watchNamespaces"]]
    for i, ns in enumerate(watched):
        sets[f"watchNamespaces[{i}]"] = ns
    for ns in [namespace, *watched]:
        cluster.kubectl("create", "namespace", ns)
    text = template_text(files, sets, release=f"dry-{unique}", namespace=namespace)
    done = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=text, check=False)
    assert done.returncode == 0, done.stderr
    applied = [line for line in done.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(applied) == len([d for d in yaml.safe_load_all(text) if d])
    cluster.kubectl("delete", "namespace", namespace, *watched, "--wait=false")


def test_dry_run_catches_what_helm_template_lets_through(crds: Cluster, unique: str) -> None:
    """The check above is real: a field the API does not know fails it."""
    text = template_text(release=f"typo-{unique}", namespace="default")
    indent = "\n" + " " * 12
    broken = text.replace("readOnlyRootFilesystem: true", f"readOnlyRootFilesystem: true{indent}readOnlyRootFS: true")
    assert broken != text
    done = crds.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=broken, check=False)
    assert done.returncode != 0 and "readOnlyRootFS" in done.stderr


def _rendered_route(tmp_path: Path, release: str, namespace: str, **route: Any) -> dict[str, Any]:
    (found,) = by_kind(template([route_values(tmp_path, **route)], release=release, namespace=namespace),
                       "HTTPRoute")
    return dict(found)


def test_httproute_is_accepted_by_the_api_server(kube_cluster: Cluster, unique: str, tmp_path: Path) -> None:
    """The rendered HTTPRoute, applied for real (server-side apply, strict field validation) against the
    pinned Gateway API CRDs, attached to a Gateway in another namespace: the server accepts it and keeps
    what the chart wrote. No Gateway controller runs on the test control plane, so nobody reconciles the
    Gateway or the route: no `Accepted` / `ResolvedRefs` conditions appear and none are asserted; what a
    real Gateway does with the route is not verified here."""
    cluster = kube_cluster
    gateway_api.install(cluster)
    namespace, infra, klass = f"route-{unique}", f"infra-{unique}", f"embedfleet-test-{unique}"
    for ns in (namespace, infra):
        cluster.kubectl("create", "namespace", ns)
    try:
        cluster.apply(
            {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass", "metadata": {"name": klass},
             "spec": {"controllerName": "example.com/no-controller-runs"}},
            {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
             "metadata": {"name": "shared", "namespace": infra},
             "spec": {"gatewayClassName": klass, "listeners": [
                 {"name": "http", "protocol": "HTTP", "port": 80, "allowedRoutes": {"namespaces": {"from": "All"}}}]}},
        )
        route = _rendered_route(tmp_path, f"r-{unique}", namespace,
                                parentRefs=[{"name": "shared", "namespace": infra, "sectionName": "http"}],
                                hostnames=["embed.example.com"], pathPrefixes=["/v1", "/embed"],
                                requestTimeout="90s")
        done = cluster.kubectl("apply", "--server-side", "--validate=strict", "-f", "-",
                               input=json.dumps(route), check=False)
        assert done.returncode == 0, done.stderr
        stored = cluster.get_json("httproute.gateway.networking.k8s.io", route["metadata"]["name"], "-n", namespace)
        assert stored["spec"]["parentRefs"] == route["spec"]["parentRefs"]
        assert stored["spec"]["hostnames"] == ["embed.example.com"]
        (rule,) = stored["spec"]["rules"]
        assert rule["matches"] == route["spec"]["rules"][0]["matches"]
        (backend,) = rule["backendRefs"]
        assert backend.items() >= route["spec"]["rules"][0]["backendRefs"][0].items()
        assert backend["weight"] == 1  # the CRD's default: the server applied the real schema
        assert rule["timeouts"] == {"request": "90s"}
        assert not (stored.get("status") or {}).get("parents")  # no controller: nobody wrote status
    finally:
        cluster.kubectl("delete", "gatewayclass.gateway.networking.k8s.io", klass, "--wait=false",
                        "--ignore-not-found")
        cluster.kubectl("delete", "namespace", namespace, infra, "--wait=false")


def _break(route: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """A copy of `route` with the field at the dotted path (list indexes as numbers) set to `value`."""
    out = json.loads(json.dumps(route))
    *parents, last = field.split(".")
    node: Any = out
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(last) if last.isdigit() else last] = value
    return out


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("spec.rules.0.backendRefs.0.port", 70000, "backendRefs[0].port"),
        ("spec.hostnames.0", "Embed_Host.example.com", "hostnames[0]"),
        ("spec.rules.0.timeouts.request", "90 seconds", "timeouts.request"),
        ("spec.rules.0.matches.0.path.type", "Prefix", "path.type"),
    ],
    ids=["backend-port-out-of-range", "bad-hostname", "bad-duration", "unknown-match-type"],
)
def test_api_server_refuses_a_broken_httproute(kube_cluster: Cluster, unique: str, tmp_path: Path, field: str,
                                               value: Any, says: str) -> None:
    """The check above can fail: the same route with one field the Gateway API forbids is refused
    (dry run, nothing created), naming the field; unbroken, the same dry run passes."""
    gateway_api.install(kube_cluster, ("httproutes",))
    route = _rendered_route(tmp_path, f"b-{unique}", "default", parentRefs=[{"name": "gw"}],
                            hostnames=["embed.example.com"], requestTimeout="90s")

    def dry_run(obj: dict[str, Any]) -> Any:
        return kube_cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-",
                                    input=json.dumps(obj), check=False)

    assert dry_run(route).returncode == 0
    done = dry_run(_break(route, field, value))
    assert done.returncode != 0, done.stdout
    assert "is invalid" in done.stderr and says in done.stderr, done.stderr
