"""Real-cluster end to end: kind + docker + helm + kubectl (run `pytest e2e/` where they exist).

Skips, saying which tool is missing, on machines without them (such as the CI machines).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / os.environ.get("MANIFEST", "e2e/embedding-kind.yaml")
CLUSTER = os.environ.get("CLUSTER", "embedfleet-e2e")
CONTEXT = f"kind-{CLUSTER}"
TOOLS = ("docker", "kind", "helm", "kubectl")


def _missing() -> list[str]:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if "docker" not in missing:
        probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            missing.append("a running Docker engine (`docker info` failed)")
    return missing


pytestmark = pytest.mark.skipif(
    bool(_missing()), reason=f"kind e2e needs {', '.join(TOOLS)}; missing here: {', '.join(_missing())}"
)


def kubectl(*args: str) -> str:
    return subprocess.run(["kubectl", "--context", CONTEXT, *args], check=True, capture_output=True,
                          text=True, timeout=300).stdout


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    env = {**os.environ, "KEEP": "1", "CLUSTER": CLUSTER, "MANIFEST": str(MANIFEST)}
    proc = subprocess.run([str(REPO / "e2e" / "kind.sh")], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    yield
    if os.environ.get("KEEP") != "1":
        subprocess.run(["kind", "delete", "cluster", "--name", CLUSTER], capture_output=True, timeout=300)


def test_embedding_deployment_becomes_available(cluster: None) -> None:
    doc = yaml.safe_load(MANIFEST.read_text())
    name, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
    obj = json.loads(kubectl("-n", namespace, "get", "embeddingdeployment", name, "-o", "json"))
    conditions = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert conditions["Accepted"] == "True" and conditions["Available"] == "True"
    deployment = json.loads(kubectl("-n", namespace, "get", "deployment", name, "-o", "json"))
    assert deployment["status"].get("readyReplicas", 0) >= 1


def test_operator_runs_non_root_with_its_liveness_probe(cluster: None) -> None:
    pods = json.loads(kubectl("-n", "embedfleet-system", "get", "pods", "-l",
                              "app.kubernetes.io/name=embedfleet-operator", "-o", "json"))["items"]
    assert pods
    for pod in pods:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert all(s["ready"] for s in pod["status"]["containerStatuses"])


def test_runtime_answers_embeddings_through_its_service(cluster: None) -> None:
    doc = yaml.safe_load(MANIFEST.read_text())
    name, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
    body = json.dumps({"model": "all-MiniLM-L6-v2", "input": ["hello kind"]})
    url = f"http://{name}.{namespace}.svc/v1/embeddings"  # the Service listens on port 80
    out = kubectl("-n", namespace, "run", "e2e-curl", "--rm", "-i", "--restart=Never", "--quiet",
                  "--image=curlimages/curl:8.8.0", "--", "curl", "-sf",
                  "-H", "Content-Type: application/json", "-d", body, url)
    assert len(json.loads(out)["data"][0]["embedding"]) == 384
