"""Which revision an object belongs to (docs/rollouts.md): the default run, the names and labels of a
revision's objects, and the spec a revision runs. Every per-kind module renders one revision at a time
through these, so naming a revision's objects is decided once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from embedfleet.compat.identity import identity
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.rollout.revisions import Run

#: The first revision of a deployment that has no status yet: r1, in vector space r1.
FIRST_REVISION = "r1"
#: Pod component of a revision that runs beside the primary Deployment (a candidate or side by side):
#: the primary's selector, status.selector, the PDB and the autoscaler never see its pods.
REVISION_COMPONENT = "revision"


def default_runs(spec: EmbeddingDeploymentSpec) -> list[Run]:
    """Before status records any revision: the spec's identity is r1, alone in vector space r1."""
    return [Run(FIRST_REVISION, identity(spec), FIRST_REVISION, True)]


def revision_object_name(name: str, revision: str) -> str:
    """``<name>-rN``: the Deployment and Service of a revision that is not the current one."""
    return f"{name}-{revision}"


def revision_config_map_name(name: str, revision: str) -> str:
    return f"{revision_object_name(name, revision)}-config"


def spec_for(spec: EmbeddingDeploymentSpec, ident: Mapping[str, Any]) -> EmbeddingDeploymentSpec:
    """The spec with a revision's identity fields (model source, revision, digest, dtype, quantization,
    engine) in place of its own: everything else (replicas, limits, placement) is the spec's."""
    model = spec.model.model_copy(update={"source": ident["source"], "revision": ident.get("modelRevision"),
                                          "digest": ident.get("digest")})
    runtime = spec.runtime.model_copy(update={"dtype": ident.get("dtype") or spec.runtime.dtype,
                                              "quantization": ident.get("quantization") or spec.runtime.quantization,
                                              "engine": ident.get("engine") or spec.runtime.engine})
    return spec.model_copy(update={"model": model, "runtime": runtime})


def revision_labels(run: Run) -> dict[str, str]:
    return {naming.REVISION_LABEL: run.revision, naming.VECTOR_SPACE_LABEL: run.vector_space}
