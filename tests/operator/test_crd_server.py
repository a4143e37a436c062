"""The CRDs judged by a real kube-apiserver: accepted as structural, Established, defaults and validation
applied by the server, printer columns shown by a real `kubectl get`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.kube.fixtures import require_control_plane

ROOT = Path(__file__).resolve().parents[2]
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def crd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """An API server of this module's own: CRDs applied here with kubectl's field manager must not
    stand in the way of `helm install` on the shared session cluster."""
    require_control_plane()
    plane = ControlPlane.start(tmp_path_factory.mktemp("crd-plane"))
    try:
        yield plane.add_cluster("crds", nodes=[], controllers=False)
    finally:
        plane.stop()


@pytest.fixture
def crds_installed(crd_cluster: Cluster) -> Cluster:
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        crd_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        crd_cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return crd_cluster


@pytest.mark.parametrize("path", sorted((ROOT / "crds").glob("*.yaml")), ids=lambda p: p.name)
def test_every_crd_is_accepted_and_established(crd_cluster: Cluster, path: Path) -> None:
    done = crd_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path), check=False)
    assert done.returncode == 0, done.stderr
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    crd = wait_until(lambda: _established(crd_cluster, name), 60, f"{name} Established")
    assert not [c for c in crd["status"]["conditions"] if c["type"] == "NonStructuralSchema"]


def _established(cluster: Cluster, name: str) -> dict | None:
    crd = cluster.get_json("crd", name)
    conds = {c["type"]: c["status"] for c in (crd or {}).get("status", {}).get("conditions", [])}
    return crd if conds.get("Established") == "True" else None


def test_examples_get_server_defaults_and_printer_columns(crds_installed: Cluster, unique: str) -> None:
    ns = f"crd-{unique}"
    crds_installed.kubectl("create", "namespace", ns)
    examples = {}
    for path in sorted((ROOT / "examples").glob("embedding*.yaml")):  # every EmbeddingDeployment example
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] == "EmbeddingDeployment":
                doc["metadata"]["namespace"] = ns
                examples[doc["metadata"]["name"]] = doc
    assert {"minilm", "minilm-hf", "minilm-pvc"} <= examples.keys()
    crds_installed.apply(*examples.values())
    for name, example in examples.items():
        live = crds_installed.get_json("embeddingdeployment", name, "-n", ns)
        # Defaults come from the server's structural schema, nested blocks included.
        assert live["spec"]["runtime"]["port"] == 8080
        assert live["spec"]["autoscaling"]["targetUtilization"] == 0.7  # as given, or the default
        assert live["spec"]["runtime"]["maxClientBatchSize"] == 2048  # a nested default
        assert "hostPath" not in live["spec"]["cache"].get("storage", {})  # the platform's choice, not a default
        assert live["spec"]["model"]["source"] == example["spec"]["model"]["source"]
    table = crds_installed.kubectl("get", "embeddingdeployments", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "READY", "DESIRED", "IN-FLIGHT", "AGE"]
    rows = {line.split()[0]: line.split()[1] for line in table[1:]}
    assert rows == {name: doc["spec"]["model"]["source"] for name, doc in examples.items()}
    wide = crds_installed.kubectl("get", "ed", "-n", ns, "-o", "wide").stdout.splitlines()[0].split()
    assert {"ACCEPTED", "AVAILABLE", "CACHED"} <= set(wide)
    # Quantities: int-or-string both ways, junk refused by the server with the field named.
    good = _minimal("q", ns, {"runtime": {"resources": {"limits": {"memory": "4Gi", "cpu": 2}}}})
    crds_installed.apply(good)
    bad = _minimal("q2", ns, {"cache": {"storage": {"sizeLimit": "lots"}}})
    done = crds_installed.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert done.returncode != 0
    assert "sizeLimit" in done.stderr
    crds_installed.kubectl("delete", "namespace", ns, "--wait=false")


def test_server_refuses_wrong_types_and_unknown_fields(crds_installed: Cluster, unique: str) -> None:
    ns = f"crdbad-{unique}"
    crds_installed.kubectl("create", "namespace", ns)
    wrong = _minimal("w", ns, {"runtime": {"maxBatchRequests": "many"}})
    done = crds_installed.kubectl("apply", "-f", "-", input=json.dumps(wrong), check=False)
    assert done.returncode != 0 and "maxBatchRequests" in done.stderr
    unknown = _minimal("u", ns, {"runtime": {"maxBatchRequestz": 3}})
    done = crds_installed.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(unknown),
                                  check=False)
    assert done.returncode != 0 and "maxBatchRequestz" in done.stderr
    crds_installed.kubectl("delete", "namespace", ns, "--wait=false")


def test_server_refuses_queue_and_spill_bounds_out_of_range(crds_installed: Cluster, unique: str) -> None:
    """spec.runtime.maxQueueSeconds(/Bulk) > 0 (the runtime needs a bound), spec.placement.spillAfterSeconds
    >= 0: the server refuses the rest, naming the field; values in range are stored as given."""
    ns = f"crdbounds-{unique}"
    crds_installed.kubectl("create", "namespace", ns)
    refused = (({"runtime": {"maxQueueSeconds": -1}}, "maxQueueSeconds"),
               ({"runtime": {"maxQueueSecondsBulk": 0}}, "maxQueueSecondsBulk"),
               ({"placement": {"spillAfterSeconds": -0.5}}, "spillAfterSeconds"))
    for i, (extra, field) in enumerate(refused):
        done = crds_installed.kubectl("create", "-f", "-", input=json.dumps(_minimal(f"b{i}", ns, extra)),
                                      check=False)
        assert done.returncode != 0 and field in done.stderr, (extra, done.stderr)
    ok = _minimal("ok", ns, {"runtime": {"maxQueueSeconds": 2.5, "maxQueueSecondsBulk": 20},
                             "placement": {"spillAfterSeconds": 0}})
    crds_installed.apply(ok)
    live = crds_installed.get_json("embeddingdeployment", "ok", "-n", ns)["spec"]
    assert (live["runtime"]["maxQueueSeconds"], live["runtime"]["maxQueueSecondsBulk"]) == (2.5, 20)
    assert live["placement"]["spillAfterSeconds"] == 0
    crds_installed.kubectl("delete", "namespace", ns, "--wait=false")


def test_server_refuses_one_key_and_a_keys_file_together(crds_installed: Cluster, unique: str) -> None:
    """The CEL rule on spec.runtime: apiKeySecret or apiKeysSecret, not both; an explicit null is absent
    (as for the operator's validation)."""
    ns = f"crdkeys-{unique}"
    crds_installed.kubectl("create", "namespace", ns)
    ref = {"name": "s", "key": "k"}
    both = _minimal("both", ns, {"runtime": {"apiKeySecret": ref, "apiKeysSecret": ref}})
    done = crds_installed.kubectl("create", "-f", "-", input=json.dumps(both), check=False)
    assert done.returncode != 0, done.stdout
    assert "spec.runtime" in done.stderr and "apiKeySecret and apiKeysSecret are mutually exclusive" in done.stderr
    one = _minimal("one", ns, {"runtime": {"apiKeySecret": None, "apiKeysSecret": ref}})
    done = crds_installed.kubectl("create", "-f", "-", input=json.dumps(one), check=False)
    assert done.returncode == 0, done.stderr
    stored = crds_installed.get_json("embeddingdeployment", "one", "-n", ns)["spec"]["runtime"]
    assert stored["apiKeysSecret"] == ref
    crds_installed.kubectl("delete", "namespace", ns, "--wait=false")


def _minimal(name: str, namespace: str, extra_spec: dict) -> dict:
    spec = {"model": {"source": "hf://BAAI/bge-small-en-v1.5", "digest": DIGEST}, **extra_spec}
    return {"apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingDeployment",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}
