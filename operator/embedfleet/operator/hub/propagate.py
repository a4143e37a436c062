"""What a spoke needs before a deployment's copy can start there, beyond the copy itself. Pure.

The copy lives in the deployment's namespace, which the hub creates on a spoke where it is missing. An
API-key Secret the spec references (``spec.runtime.apiKeySecret`` / ``apiKeysSecret``) is copied only when
the deployment's PlacementPolicy says ``propagateSecrets: true`` (and the spoke's chart grants the hub that
right): a platform team decides where tenant keys may travel. Otherwise the Secret must already exist on
the spoke; where it does not, the spoke's operator refuses the copy and the hub's ``Placed=False`` quotes
that refusal with the way out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from embedfleet.operator.hub.convert import HUB_MANAGED_LABEL
from embedfleet.operator.platform import SECRET_REF_FIELDS


@dataclass(frozen=True)
class Needs:
    namespace: str
    secrets: tuple[str, ...] = ()  # namespace/name of Secrets to copy


def referenced_secrets(hub_obj: Mapping[str, Any]) -> list[str]:
    """``namespace/name`` of each Secret the spec references."""
    namespace = hub_obj["metadata"]["namespace"]
    runtime = ((hub_obj.get("spec") or {}).get("runtime") or {})
    names = [(runtime.get(f) or {}).get("name") for f in SECRET_REF_FIELDS]
    return sorted({f"{namespace}/{n}" for n in names if n})


def needs_of(hub_obj: Mapping[str, Any], propagate_secrets: bool) -> Needs:
    namespace = hub_obj["metadata"]["namespace"]
    return Needs(namespace, tuple(referenced_secrets(hub_obj)) if propagate_secrets else ())


def secret_copy(source: Mapping[str, Any], cluster: str) -> tuple[dict[str, Any], str]:
    """(the Secret to write on spoke ``cluster``, a fingerprint of its content). It keeps the hub's labels
    (the platform's required tenant label among them), never its annotations: kubectl's last-applied
    configuration there holds the data in clear."""
    meta = source.get("metadata") or {}
    labels = {**dict(meta.get("labels") or {}), HUB_MANAGED_LABEL: cluster}
    manifest = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": labels},
        "type": source.get("type") or "Opaque",
        "data": dict(source.get("data") or {}),
    }
    fingerprint = hashlib.sha256(json.dumps([labels, manifest["type"], manifest["data"]],
                                            sort_keys=True).encode()).hexdigest()
    return manifest, fingerprint
