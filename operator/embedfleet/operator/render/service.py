"""The objects that select the runtime pods: the main Service (one vector space) and a revision's
Service ``<name>-rN``, the PodDisruptionBudget and the optional ServiceMonitor. None of them shapes a
pod; they only find pods by label, so they live apart from the Deployment that makes them.
"""

from __future__ import annotations

from embedfleet.compat.names import with_revision
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.render.common import Manifest, _meta, labels, owner_reference, runtime_name, selector_labels
from embedfleet.operator.render.revisions import FIRST_REVISION, REVISION_COMPONENT, revision_object_name
from embedfleet.operator.rollout.revisions import Run

SERVICE_PORT = 80


def render_service(name: str, namespace: str, uid: str, spec: EmbeddingDeploymentSpec,
                   query_vector_space: str = FIRST_REVISION, run: Run | None = None) -> Manifest:
    """The main Service ``<name>`` (no ``run``): every runtime pod of the query vector space, whichever
    Deployment runs it, so it never mixes spaces and never reaches an ungated candidate. With a ``run``:
    the Service ``<name>-rN`` of that revision (``<served>@rN`` traffic and the drift gate's reads)."""
    served = spec.model.served_model_name or name
    if run is None:
        object_name, model, space = runtime_name(name), served, query_vector_space
        selector = {naming.INSTANCE_LABEL: name, naming.VECTOR_SPACE_LABEL: query_vector_space}
        component = "runtime"
    else:
        object_name, model, space = revision_object_name(name, run.revision), with_revision(served, run.revision), \
            run.vector_space
        selector = {naming.INSTANCE_LABEL: name, naming.REVISION_LABEL: run.revision}
        component = REVISION_COMPONENT
    meta = _meta(object_name, namespace, owner_reference(name, uid), labels(name, component))
    meta["annotations"] = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.runtime.port),
        "prometheus.io/path": "/metrics",
        naming.MODEL_ANNOTATION: model,
        naming.VECTOR_SPACE_ANNOTATION: space,
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pdb(name: str, namespace: str, uid: str) -> Manifest:
    """At most one runtime pod voluntarily down at a time (a node drain proceeds one pod at a time)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(runtime_name(name), namespace, owner_reference(name, uid), labels(name, "runtime")),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, "runtime")}},
    }


def render_service_monitor(name: str, namespace: str, uid: str, spec: EmbeddingDeploymentSpec) -> Manifest:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(runtime_name(name), namespace, owner_reference(name, uid), labels(name, "runtime")),
        "spec": {
            "selector": {"matchLabels": selector_labels(name, "runtime")},
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": spec.monitoring.scrape_interval}],
        },
    }
