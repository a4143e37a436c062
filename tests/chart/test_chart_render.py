"""The chart rendered by the real `helm` (lint, template, the values schema as helm applies it) and every
rendered object judged by a real API server (`kubectl apply --dry-run=server --validate=strict`).

RBAC and the locked-down workloads: test_chart_render_security.py; the gateway's HTTPRoute:
test_chart_render_httproute.py."""

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
from tests.chart.render_helpers import CASES, IDS, merged_values
from tests.kube.controlplane import ROOT, Cluster

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
