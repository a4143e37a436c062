"""The CRD documents of every kind, as written to ``crds/`` and checked in (a test regenerates them and
compares). The schema rewriting (pydantic's JSON Schema -> the structural form the API server requires)
is structural.py's.
"""

from __future__ import annotations

from typing import Any

from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import fleet_crds
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec, ModelCacheSpec
from embedfleet.operator.crd.statuses import EmbeddingDeploymentStatus, ModelCacheStatus
from embedfleet.operator.crd.structural import condition_column, crd_document, root_schema


def embedding_deployment_crd() -> dict[str, Any]:
    return crd_document(
        kind=naming.EMBEDDING_DEPLOYMENT_KIND,
        plural=naming.EMBEDDING_DEPLOYMENT_PLURAL,
        singular=naming.EMBEDDING_DEPLOYMENT_SINGULAR,
        short_names=naming.EMBEDDING_DEPLOYMENT_SHORT_NAMES,
        scope="Namespaced",
        schema=root_schema(EmbeddingDeploymentSpec, EmbeddingDeploymentStatus),
        columns=[
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.replicas.ready"},
            {"name": "Desired", "type": "integer", "jsonPath": ".status.replicas.desired"},
            {"name": "In-Flight", "type": "number", "jsonPath": ".status.inFlight"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            condition_column("Accepted", 1),
            condition_column("Available", 1),
            {"name": "Cached", "type": "integer", "jsonPath": ".status.cachedNodes", "priority": 1},
            {"name": "Image", "type": "string", "jsonPath": ".status.image", "priority": 1},
        ],
        subresources={
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas.current",
                "labelSelectorPath": ".status.selector",
            },
        },
    )


def model_cache_crd() -> dict[str, Any]:
    return crd_document(
        kind=naming.MODEL_CACHE_KIND,
        plural=naming.MODEL_CACHE_PLURAL,
        singular=naming.MODEL_CACHE_SINGULAR,
        short_names=naming.MODEL_CACHE_SHORT_NAMES,
        scope="Namespaced",
        schema=root_schema(ModelCacheSpec, ModelCacheStatus),
        columns=[
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
            {"name": "Cached", "type": "integer", "jsonPath": ".status.cachedNodes"},
            {"name": "Nodes", "type": "integer", "jsonPath": ".status.totalNodes"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
        subresources={"status": {}},
    )


def all_crds() -> dict[str, dict[str, Any]]:
    """File name in crds/ -> CRD document."""
    docs = [embedding_deployment_crd(), model_cache_crd(), *fleet_crds()]
    return {f"{doc['metadata']['name']}.yaml": doc for doc in docs}


def openapi_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of one kind, e.g. for validating example manifests with jsonschema."""
    for doc in all_crds().values():
        if doc["spec"]["names"]["kind"] == kind:
            return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    raise KeyError(kind)
