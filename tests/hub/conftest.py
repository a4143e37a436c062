"""Fleet fixtures: one kmock emulator per cluster (hub + spokes) and real operator processes.

Reuses tests/operator/conftest.py (loaded under its own module name, so both conftests coexist) and
registers the hub's extra resources: Secrets (spoke kubeconfigs), Leases (heartbeats), FleetCluster and
PlacementPolicy.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("embedfleet_operator_fixtures", HERE.parent / "operator" / "conftest.py")
assert _spec is not None and _spec.loader is not None
op = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = op
_spec.loader.exec_module(op)
_helpers = importlib.util.spec_from_file_location("embedfleet_schema_helpers",
                                                  HERE.parent / "operator" / "schema_helpers.py")
assert _helpers is not None and _helpers.loader is not None
schema_helpers = importlib.util.module_from_spec(_helpers)
_helpers.loader.exec_module(schema_helpers)

FLEET_CLUSTERS = "embedfleet.dev/v1alpha1/fleetclusters"
PLACEMENT_POLICIES = "embedfleet.dev/v1alpha1/placementpolicies"
EXTRA = {
    "v1/secrets": ("Secret", True, ()),
    "coordination.k8s.io/v1/leases": ("Lease", True, ()),
    FLEET_CLUSTERS: ("FleetCluster", False, ("status",)),
    PLACEMENT_POLICIES: ("PlacementPolicy", False, ("status",)),
}
op.RESOURCES.update(EXTRA)
wait_for = op.wait_for
KmockCluster = op.KmockCluster


@pytest.fixture
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Any]]:
    """Factory: ``clusters(name)`` starts one more emulated cluster (its own port and kubeconfig)."""
    generators = []

    def start(name: str) -> Any:
        gen = op.kmock_cluster.__wrapped__(tmp_path_factory.mktemp(name))
        cluster = next(gen)
        generators.append(gen)
        return cluster

    yield start
    for gen in generators:
        try:
            next(gen)
        except StopIteration:
            pass


@pytest.fixture
def operator_process(tmp_path: Path) -> Iterator[Any]:
    yield from op.operator_process.__wrapped__(tmp_path)


__all__ = ["KmockCluster", "kmock", "schema_helpers", "wait_for"]
