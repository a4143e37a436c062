"""The Helm chart, checked without helm.

Every values file must satisfy values.schema.json; every template is rendered by Go's real
text/template + sprig (py-go-template, in a child process) with `_helpers.tpl` prepended (Helm shares
`define`s across files the same way) and `.Release`/`.Chart`/`.Capabilities` supplied here; the YAML
must parse and every Kubernetes object must deserialize into the `kubernetes` client's model with no
unknown field.
"""

from __future__ import annotations

import argparse
import copy
import filecmp
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes
import pytest
import yaml

from embedfleet.operator import cli as operator_cli

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "embedfleet"
TEMPLATES = CHART / "templates"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
ROLES = ("standalone", "spoke", "hub")
PULLER_CLUSTER_ROLE = "embedfleet-cache-puller"  # the operator's render.PULLER_CLUSTER_ROLE
API = kubernetes.client.ApiClient()


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's rule: maps merge key by key, everything else (lists included) is replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def context(
    values: dict[str, Any], release: str = "embedfleet", namespace: str = "embedfleet-system"
) -> dict[str, Any]:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return {
        "Values": values,
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm", "IsInstall": True,
                    "IsUpgrade": False, "Revision": 1},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
        "Capabilities": {"KubeVersion": {"Version": "v1.30.0", "Major": "1", "Minor": "30"},
                         "APIVersions": ["apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1"]},
    }


# Go's renderer calls os.Exit on a template error, so it runs in a child process: a broken template then
# fails one test with Go's message instead of killing the test session.
_RENDERER = """
import json, sys
from pathlib import Path
from go_template import render
job = json.load(sys.stdin)
sys.stdout.write(json.dumps([render(Path(p), job["context"]).decode() for p in job["paths"]]))
"""


