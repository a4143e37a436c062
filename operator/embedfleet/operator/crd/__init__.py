"""The operator's custom resources: pydantic models (source of truth) and their CRD rendering."""

from embedfleet.operator.crd.models import (
    AutoscalingSpec,
    CacheSpec,
    EmbeddingDeploymentSpec,
    ModelCacheSpec,
    ModelSource,
    PlacementSpec,
    RuntimeSpec,
    ScaleDownRules,
    ScaleUpRules,
)
from embedfleet.operator.crd.naming import API_VERSION, GROUP, VERSION
from embedfleet.operator.crd.statuses import Condition, EmbeddingDeploymentStatus, ModelCacheStatus, ScaleDecision

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "AutoscalingSpec",
    "CacheSpec",
    "Condition",
    "EmbeddingDeploymentSpec",
    "EmbeddingDeploymentStatus",
    "ModelCacheSpec",
    "ModelCacheStatus",
    "ModelSource",
    "PlacementSpec",
    "RuntimeSpec",
    "ScaleDecision",
    "ScaleDownRules",
    "ScaleUpRules",
]
