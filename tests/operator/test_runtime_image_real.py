"""The platform's default runtime image on a real control plane: a deployment that names no image runs the
chart's ``runtimeImage``, and a `helm upgrade` to another one (the operator restarted with the new
``EMBEDFLEET_DEFAULT_RUNTIME_IMAGE``, as the upgraded Deployment would restart it) rolls that deployment's pods
onto it, while a deployment that names its image is left alone, not even written to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.kube.controlplane import Cluster, wait_until
from tests.kube.operator_proc import CHART, start_operator
from tests.operator.real import FAST_ELECTION, release, small, wait_condition

REPOSITORY = "ghcr.io/embedfleet/runtime"
OLD, NEW = "1.0.0-a", "1.0.0-b"
PINNED = f"{REPOSITORY}:0.0.9"
COMPONENT = "app.kubernetes.io/component=runtime"


def _image(cluster: Cluster, name: str, ns: str) -> str:
    deployment = cluster.get_json("deployment", name, "-n", ns)
    pod = deployment["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    assert len(images) == 1, images  # the runtime and its model fetcher run one image
    return images.pop()


def _pod_images(cluster: Cluster, name: str, ns: str) -> set[str]:
    pods = cluster.get_json("pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name},{COMPONENT}")["items"]
    return {c["image"] for p in pods if not p["metadata"].get("deletionTimestamp") for c in p["spec"]["containers"]}


def _deployment(name: str, ns: str, image: str | None) -> dict[str, Any]:
    doc = small(name, ns, autoscaling={"enabled": False}, replicas=2)
    if image is None:
        del doc["spec"]["runtime"]["image"]
    else:
        doc["spec"]["runtime"]["image"] = image
    return doc


def test_a_new_default_image_rolls_the_deployments_that_name_none(kube_cluster: Cluster, unique: str,
                                                                  tmp_path: Path) -> None:
    cluster = kube_cluster
    name = f"ef-{unique}"
    sets = {**FAST_ELECTION, "prometheusUrl": "", "runtimeImage.tag": OLD}
    with release(cluster, tmp_path, unique, sets={"runtimeImage.tag": OLD}) as (system, first):
        ns = f"img-{unique}"
        cluster.kubectl("create", "namespace", ns)
        cluster.apply(_deployment("follows", ns, None), _deployment("pinned", ns, PINNED))
        wait_condition(cluster, "follows", ns, "Available")
        wait_condition(cluster, "pinned", ns, "Available")
        live = cluster.get_json("embeddingdeployment", "follows", "-n", ns)
        assert "image" not in live["spec"]["runtime"]  # the CRD stores no default: nothing pins it
        assert _image(cluster, "follows", ns) == f"{REPOSITORY}:{OLD}"
        assert _image(cluster, "pinned", ns) == PINNED
        wait_until(lambda: cluster.get_json("ed", "follows", "-n", ns)["status"].get("image")
                   == f"{REPOSITORY}:{OLD}", 30, "status.image shows the default in use")

        assert first.stop() == 0
        cluster.helm("upgrade", name, str(CHART), "-n", system, "--reuse-values", "--skip-crds",
                     "--set", f"runtimeImage.tag={NEW}", "--wait=false")
        cluster.audit_mark()
        upgraded = start_operator(cluster, tmp_path, release=name, namespace=system,
                                  values=[CHART / "ci" / "standalone-values.yaml"],
                                  sets={**sets, "runtimeImage.tag": NEW}, name="upgraded")
        try:
            # On start-up (resume), with no event from anyone: the Deployment is re-rendered and rolled.
            wait_until(lambda: _image(cluster, "follows", ns) == f"{REPOSITORY}:{NEW}", 60,
                       "the Deployment of the unpinned deployment on the new default")
            wait_until(lambda: _pod_images(cluster, "follows", ns) == {f"{REPOSITORY}:{NEW}"}, 90,
                       "its pods rolled onto the new image")
            wait_until(lambda: cluster.get_json("ed", "follows", "-n", ns)["status"].get("image")
                       == f"{REPOSITORY}:{NEW}", 30, "status.image follows")
            wait_condition(cluster, "follows", ns, "Available")
            assert _image(cluster, "pinned", ns) == PINNED and _pod_images(cluster, "pinned", ns) == {PINNED}
            writes = [e for e in upgraded.writes() if e.resource == "deployments"]
            assert {e.name for e in writes} == {"follows"}, "\n".join(map(str, writes))
            errors = upgraded.unexpected_errors()
            assert errors == [], "\n".join(map(str, errors)) + "\n" + upgraded.log()[-3000:]
            cluster.kubectl("delete", "embeddingdeployments", "--all", "-n", ns, "--wait=true", "--timeout=60s")
            assert upgraded.stop() == 0, upgraded.log()[-3000:]
        finally:
            upgraded.stop()
