"""Tenants on the real control plane: a namespace editor, the platform's allow-lists, and who is refused.

A tenant here is what a platform team hands a product team: a user bound to Kubernetes' built-in
``edit`` ClusterRole in one namespace and nothing else (``kubectl --as``). The chart's aggregated roles
must let that user create EmbeddingDeployments there and nowhere else; the chart's
ValidatingAdmissionPolicy must refuse every spec outside the platform's allow-lists at ``kubectl
apply`` with the field and the reason; with that policy switched off, the operator must refuse the same
specs (``Accepted=False``) and create nothing. Python's rules (platform.py) and the policy's CEL are
checked against each other on many generated specs, with the real API server evaluating the CEL.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.kube.controlplane import Cluster, wait_until
from tests.operator.real import release, small, wait_condition

from embedfleet.operator import platform

pytestmark = pytest.mark.usefixtures("kube_cluster")

OWNED = "deployments,services,configmaps,poddisruptionbudgets,daemonsets,serviceaccounts"


def _tenant(cluster: Cluster, unique: str) -> tuple[str, str, str]:
    """(user, own namespace, other namespace): the user may `edit` the first only."""
    user, ns, other = f"alice-{unique}", f"team-a-{unique}", f"team-b-{unique}"
    for name in (ns, other):
        cluster.kubectl("create", "namespace", name)
    cluster.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit", f"--user={user}", "-n", ns)
    return user, ns, other


def _as(cluster: Cluster, user: str, *args: str, input: str | None = None) -> Any:
    return cluster.kubectl(f"--as={user}", *args, input=input, check=False)


def _owned(cluster: Cluster, namespace: str, name: str) -> list[str]:
    found = cluster.get_json(OWNED, "-n", namespace, "-l", f"embedfleet.dev/deployment={name}") or {}
    return [f"{o['kind']}/{o['metadata']['name']}" for o in found.get("items", [])]


def _policy_active(cluster: Cluster, ns: str) -> None:
    """A new ValidatingAdmissionPolicy takes effect once the API server has compiled it (about a
    second): wait until a dry run of a forbidden image is refused, and check CEL type-checking found
    nothing to warn about."""
    probe = small("policy-probe", ns)
    probe["spec"]["runtime"]["image"] = "docker.io/evil/probe:1"

    def refused() -> bool:
        done = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)
        return done.returncode != 0 and "denied request" in done.stderr

    wait_until(refused, 30, "the admission policy to take effect")
    for vap in (cluster.get_json("validatingadmissionpolicies") or {}).get("items", []):
        checking = (vap.get("status") or {}).get("typeChecking") or {}
        assert not checking.get("expressionWarnings"), (vap["metadata"]["name"], checking)


def _forbidden_cases(ns: str) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (EmbeddingDeployment, the field its refusal must name)."""

    def with_runtime(name: str, **runtime: Any) -> dict[str, Any]:
        doc = small(name, ns)
        doc["spec"]["runtime"].update(runtime)
        return doc

    host = small("host-proc", ns, cache={"storage": {"hostPath": "/proc"}})
    pools = small("cp-pool", ns, cache={"prePull": True, "nodePools": [
        {"name": "cp", "nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}]})
    return {
        "image": (with_runtime("bad-image", image="docker.io/evil/miner:latest"), "spec.runtime.image"),
        "image-lookalike": (with_runtime("lookalike", image="ghcr.io/embedfleet-evil/runtime:1"),
                            "spec.runtime.image"),
        "host-path": (host, "spec.cache.storage.hostPath"),
        "control-plane-toleration": (with_runtime("cp-tol", tolerations=[
            {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}]),
            "spec.runtime.tolerations"),
        "toleration-of-everything": (with_runtime("all-tol", tolerations=[{"operator": "Exists"}]),
                                     "spec.runtime.tolerations"),
        "control-plane-selector": (with_runtime("cp-sel", nodeSelector={
            "node-role.kubernetes.io/control-plane": ""}), "spec.runtime.nodeSelector"),
        "control-plane-pool": (pools, "spec.cache"),
    }


@pytest.fixture()
def tenant(kube_cluster: Cluster, unique: str) -> Iterator[tuple[str, str, str]]:
    user, ns, other = _tenant(kube_cluster, unique)
    yield user, ns, other
    for name in (ns, other):
        kube_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_an_editor_uses_the_crd_in_their_namespace_and_nowhere_else(
    kube_cluster: Cluster, unique: str, tmp_path: Path, tenant: tuple[str, str, str]
) -> None:
    user, ns, other = tenant
    with release(kube_cluster, tmp_path, unique, start=False):
        ok = small("mine", ns)
        done = _as(kube_cluster, user, "apply", "-f", "-", input=json.dumps(ok))
        assert done.returncode == 0, done.stderr
        assert _as(kube_cluster, user, "get", "embeddingdeployments", "-n", ns).returncode == 0
        assert _as(kube_cluster, user, "get", "modelcaches", "-n", ns).returncode == 0
        elsewhere = small("theirs", other)
        done = _as(kube_cluster, user, "apply", "-f", "-", input=json.dumps(elsewhere))
        assert done.returncode != 0 and "forbidden" in done.stderr.lower(), done.stderr
        assert _as(kube_cluster, user, "get", "embeddingdeployments", "-A").returncode != 0
        # The status is the operator's: an editor cannot forge Available=True.
        can = _as(kube_cluster, user, "auth", "can-i", "patch", "embeddingdeployments", "--subresource=status",
                  "-n", ns)
        assert can.stdout.strip() == "no"
        kube_cluster.kubectl("delete", "embeddingdeployment", "mine", "-n", ns, "--wait=false")


def test_the_admission_policy_refuses_each_forbidden_spec_with_its_reason(
    kube_cluster: Cluster, unique: str, tmp_path: Path, tenant: tuple[str, str, str]
) -> None:
    user, ns, _ = tenant
    with release(kube_cluster, tmp_path, unique, start=False):
        _policy_active(kube_cluster, ns)
        for case, (doc, field) in _forbidden_cases(ns).items():
            done = _as(kube_cluster, user, "apply", "-f", "-", input=json.dumps(doc))
            assert done.returncode != 0, f"{case}: the API server accepted a forbidden spec"
            assert "denied request" in done.stderr and field in done.stderr, f"{case}: {done.stderr}"
            assert kube_cluster.get_json("embeddingdeployment", doc["metadata"]["name"], "-n", ns) is None
        # Sources the puller cannot fetch are refused by the CRD itself (no policy needed).
        s3 = small("s3-source", ns, model={"source": "s3://bucket/model", "digest": "sha256:" + "ab" * 32})
        done = _as(kube_cluster, user, "apply", "-f", "-", input=json.dumps(s3))
        assert done.returncode != 0 and "s3:// and gs:// sources are not supported" in done.stderr, done.stderr
        # A Secret reference has no namespace field: another namespace's Secret cannot even be named.
        cross = small("cross-secret", ns)
        cross["spec"]["runtime"]["apiKeySecret"] = {"name": "key", "key": "k", "namespace": "kube-system"}
        done = _as(kube_cluster, user, "apply", "-f", "-", input=json.dumps(cross))
        assert done.returncode != 0 and "namespace" in done.stderr, done.stderr
        # One key or a tenants keys file, not both: the CRD's own CEL rule on spec.runtime.
        both = small("both-keys", ns)
        both["spec"]["runtime"]["apiKeySecret"] = {"name": "key", "key": "k"}
        both["spec"]["runtime"]["apiKeysSecret"] = {"name": "keys", "key": "keys.yaml"}
        done = _as(kube_cluster, user, "apply", "-f", "-", input=json.dumps(both))
        assert done.returncode != 0 and "spec.runtime" in done.stderr, done.stderr
        assert "apiKeySecret and apiKeysSecret are mutually exclusive" in done.stderr, done.stderr


def test_without_the_policy_the_operator_refuses_and_creates_nothing(
    kube_cluster: Cluster, unique: str, tmp_path: Path, tenant: tuple[str, str, str]
) -> None:
    user, ns, _ = tenant
    with release(kube_cluster, tmp_path, unique, sets={"admissionPolicy.enabled": "false"}) as (_, proc):
        assert proc is not None
        cases = _forbidden_cases(ns)
        for case, (doc, _field) in cases.items():
            done = _as(kube_cluster, user, "apply", "-f", "-", input=json.dumps(doc))
            assert done.returncode == 0, f"{case}: {done.stderr}"
        for case, (doc, field) in cases.items():
            name = doc["metadata"]["name"]
            obj = wait_condition(kube_cluster, name, ns, "Accepted", "False")
            message = next(c["message"] for c in obj["status"]["conditions"] if c["type"] == "Accepted")
            assert field in message, f"{case}: {message}"
            assert _owned(kube_cluster, ns, name) == [], f"{case}: objects created for a refused spec"
        assert proc.unexpected_errors() == []


def test_a_secret_reference_needs_the_platform_label(
    kube_cluster: Cluster, unique: str, tmp_path: Path, tenant: tuple[str, str, str]
) -> None:
    user, ns, _ = tenant
    with release(kube_cluster, tmp_path, unique) as (_, proc):
        assert proc is not None
        kube_cluster.kubectl("create", "secret", "generic", "plain", "--from-literal=k=v", "-n", ns)
        kube_cluster.kubectl("create", "secret", "generic", "shared", "--from-literal=k=v", "-n", ns)
        kube_cluster.kubectl("label", "secret", "shared", "embedfleet.dev/tenant-secret=true", "-n", ns)
        for name, secret, field in (("unlabelled", "plain", "apiKeySecret"), ("missing", "nope", "apiKeySecret"),
                                    ("labelled", "shared", "apiKeySecret"),
                                    ("tenants-unlabelled", "plain", "apiKeysSecret"),
                                    ("tenants", "shared", "apiKeysSecret")):
            doc = small(name, ns)
            doc["spec"]["runtime"][field] = {"name": secret, "key": "k"}
            done = _as(kube_cluster, user, "apply", "-f", "-", input=json.dumps(doc))
            assert done.returncode == 0, done.stderr
        refused = wait_condition(kube_cluster, "unlabelled", ns, "Accepted", "False")
        assert "embedfleet.dev/tenant-secret=true" in json.dumps(refused["status"]["conditions"])
        missing = wait_condition(kube_cluster, "missing", ns, "Accepted", "False")
        assert "not found" in json.dumps(missing["status"]["conditions"])
        assert _owned(kube_cluster, ns, "unlabelled") == [] and _owned(kube_cluster, ns, "missing") == []
        wait_condition(kube_cluster, "labelled", ns, "Accepted", "True")
        deploy = kube_cluster.get_json("deployment", "labelled", "-n", ns)
        env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "EMBEDFLEET_API_KEY", "valueFrom": {"secretKeyRef": {"name": "shared", "key": "k"}}} in env
        # apiKeysSecret: the same label rule, named by its own field; the keys file is a read-only volume.
        refused = wait_condition(kube_cluster, "tenants-unlabelled", ns, "Accepted", "False")
        message = next(c["message"] for c in refused["status"]["conditions"] if c["type"] == "Accepted")
        assert "spec.runtime.apiKeysSecret" in message and "embedfleet.dev/tenant-secret=true" in message, message
        assert _owned(kube_cluster, ns, "tenants-unlabelled") == []
        wait_condition(kube_cluster, "tenants", ns, "Accepted", "True")
        pod = kube_cluster.get_json("deployment", "tenants", "-n", ns)["spec"]["template"]["spec"]
        assert {"name": "api-keys", "secret": {"secretName": "shared", "items": [{"key": "k", "path": "keys.yaml"}],
                                               "defaultMode": 0o440}} in pod["volumes"]
        env = pod["containers"][0]["env"]
        assert {"name": "EMBEDFLEET_API_KEYS", "value": "/etc/embedfleet/api-keys/keys.yaml"} in env
        assert "EMBEDFLEET_API_KEY" not in {e["name"] for e in env}
        # The operator read only the Secret's metadata: its value never reached the operator's log.
        assert "dg==" not in proc.log() and '"v"' not in proc.log()
        assert proc.unexpected_errors() == []


# ---------------------------------------------------------------- CEL and Python agree


_IMAGES = ["ghcr.io/embedfleet/runtime:0.1.0", "ghcr.io/embedfleet-x/runtime:1", "registry.example/team/runtime:1",
           "registry.example/team/runtime@sha256:" + "cd" * 32, "registry.example/team/runtime-evil:1",
           "registry.example/teamx/runtime:1", "registry.example/other/x:2", "docker.io/library/busybox"]
_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "nvidia.com/gpu", "operator": "Exists"},
                {"key": "dedicated", "operator": "Equal", "value": "embed", "effect": "NoSchedule"},
                {"key": "dedicated", "operator": "Equal", "value": "embed", "effect": "NoExecute"},
                {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"},
                {"operator": "Exists"}]
_SELECTORS = [{}, {"pool": "embed"}, {"node-role.kubernetes.io/control-plane": ""},
              {"node-role.kubernetes.io/master": "true", "pool": "x"}]
_HOST_PATHS = [None, "/var/lib/embedfleet/cache", "/var/lib/embedfleet/cache/", "/var/lib/embedfleet", "/proc", "/"]
#: A platform team's values: one registry path, one exact repository, two toleration rules.
POLICY_SETS = {
    "platform.allowedImages[0]": "registry.example/team/",
    "platform.allowedImages[1]": "ghcr.io/embedfleet/runtime",
    "platform.allowedTolerations[0].key": "nvidia.com/gpu",
    "platform.allowedTolerations[1].key": "dedicated",
    "platform.allowedTolerations[1].effect": "NoSchedule",
    "platform.secrets.allowed": "false",
}
POLICY = platform.PlatformPolicy(
    allowed_images=["registry.example/team/", "ghcr.io/embedfleet/runtime"],
    allowed_tolerations=[platform.TolerationRule(key="nvidia.com/gpu"),
                         platform.TolerationRule(key="dedicated", effect="NoSchedule")],
    secrets=platform.SecretRules(allowed=False),
)


def _random_spec(rng: random.Random, ns: str, i: int) -> dict[str, Any]:
    doc = small(f"gen-{i}", ns)
    runtime = doc["spec"]["runtime"]
    runtime["image"] = rng.choice(_IMAGES)
    if rng.random() < 0.6:
        runtime["tolerations"] = copy.deepcopy(rng.sample(_TOLERATIONS, rng.randint(1, 2)))
    if rng.random() < 0.3:
        runtime["nodeSelector"] = dict(rng.choice(_SELECTORS))
    secret_ref = rng.random()
    if secret_ref < 0.15:
        runtime["apiKeySecret"] = {"name": "key", "key": "k"}
    elif secret_ref < 0.3:
        runtime["apiKeysSecret"] = {"name": "keys", "key": "keys.yaml"}
    cache: dict[str, Any] = {}
    host = rng.choice(_HOST_PATHS)
    if host is not None:
        cache["storage"] = {"hostPath": host}
    if rng.random() < 0.3:
        cache["prePull"] = True
        cache["nodePools"] = [{"name": "p", "nodeSelector": dict(rng.choice(_SELECTORS))}]
    if cache:
        doc["spec"]["cache"] = cache
    return doc


def test_the_admission_policy_and_the_operator_agree(
    kube_cluster: Cluster, unique: str, tmp_path: Path, tenant: tuple[str, str, str]
) -> None:
    """Many generated specs through the real API server's CEL (server-side dry run) and platform.py:
    refused by one exactly when refused by the other, and both name the same fields."""
    user, ns, _ = tenant
    assert platform.PlatformPolicy.model_validate(
        json.loads(json.dumps(POLICY.model_dump(by_alias=True)))
    ) == POLICY
    rng = random.Random(13)
    with release(kube_cluster, tmp_path, unique, sets=POLICY_SETS, start=False):
        _policy_active(kube_cluster, ns)
        # An earlier test's release (default values) is uninstalled without waiting, and its policy may
        # stay in force for a moment: wait until an image only this release's values allow is accepted.
        only_ours = small("policy-values-probe", ns)
        only_ours["spec"]["runtime"]["image"] = "registry.example/team/runtime:1"
        wait_until(lambda: _as(kube_cluster, user, "create", "--dry-run=server", "-f", "-",
                               input=json.dumps(only_ours)).returncode == 0,
                   30, "only this release's admission policy to be in force")
        disagreements = []
        refused = 0
        for i in range(60):
            doc = _random_spec(rng, ns, i)
            python = platform.deployment_problems(doc["spec"], POLICY)
            done = _as(kube_cluster, user, "create", "--dry-run=server", "-f", "-", input=json.dumps(doc))
            server_refused = done.returncode != 0
            assert not server_refused or "denied request" in done.stderr, done.stderr
            refused += server_refused
            if server_refused != bool(python):
                disagreements.append((doc["spec"], python, done.stderr.strip()))
                continue
            if server_refused:
                # The server reports its failing rules; each names one of the fields Python named.
                named = [p.split(":")[0].split("[")[0] for p in python]
                assert any(n.split(".")[-1] in done.stderr for n in named), (python, done.stderr)
        assert disagreements == []
        assert 10 < refused < 55, "the generator should produce both allowed and refused specs"
        # With Secrets forbidden, each reference is refused by name (apiKeySecret's own rule does not
        # cover apiKeysSecret).
        for field in platform.SECRET_REF_FIELDS:
            doc = small(f"secret-{field.lower()}", ns)
            doc["spec"]["runtime"][field] = {"name": "s", "key": "k"}
            done = _as(kube_cluster, user, "create", "--dry-run=server", "-f", "-", input=json.dumps(doc))
            assert done.returncode != 0 and f"spec.runtime.{field}: the platform does not let" in done.stderr, (
                field, done.stderr)
