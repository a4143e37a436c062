"""What makes a revision: the fields whose change can change the vectors a deployment serves.

Pooling and normalisation come from the model's own files, so they are covered by the weights' identity
(source, revision, digest); dtype, quantization and engine change the arithmetic. Replica counts, batch
limits, placement and the rest never change a vector and never make a new revision.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol


class _Model(Protocol):
    source: str
    revision: str | None
    digest: str | None


class _Runtime(Protocol):
    dtype: str
    quantization: str
    engine: str


class _Spec(Protocol):
    model: _Model
    runtime: _Runtime


def identity(spec: _Spec) -> dict[str, Any]:
    """The identity fields of an EmbeddingDeployment spec (camelCase, as status.revisions records them)."""
    return {
        "source": spec.model.source,
        "modelRevision": spec.model.revision,
        "digest": spec.model.digest,
        "dtype": spec.runtime.dtype,
        "quantization": spec.runtime.quantization,
        "engine": spec.runtime.engine,
    }


def hash_identity(fields: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of the identity fields (16 hex: a name, not a security boundary)."""
    canonical = json.dumps({k: fields.get(k) for k in sorted(IDENTITY_FIELDS)}, sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def identity_hash(spec: _Spec) -> str:
    return hash_identity(identity(spec))


IDENTITY_FIELDS = ("source", "modelRevision", "digest", "dtype", "quantization", "engine")
