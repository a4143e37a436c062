"""A hub round reads a snapshot, then spends seconds writing to spokes; a hub object deleted meanwhile must
not make the round fail or write to the deleted object. The hub skips it once its watch has heard of the
delete, and takes the API server's 404 (deleted between that check and the patch) as the same news.
CI once failed on that 404 in the audit log of the chart's hub test."""

from __future__ import annotations

import logging

import pytest

from embedfleet.operator.hub.controller import HubController
from embedfleet.operator.kube import Kube, load_client
from tests.kube.controlplane import ControlPlane, wait_until
from tests.operator.real import EXAMPLE

NS = "embeddings"


def _deployment(name: str) -> dict:
    return {**EXAMPLE, "metadata": {"name": name, "namespace": NS}}


def test_a_status_write_for_an_object_deleted_mid_round(fresh_plane: ControlPlane,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    cluster = fresh_plane.add_cluster("hub", nodes=[], controllers=False)
    cluster.install_crds()
    cluster.kubectl("create", "namespace", NS)
    cluster.apply(_deployment("watched"), _deployment("unwatched"))
    hub = HubController(Kube(load_client(cluster.kubeconfig)), interval=1, ramp=0)
    try:
        hub.reconcile_all()  # starts the informers; writes the first status of both
        informer = hub.informers["deployments"]
        # views that show those writes (the hub holds back a status computed from one that does not)
        wait_until(lambda: all(hub.reporter.settled("deployments", o) for o in informer.items().values()), 10,
                   "the first status writes back through the watch")
        snapshot = informer.items()
        assert {"embeddings/watched", "embeddings/unwatched"} <= set(snapshot)
        stale_watched, stale_unwatched = snapshot["embeddings/watched"], snapshot["embeddings/unwatched"]
        cluster.audit_mark()

        # Deleted, and the watch has heard: no request at all.
        cluster.kubectl("delete", "embeddingdeployment", "watched", "-n", NS)
        wait_until(lambda: not informer.holds(stale_watched), 10, "the informer seeing the delete")
        with caplog.at_level(logging.INFO, logger="embedfleet.operator.hub.reporting"):
            hub.reporter.write_status(stale_watched, {"observedGeneration": 99})
        assert not [e for e in cluster.audit() if e.name == "watched" and e.verb == "patch"]

        # Deleted, the watch not told yet (a stopped informer stands for one that lags): the 404 is taken.
        informer.stop()
        cluster.kubectl("delete", "embeddingdeployment", "unwatched", "-n", NS)
        assert informer.holds(stale_unwatched)
        with caplog.at_level(logging.INFO, logger="embedfleet.operator.hub.reporting"):
            hub.reporter.write_status(stale_unwatched, {"observedGeneration": 99})
        patches = [e for e in cluster.audit() if e.name == "unwatched" and e.verb == "patch"]
        assert [e.code for e in patches] == [404], patches
        gone = [r.getMessage() for r in caplog.records if "deleted since it was read" in r.getMessage()]
        assert gone == [f"EmbeddingDeployment embeddings/{name} was deleted since it was read; its status is not "
                        "written" for name in ("watched", "unwatched")]
    finally:
        hub.stop.set()
        hub.close()
