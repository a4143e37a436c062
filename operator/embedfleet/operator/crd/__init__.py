"""The operator's custom resources: pydantic models (source of truth) and their CRD rendering."""

from embedfleet.operator.crd.models import (
    AutoscalingSpec,
    CacheSpec,
    Condition,
    EmbeddingDeploymentSpec,
    EmbeddingDeploymentStatus,
    ModelCacheSpec,
    ModelCacheStatus,
    ModelSource,
    PlacementSpec,
    RuntimeSpec,
    ScaleDecision,
    ScaleDownRules,
    ScaleUpRules,
)
from embedfleet.operator.crd.naming import API_VERSION, GROUP, VERSION

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
