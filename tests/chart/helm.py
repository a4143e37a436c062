"""The chart as the real `helm` sees it: render, read values, and look at what a render or a release holds.

Rendering never needs a cluster (`helm template` with the chart's own defaults for `.Capabilities`); the
tests that install, upgrade and uninstall use `Cluster.helm` from the test control plane.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.controlplane import ROOT, Cluster, missing_reason, tools_dir

CHART = ROOT / "charts" / "embedfleet"
ROLES = ("standalone", "spoke", "hub")
CI_VALUES = {role: CHART / "ci" / f"{role}-values.yaml" for role in ROLES}
DEFAULTS: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
#: The chart's CRDs, in the order a server needs none of them first.
CRD_FILES = sorted((CHART / "crds").glob("*.yaml"))
#: No outbound traffic from a test: the spoke's ci values name an in-cluster Prometheus; runs that start
#: the operator leave it empty, so the autoscaler scrapes pods (none answer) instead of resolving a name.
NO_PROMETHEUS = {"prometheusUrl": ""}


def helm_bin() -> Path:
    tools = tools_dir()
    if tools is None:
        pytest.skip(missing_reason() or "helm is not built")
    return tools / "bin" / "helm"


def helm(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """`helm` with no cluster: lint, template, show. Its caches live in a throw-away folder."""
    with tempfile.TemporaryDirectory(prefix="helm-") as home:
        env = {**os.environ, "HELM_CACHE_HOME": f"{home}/cache", "HELM_CONFIG_HOME": f"{home}/config",
               "HELM_DATA_HOME": f"{home}/data", "KUBECONFIG": f"{home}/none"}
        done = subprocess.run([str(helm_bin()), *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr.strip()}")
    return done


def value_args(values: Iterable[Path] = (), sets: Mapping[str, str] | None = None) -> list[str]:
    args: list[str] = []
    for path in values:
        args += ["-f", str(path)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


def template(values: Iterable[Path] = (), sets: Mapping[str, str] | None = None, release: str = "embedfleet",
             namespace: str = "embedfleet-system") -> list[dict[str, Any]]:
    """`helm template`: the objects one release would create (CRDs excluded, as in an install's manifest)."""
    out = helm("template", release, str(CHART), "-n", namespace, *value_args(values, sets)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def template_text(values: Iterable[Path] = (), sets: Mapping[str, str] | None = None, release: str = "embedfleet",
                  namespace: str = "embedfleet-system") -> str:
    return helm("template", release, str(CHART), "-n", namespace, *value_args(values, sets)).stdout


def by_kind(objects: Iterable[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: Iterable[Mapping[str, Any]], kind: str, name: str) -> Mapping[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def fullname(release: str) -> str:
    return release if "embedfleet" in release else f"{release}-embedfleet"


def operator_deployment(objects: Iterable[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The operator's Deployment (the chart also renders the gateway's)."""
    (deployment,) = [d for d in by_kind(objects, "Deployment")
                     if d["metadata"]["labels"].get("app.kubernetes.io/component") != "gateway"]
    return deployment


def gateway_deployment(objects: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    found = [d for d in by_kind(objects, "Deployment")
             if d["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"]
    return found[0] if found else None


def operator_container(objects: Iterable[Mapping[str, Any]]) -> Mapping[str, Any]:
    (container,) = operator_deployment(objects)["spec"]["template"]["spec"]["containers"]
    return container


# ---------------------------------------------------------------- on a cluster


def install_crds(cluster: Cluster) -> None:
    """The chart's crds/ as `helm install` would create them (server-side apply), Established."""
    for path in CRD_FILES:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    for path in CRD_FILES:
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")


def release_manifest(cluster: Cluster, release: str, namespace: str) -> list[dict[str, Any]]:
    out = cluster.helm("get", "manifest", release, "-n", namespace).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def live(cluster: Cluster, obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The object as the server has it now, or None."""
    meta = obj["metadata"]
    group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
    resource = f"{obj['kind'].lower()}.{group}" if group else obj["kind"].lower()
    args = [resource, meta["name"]]
    if meta.get("namespace"):
        args += ["-n", meta["namespace"]]
    return cluster.get_json(*args)


def rights(cluster: Cluster, user: str, namespace: str) -> set[tuple[str, str, str]]:
    """(resource.group[/subresource], resourceName or '', verb) that RBAC grants `user` in `namespace`
    (cluster-wide rules included), as a SelfSubjectRulesReview made as that user reports it, minus what
    every authenticated identity holds (self-reviews, discovery)."""

    def review(who: str) -> set[tuple[str, str, str]]:
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
                "spec": {"namespace": namespace}}
        out = cluster.kubectl("create", "--validate=false", f"--as={who}", "-o", "json", "-f", "-",
                              input=json.dumps(body)).stdout
        found = set()
        for rule in json.loads(out)["status"].get("resourceRules") or []:
            for group in rule.get("apiGroups") or [""]:
                for resource in rule.get("resources") or []:
                    base, _, sub = resource.partition("/")
                    qualified = (f"{base}.{group}" if group else base) + (f"/{sub}" if sub else "")
                    for name in rule.get("resourceNames") or [""]:
                        for verb in rule["verbs"]:
                            found.add((qualified, name, verb))
        return found

    return review(user) - review(f"system:serviceaccount:{namespace}:nobody-at-all")
