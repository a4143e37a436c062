"""pytest fixtures for the real test control plane (registered from tests/conftest.py).

- ``kube_cluster``: one session-wide cluster (etcd, API server with RBAC and audit, controller-manager,
  scheduler, kwok with CPU and GPU nodes). Tests isolate themselves with their own namespaces and
  release names, and its audit log is marked at the start of each test that uses it.
- ``fresh_plane``: a ControlPlane of the test's own (etcd only); add clusters with ``add_cluster``:
  for tests that restart API servers, or need several clusters (hub and spokes on one etcd).
- ``pod_network``: the namespace where kwok's pod IPs are live (see netns.py).
Everything skips with the reason from `missing_reason()` where the control plane is not built.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube.controlplane import Cluster, ControlPlane, missing_reason
from tests.kube.netns import PodNetwork, unavailable_reason

_counter = itertools.count(1)


def require_control_plane() -> None:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def _session_plane() -> Iterator[ControlPlane]:
    require_control_plane()
    workdir = Path(tempfile.mkdtemp(prefix="embedfleet-kube-"))
    plane = ControlPlane.start(workdir)
    try:
        plane.add_cluster("main")
        yield plane
    finally:
        plane.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def kube_cluster(_session_plane: ControlPlane) -> Cluster:
    cluster = _session_plane.clusters["main"]
    if not cluster.ready():
        cluster.start_apiserver()
    cluster.audit_mark()
    return cluster


@pytest.fixture
def fresh_plane(tmp_path: Path) -> Iterator[ControlPlane]:
    require_control_plane()
    plane = ControlPlane.start(tmp_path / "plane")
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def unique() -> str:
    """A short name unique in this session (namespaces, releases)."""
    return f"t{next(_counter)}"


@pytest.fixture(scope="session")
def pod_network() -> Iterator[PodNetwork]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    net = PodNetwork.create()
    try:
        yield net
    finally:
        net.delete()
