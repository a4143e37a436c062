"""The Gateway API's standard-channel CRDs for the test control plane.

``scripts/gateway-api-crds.sh`` copies them, once per machine, from the pinned ``sigs.k8s.io/gateway-api``
Go module (fetched through the Go module proxy) into ``~/.cache/embedfleet/gateway-api-<version>/``; it
prints that folder and does nothing more when it is already there. Tests call it through ``crds_dir()``,
so a machine whose control plane was built before the script existed needs no extra step, and they skip
with a reason naming Go where the folder is missing and Go is absent.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.controlplane import ROOT, Cluster

SCRIPT = ROOT / "scripts" / "gateway-api-crds.sh"
#: What an HTTPRoute needs on a server: the route, what it attaches to (a Gateway) and the Gateway's class.
ROUTE_KINDS = ("gatewayclasses", "gateways", "httproutes")


@functools.cache
def _fetch() -> tuple[Path | None, str]:
    try:
        done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None, f"{SCRIPT.name} took over 10 minutes (is the Go module proxy reachable?)"
    if done.returncode == 0:
        return Path(done.stdout.strip().splitlines()[-1]), ""
    if done.returncode == 3:  # Go is not installed
        return None, done.stderr.strip()
    raise RuntimeError(f"{SCRIPT.name} failed ({done.returncode}):\n{done.stderr.strip()}")


def crds_dir() -> Path:
    """The cache folder (its ``standard/`` holds the CRD files); skips the test where Go is absent."""
    path, reason = _fetch()
    if path is None:
        pytest.skip(reason)
    return path


def crd_file(resource: str) -> Path:
    return crds_dir() / "standard" / f"gateway.networking.k8s.io_{resource}.yaml"


def crd(resource: str) -> dict[str, Any]:
    return yaml.safe_load(crd_file(resource).read_text())


def install(cluster: Cluster, resources: tuple[str, ...] = ROUTE_KINDS) -> None:
    """Server-side apply these CRDs (as `kubectl apply --server-side -f standard-install.yaml` would,
    without its safe-upgrades ValidatingAdmissionPolicy) and wait until they are Established."""
    for resource in resources:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_file(resource)))
    for resource in resources:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{resource}.gateway.networking.k8s.io",
                        "--timeout=60s")
