"""The kit informer against a real kube-apiserver (the test control plane, API server only): a list of many
objects comes in pages with the server's own continue tokens; a watch from a version older than the server's
watch window is answered 410 Gone; and the relist that follows tells only the keys that changed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from embedfleet.kit.client import KubeClient
from embedfleet.kit.informer import Informer
from embedfleet.operator.kube import Kube
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.kube.fixtures import require_control_plane

NS = "inf"
PATH = f"/api/v1/namespaces/{NS}/configmaps"
COUNT = 120


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_control_plane()
    plane = ControlPlane.start(Path(tmp_path_factory.mktemp("informer")) / "plane")
    try:
        cluster = plane.add_cluster("inf", nodes=[], controllers=False)
        cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        kube = Kube(cluster.api_client())
        for i in range(COUNT):
            kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"c{i}", "namespace": NS},
                         "data": {"v": "0"}})
        yield cluster
    finally:
        plane.stop()


def test_a_large_collection_is_listed_in_pages(cluster: Cluster) -> None:
    inf = Informer(Kube(cluster.api_client()), PATH, name="pages", page_size=50)
    version = inf._list()
    assert inf.stats.pages == 3, inf.stats  # 50 + 50 + 20, through the server's continue tokens
    assert len(inf.items()) == COUNT and version


def test_a_watch_from_a_too_old_version_is_gone(cluster: Cluster) -> None:
    """A restarted API server's watch window starts at its start: a version from before is too old."""
    kube = KubeClient(cluster.api_client())
    _, version = kube.list_raw(PATH)
    cluster.kubectl("patch", "configmap", "c1", "-n", NS, "--type=merge", "-p", '{"data":{"v":"1"}}')
    cluster.stop_apiserver()
    cluster.start_apiserver()
    events = list(KubeClient(cluster.api_client()).watch(PATH, version, timeout_seconds=2))
    assert events and events[0]["type"] == "ERROR", events[:1]
    assert events[0]["object"]["code"] == 410, events[0]


def test_a_relist_tells_only_what_changed(cluster: Cluster) -> None:
    heard: list[str] = []
    lock = threading.Lock()

    def on_change(key: str) -> None:
        with lock:
            heard.append(key)

    inf = Informer(Kube(cluster.api_client()), PATH, name="relist", on_change=on_change, page_size=50,
                   backoff=(0.2, 1.0), relist_backoff=(0.2, 1.0)).start()
    try:
        assert inf.wait_synced(20)
        wait_until(lambda: len(heard) >= COUNT, 10, "every key told once after the first list")
        with lock:
            heard.clear()
        # A restarted API server's watch window starts after the informer's version: 410, then a relist.
        cluster.stop_apiserver()
        cluster.start_apiserver()
        cluster.kubectl("patch", "configmap", "c7", "-n", NS, "--type=merge", "-p", '{"data":{"v":"1"}}')
        wait_until(lambda: inf.synced and (inf.get(f"{NS}/c7") or {}).get("data", {}).get("v") == "1", 60,
                   "the change seen after the restart")
        assert inf.stats.relists >= 1 and inf.stats.lists >= 2, inf.stats
        with lock:
            assert set(heard) == {f"{NS}/c7"}, sorted(set(heard))[:10]
    finally:
        inf.stop()
