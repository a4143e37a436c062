"""How a cache spec reads for pre-pulling: the node pools it selects and the source the puller is given.

One reading for the three places that need it: the renderer (a runtime pod's ``embedfleet cache pull``
init container), the node agent (`embedfleet cache agent`, which fills the node cache) and the ModelCache
status (which counts the nodes the agent serves). It lives beside the models, not in render/, so the
node agent imports neither the renderer nor the rollout code behind it (tests/packaging/test_boundaries.py).
"""

from __future__ import annotations

from embedfleet.operator.crd.models import ModelSource, NodePool


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