def render_templates(names: list[str], ctx: dict[str, Any]) -> list[str]:
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name in names:
            path = Path(tmp) / name
            path.write_text(helpers + (TEMPLATES / name).read_text())
            paths.append(str(path))
        job = json.dumps({"paths": paths, "context": ctx})
        proc = subprocess.run([sys.executable, "-c", _RENDERER], input=job, capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == 0, f"render failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    return list(json.loads(proc.stdout))


def render_template(name: str, ctx: dict[str, Any]) -> str:
    return render_templates([name], ctx)[0]


def render_chart(values: dict[str, Any], **kw: str) -> list[dict[str, Any]]:
    names = sorted(p.name for p in TEMPLATES.glob("*.yaml"))
    objects: list[dict[str, Any]] = []
    for text in render_templates(names, context(values, **kw)):
        objects += [doc for doc in yaml.safe_load_all(text) if doc is not None]
    return objects


def _unknown_keys(sent: Any, kept: Any, path: str = "") -> list[str]:
    """Keys present in the manifest that the typed model dropped: typos and wrong nesting."""
    problems: list[str] = []
    if isinstance(sent, dict):
        kept = kept if isinstance(kept, dict) else {}
        for key, value in sent.items():
            if key not in kept:
                problems.append(f"{path}.{key}")
            else:
                problems += _unknown_keys(value, kept[key], f"{path}.{key}")
    elif isinstance(sent, list):
        kept = kept if isinstance(kept, list) else []
        for i, value in enumerate(sent):
            problems += _unknown_keys(value, kept[i] if i < len(kept) else None, f"{path}[{i}]")
    return problems


def validate_object(obj: dict[str, Any]) -> None:
    """Deserialize into the client's model (required fields, types) and refuse unknown fields."""
    group_version, kind = obj["apiVersion"], obj["kind"]
    if group_version.startswith("kopf.dev/"):
        assert obj["metadata"]["name"]
        return
    model = API.deserialize(json.dumps(obj), f"V1{kind}", "application/json")
    kept = API.sanitize_for_serialization(model)
    assert _unknown_keys(obj, kept) == [], f"{kind} {obj['metadata']['name']}: unknown fields"


def values_files() -> list[tuple[str, dict[str, Any]]]:
    files = [("values.yaml", DEFAULTS)]
    files += [(f"ci/{p.name}", deep_merge(DEFAULTS, yaml.safe_load(p.read_text()) or {})) for p in CI_VALUES]
    files += [(f"role={role}", deep_merge(DEFAULTS, {"role": role})) for role in ROLES]
    return files


VALUES = values_files()
IDS = [name for name, _ in VALUES]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


# ---------------------------------------------------------------- values


@pytest.mark.parametrize(("name", "values"), VALUES, ids=IDS)
def test_values_validate_against_schema(name: str, values: dict[str, Any]) -> None:
    jsonschema.validate(values, SCHEMA)


def test_ci_values_cover_every_role() -> None:
    roles = {(yaml.safe_load(p.read_text()) or {}).get("role") for p in CI_VALUES}
    assert roles == set(ROLES)


@pytest.mark.parametrize(
    "override",
    [{"role": "boss"}, {"replicas": "two"}, {"prometheusUrl": "prometheus:9090"}, {"unknownKey": 1},
     {"image": {"pullPolicy": "Sometimes"}}, {"resources": {"requests": {"cpu": "lots"}}},
     {"watchNamespaces": ["Not_A_Namespace"]}],
)
def test_schema_rejects_nonsense(override: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(deep_merge(DEFAULTS, override), SCHEMA)


# ---------------------------------------------------------------- rendering


@pytest.mark.parametrize(("name", "values"), VALUES, ids=IDS)
def test_every_object_renders_and_matches_the_kubernetes_models(name: str, values: dict[str, Any]) -> None:
    objects = render_chart(values)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds
    for obj in objects:
        validate_object(obj)


def test_validator_catches_typos_and_missing_required_fields() -> None:
    (deployment,) = by_kind(render_chart(DEFAULTS), "Deployment")
    typo = copy.deepcopy(deployment)
    pod = typo["spec"]["template"]["spec"]
    pod["securityContxt"] = pod.pop("securityContext")
    with pytest.raises(AssertionError, match="unknown fields"):
        validate_object(typo)
    no_selector = copy.deepcopy(deployment)
    del no_selector["spec"]["selector"]
    with pytest.raises(ValueError, match="selector"):
        validate_object(no_selector)


def test_missing_value_is_an_error_not_an_empty_string() -> None:
    """The renderer is stricter than Helm: a typo'd or removed key fails loudly."""
    values = copy.deepcopy(DEFAULTS)
    del values["livenessPort"]
    with pytest.raises(AssertionError, match="livenessPort"):
        render_chart(values)


@pytest.mark.parametrize(("name", "values"), VALUES, ids=IDS)
def test_operator_pod_is_non_root_read_only_and_probed(name: str, values: dict[str, Any]) -> None:
    (deployment,) = by_kind(render_chart(values), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    probe = container["livenessProbe"]["httpGet"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])
    assert f"--liveness=http://0.0.0.0:{port}{probe['path']}" in container["args"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod.get("labels", {}).items() or \
        deployment["spec"]["selector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize(("name", "values"), VALUES, ids=IDS)
def test_operator_args_are_accepted_by_the_cli(name: str, values: dict[str, Any]) -> None:
    (deployment,) = by_kind(render_chart(values), "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["embedfleet", "operator", "run"]
    parser = argparse.ArgumentParser()
    operator_cli.add_arguments(parser)
    args = parser.parse_args(["run", *container["args"]])
    assert args.role == values["role"]
    assert (args.namespaces or []) == values["watchNamespaces"]
    assert args.all_namespaces == (not values["watchNamespaces"])
    assert (args.prometheus_url or "") == values["prometheusUrl"]
    assert (args.peering is not None) == values["peering"]["enabled"]


def test_role_and_region_reach_the_operator() -> None:
    values = deep_merge(DEFAULTS, yaml.safe_load((CHART / "ci" / "spoke-values.yaml").read_text()))
    objects = render_chart(values)
    (deployment,) = by_kind(objects, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--role=spoke" in args and "--region=eu-west-1" in args and "--cloud=aws" in args
    assert "--namespace=embeddings" in args and "--namespace=search" in args
    # Namespaced rules are bound only in the watched namespaces.
    bindings = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["name"].endswith("-namespaced")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["embeddings", "search"]
    # A spoke also renews its heartbeat Lease, in its own namespace only.
    (heartbeat,) = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["name"].endswith("-heartbeat")]
    assert heartbeat["roleRef"]["kind"] == "Role"
    cluster_bindings = by_kind(objects, "ClusterRoleBinding")
    assert all(not b["metadata"]["name"].endswith("-namespaced") for b in cluster_bindings)


def test_peering_installs_kopf_peering_for_several_replicas() -> None:
    values = deep_merge(DEFAULTS, yaml.safe_load((CHART / "ci" / "hub-values.yaml").read_text()))
    objects = render_chart(values)
    (peering,) = by_kind(objects, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == values["peering"]["name"]
    crd_names = {c["metadata"]["name"] for c in by_kind(objects, "CustomResourceDefinition")}
    assert "clusterkopfpeerings.kopf.dev" in crd_names
    (deployment,) = by_kind(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2 and "strategy" not in deployment["spec"]
    single = by_kind(render_chart(DEFAULTS), "Deployment")[0]
    assert single["spec"]["strategy"]["type"] == "Recreate"  # no overlap without peering


# ---------------------------------------------------------------- RBAC


@pytest.mark.parametrize(("name", "values"), VALUES, ids=IDS)
def test_rbac_has_no_wildcards(name: str, values: dict[str, Any]) -> None:
    roles = [o for o in render_chart(values) if o["kind"] in ("ClusterRole", "Role")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert "*" not in rule.get(key, []), f"{role['metadata']['name']}: wildcard in {key}"
            assert rule["verbs"] and rule["resources"]
            assert not {"escalate", "impersonate"} & set(rule["verbs"])


def test_rbac_grants_what_the_operator_does_and_little_else() -> None:
    objects = render_chart(DEFAULTS)
    rules = {
        o["metadata"]["name"]: {(g, r): set(rule["verbs"]) for rule in o["rules"]
                                for g in rule["apiGroups"] for r in rule["resources"]}
        for o in by_kind(objects, "ClusterRole")
    }
    ns = rules["embedfleet-namespaced"]
    assert ns[("embedfleet.dev", "embeddingdeployments")] >= {"get", "list", "watch", "patch"}
    assert ns[("embedfleet.dev", "embeddingdeployments/status")] >= {"patch"}
    assert ns[("apps", "deployments")] == {"get", "list", "create", "patch", "delete"}
    assert ns[("", "events")] == {"create"}
    assert ns[("", "pods")] == {"get", "list"}
    assert ("", "secrets") not in ns  # the operator never reads secrets
    cluster = rules["embedfleet-cluster"]
    assert ("", "nodes") not in cluster  # node labels are written by the puller, not the operator
    (bind_rule,) = [r for r in by_kind(objects, "ClusterRole")[0]["rules"] if "bind" in r["verbs"]]
    assert bind_rule["resourceNames"] == [PULLER_CLUSTER_ROLE] and bind_rule["verbs"] == ["bind"]
    assert rules[PULLER_CLUSTER_ROLE] == {("", "nodes"): {"get", "patch"}}
    # Every binding points at a role this chart defines, for the chart's own ServiceAccount.
    (sa,) = by_kind(objects, "ServiceAccount")
    for binding in by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding"):
        assert binding["roleRef"]["name"] in rules
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                        "namespace": "embedfleet-system"}]


def test_puller_cluster_role_name_matches_the_renderer() -> None:
    render = pytest.importorskip("embedfleet.operator.render")
    assert render.PULLER_CLUSTER_ROLE == PULLER_CLUSTER_ROLE


# ---------------------------------------------------------------- CRDs, notes, naming


def test_chart_crds_equal_the_generated_ones() -> None:
    generated = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    packaged = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert generated and packaged == generated, "run: cp crds/*.yaml charts/embedfleet/crds/"
    _, mismatch, errors = filecmp.cmpfiles(REPO / "crds", CHART / "crds", generated, shallow=False)
    assert mismatch == [] and errors == [], "run: cp crds/*.yaml charts/embedfleet/crds/"
    for path in (CHART / "crds").glob("*.yaml"):
        validate_object(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize(("name", "values"), VALUES, ids=IDS)
def test_notes_render(name: str, values: dict[str, Any]) -> None:
    notes = render_template("NOTES.txt", context(values))
    assert f"role:        {values['role']}" in notes
    assert "kubectl get embeddingdeployments" in notes


def test_release_name_shapes_the_object_names() -> None:
    objects = render_chart(DEFAULTS, release="search")
    (deployment,) = by_kind(objects, "Deployment")
    assert deployment["metadata"]["name"] == "search-embedfleet"
    assert deployment["metadata"]["namespace"] == "embedfleet-system"
    long = render_chart(DEFAULTS, release="x" * 70)
    assert all(len(o["metadata"]["name"]) <= 63 for o in long if o["kind"] == "Deployment")


def test_templates_stay_in_the_renderable_subset() -> None:
    """Helm-only functions would render under helm but not here; keep them out (see the chart README)."""
    forbidden = re.compile(r"\{\{-?\s*(include|tpl|required|lookup)\b|\.Files\.")
    for path in [*TEMPLATES.glob("*.yaml"), *TEMPLATES.glob("*.tpl"), TEMPLATES / "NOTES.txt"]:
        assert not forbidden.search(path.read_text()), path.name
