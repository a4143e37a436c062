"""How a cache spec reads for pre-pulling: the node pools it selects and the source the puller is given.

One reading for the three places that need it: the renderer (a runtime pod's ``embedfleet cache pull``
init container), the node agent (`embedfleet cache agent`, which fills the node cache) and the ModelCache
status (which counts the nodes the agent serves). It lives beside the models, not in render/, so the
node agent imports neither the renderer nor the rollout code behind it (tests/packaging/test_boundaries.py).
"""

from __future__ import annotations

import urllib.parse

from embedfleet.operator.crd.models import EmbeddingDeploymentSpec, ModelSource, NodePool


def node_pools(selector: dict[str, str], pools: list[NodePool]) -> list[NodePool]:
    """The node pools a cache spec names; none means one pool of ``selector`` (the node agent and the
    ModelCache status use this, so both count the same nodes)."""
    return list(pools) or [NodePool(name="default", node_selector=dict(selector))]


def pull_source(model: ModelSource) -> str:
    """The source as `embedfleet cache pull --source` takes it (an hf:// revision travels as ``@rev``);
    the node agent pulls with the same string."""
    if model.source.startswith("hf://") and model.revision:
        return f"{model.source}@{model.revision}"
    return model.source


def shares_engine_builds(spec: EmbeddingDeploymentSpec) -> bool:
    """Whether the runtime pods of ``spec`` build an engine from the weights at start-up (``dtype: int8``, an
    OpenVINO build; ``engine: trtllm``, a TensorRT-LLM plan) and keep it on the node for the next pod and for
    other nodes' agents: only with pre-pull (the node cache is on) and a downloaded model (the weights have a
    digest to key the builds by). The renderer mounts the tenant's engines folder for these; the node agent
    creates, publishes and fetches it for these."""
    scheme = urllib.parse.urlsplit(spec.model.source).scheme
    builds = spec.runtime.dtype == "int8" or spec.runtime.engine == "trtllm"
    return bool(spec.cache.pre_pull and builds and spec.model.digest and scheme not in ("file", "pvc"))
