"""The control-plane kit's informer (the hub's, the gateway's and the node agent's) against a real
kube-apiserver: what changes behind its back appears in its view; a watch whose version expired (the API
server restarted) re-lists; a watch the server ends is resumed without a list; an unreachable or stalled
server is an error, not an empty view, and the informer recovers by itself.
"""

from __future__ import annotations

import os
import signal
import time
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


def _watches(cluster: Cluster) -> int:
    return sum(e.verb == "watch" and e.resource == "configmaps" and e.namespace == "w" for e in cluster.audit())


def test_a_watch_the_server_ends_is_resumed_without_a_list(cluster: Cluster) -> None:
    """The server ends each watch after timeoutSeconds; the informer opens the next one from the newest
    version it saw (no list), and changes made between two watches still arrive."""
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "w"}})
    cluster.audit_mark()
    inf = Informer(Kube(cluster.api_client()), "/api/v1/namespaces/w/configmaps", name="short",
                   timeout_seconds=1, backoff=(0.2, 1.0)).start()
    try:
        assert inf.wait_synced(20)
        for i in range(3):
            cluster.apply(_configmap(f"c{i}", "w", str(i)))
            wait_until(lambda i=i: _value(inf, f"w/c{i}") == str(i), 10, f"c{i} in the view")
            time.sleep(1.2)  # past the server's end of the watch
        wait_until(lambda: _watches(cluster) >= 3, 20, "three watches ended by the server in the audit log")
        assert inf.stats.lists == 1 and inf.stats.relists == 0, inf.stats
        assert inf.stats.watches >= 3 and inf.error is None
    finally:
        inf.stop()


def test_a_stalled_api_server_is_detected_and_the_watch_resumes(cluster: Cluster) -> None:
    """An API server that accepts but never answers (SIGSTOP) is a stalled watch: the read time-out
    (timeoutSeconds + the connect time-out) ends it, the informer reports the error and is not synced
    (the health signal its readers use); once the server answers again the watch resumes from the newest
    version, without a list, and the change made meanwhile arrives."""
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "w"}})
    restarts: list[str] = []
    inf = Informer(Kube(cluster.api_client()), "/api/v1/namespaces/w/configmaps", name="stall", kind="ConfigMap",
                   timeout_seconds=2, backoff=(0.2, 1.0), on_restart=restarts.append).start()
    apiserver = next(p for p in cluster.procs if p.name.endswith("apiserver"))
    try:
        assert inf.wait_synced(20)
        os.kill(apiserver.popen.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: inf.error is not None, 30, "the stalled watch reported")
            assert not inf.synced
            assert "timed out" in inf.error.lower() or "timeout" in inf.error.lower(), inf.error
        finally:
            os.kill(apiserver.popen.pid, signal.SIGCONT)
        cluster.apply(_configmap("after", "w", "9"))
        wait_until(lambda: inf.synced and _value(inf, "w/after") == "9", 30, "resumed after the stall")
        assert inf.stats.lists == 1, inf.stats
        assert restarts and set(restarts) == {"ConfigMap"}, restarts
    finally:
        inf.stop()
