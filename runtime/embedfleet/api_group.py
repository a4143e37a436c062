"""The ``embedfleet.dev`` API's coordinates: its group, version, and each kind's name and plural.

Shared by components: the operator defines these kinds (crd/naming.py re-exports what is here) and the
gateway watches EmbeddingDeployments, so the names have one home that both import. A module of the small
common package (top-level ``embedfleet.*`` modules: otel, calls, httpserver, compat, this one): it imports
nothing from embedfleet.runtime, .operator, .gateway or .client (tests/packaging/test_boundaries.py checks).
"""

from __future__ import annotations

GROUP = "embedfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

EMBEDDING_DEPLOYMENT_KIND = "EmbeddingDeployment"
EMBEDDING_DEPLOYMENT_PLURAL = "embeddingdeployments"
EMBEDDING_DEPLOYMENT_SINGULAR = "embeddingdeployment"
EMBEDDING_DEPLOYMENT_SHORT_NAMES = ("embdep", "ed")

MODEL_CACHE_KIND = "ModelCache"
MODEL_CACHE_PLURAL = "modelcaches"
MODEL_CACHE_SINGULAR = "modelcache"
MODEL_CACHE_SHORT_NAMES = ("mcache",)
