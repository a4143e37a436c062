"""The hub's informer against a real kube-apiserver: what changes behind its back appears in its view; a
watch whose version expired (the API server restarted) re-lists; an unreachable server is an error, not an
empty view, and the informer recovers by itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from embedfleet.operator.hub.informer import Informer, version_at_least
from embedfleet.operator.kube import Kube
from tests.kube.controlplane import Cluster, ControlPlane, wait_until


def _configmap(name: str, namespace: str, value: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace,
                                                                 "labels": {"team": "a"}},
            "data": {"v": value}}


@pytest.fixture
def cluster(fresh_plane: ControlPlane) -> Cluster:
    return fresh_plane.add_cluster("inf", nodes=[], controllers=False)


@pytest.fixture
def informer(cluster: Cluster) -> Iterator[Informer]:
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "w"}})
    cluster.apply(_configmap("before", "w", "0"))
    inf = Informer(Kube(cluster.api_client()), "/api/v1/namespaces/w/configmaps", name="test",
                   label_selector="team=a", backoff=(0.2, 1.0)).start()
    assert inf.wait_synced(20)
    yield inf
    inf.stop()


def _value(inf: Informer, key: str) -> str | None:
    obj = inf.items().get(key)
    return None if obj is None else obj["data"]["v"]


def test_changes_behind_its_back_appear_without_a_list(cluster: Cluster, informer: Informer) -> None:
    assert _value(informer, "w/before") == "0"
    cluster.apply(_configmap("added", "w", "1"))
    wait_until(lambda: _value(informer, "w/added") == "1", 10, "an added object in the view")
    cluster.kubectl("patch", "configmap", "added", "-n", "w", "--type=merge", "-p", '{"data":{"v":"2"}}')
    wait_until(lambda: _value(informer, "w/added") == "2", 10, "a changed object in the view")
    cluster.kubectl("delete", "configmap", "before", "-n", "w")
    wait_until(lambda: "w/before" not in informer.items(), 10, "a deleted object gone from the view")
    cluster.kubectl("label", "configmap", "added", "-n", "w", "team=b", "--overwrite")
    wait_until(lambda: "w/added" not in informer.items(), 10, "an object leaving the selector gone")
    assert informer.stats.lists == 1, informer.stats
    assert informer.stats.events >= 4
    assert informer.synced and informer.error is None


def test_the_view_knows_when_it_has_caught_up_with_a_write(cluster: Cluster, informer: Informer) -> None:
    written = Kube(cluster.api_client()).create(_configmap("mine", "w", "x"))
    version = written["metadata"]["resourceVersion"]
    wait_until(lambda: informer.caught_up(version), 10, "the write seen through the watch")
    assert "w/mine" in informer.items()
    assert version_at_least(informer.resource_version, version)


def test_a_restarted_api_server_is_an_error_then_a_relist(cluster: Cluster, informer: Informer) -> None:
    cluster.stop_apiserver()
    wait_until(lambda: informer.error is not None, 20, "the stopped server reported")
    assert not informer.synced
    assert _value(informer, "w/before") == "0", "an unreachable server keeps the last view, flagged"
    cluster.start_apiserver()
    cluster.apply(_configmap("while-away", "w", "3"))
    wait_until(lambda: informer.synced and _value(informer, "w/while-away") == "3", 30, "recovered")
    # The restarted server's watch cache starts after the informer's version: it answers 410 and the
    # informer lists again instead of missing what changed.
    assert informer.stats.relists >= 1 and informer.stats.lists >= 2, informer.stats
