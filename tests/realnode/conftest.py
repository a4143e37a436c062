"""The real-node tier's one node, shared by its tests: built once (cached), brought up once, taken down at the end.

`bash scripts/setup.sh --test` builds what this needs (apt packages, the kubelet, the images); when something is
missing here the fixture builds it, which takes minutes, rather than skipping: this tier is the only one that runs
the product's images on a kubelet, so it must not vanish from a run quietly. It skips only where it cannot run at
all (not root, no Go), and says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kube.controlplane import missing_reason, tools_dir
from tests.realnode.node import SCRIPT, RealNode, realnode_home

_NODE: list[RealNode] = []  # the node while it is up: a failing test's report carries its diagnosis


def _cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "the real-node tier needs root (containerd, a network bridge, iptables, mounts)"
    if shutil.which("go") is None:
        return "the real-node tier builds its kubelet with Go (https://go.dev/doc/install)"
    if not Path("/sys/fs/cgroup").is_dir():
        return "the real-node tier needs cgroups for the kubelet"
    return None


@pytest.fixture(scope="package")
def realnode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    reason = _cannot_run()
    if reason:
        pytest.skip(reason)
    if tools_dir() is None:
        pytest.skip(missing_reason() or "the test control plane is not built")
    # apt packages, kubelet, images: each a no-op when cached (the images when their sources are unchanged)
    built = subprocess.run(["bash", str(SCRIPT), "build"], capture_output=True, text=True, timeout=3600)
    assert built.returncode == 0, f"scripts/realnode.sh build failed:\n{built.stderr[-4000:]}"
    workdir = tmp_path_factory.mktemp("realnode")
    # what a run killed before its `down` leaves behind: the `kubernetes` ClusterIP sent to an API server that is
    # gone. `up` must clear it (the operator's readiness and every pod's API calls depend on that NAT).
    subprocess.run(["iptables", "-t", "nat", "-A", "PREROUTING", "-d", "198.19.128.1/32", "-p", "tcp", "--dport",
                    "443", "-j", "DNAT", "--to-destination", "198.18.252.1:9"], check=True)
    up = subprocess.run(["bash", str(SCRIPT), "up", str(workdir)], capture_output=True, text=True, timeout=900)
    node = RealNode(workdir=workdir, home=realnode_home())
    try:
        assert up.returncode == 0, f"scripts/realnode.sh up failed:\n{up.stderr[-4000:]}"
        ready = node.kubectl("get", "node", "realnode-1", "-o",
                             "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False).stdout
        assert ready == "True", f"node realnode-1 not Ready: {ready!r}\n{(workdir / 'kubelet.log').read_text()[-3000:]}"
        _NODE.append(node)
        yield node
    finally:
        _NODE.clear()
        subprocess.run(["bash", str(SCRIPT), "down", str(workdir)], capture_output=True, text=True, timeout=300)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed step says what the node looked like (pods, events, logs, kubelet, NAT), not only what it waited
    for: CI keeps nothing but this report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _NODE:
        try:
            report.sections.append(("realnode diagnosis", _NODE[0].diagnose()))
        except Exception as exc:  # a diagnosis that fails must not hide the failure
            report.sections.append(("realnode diagnosis", f"could not diagnose: {exc!r}"))
