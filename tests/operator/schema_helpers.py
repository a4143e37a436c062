"""Test-side helpers: check objects against the generated CRD schema and the Kubernetes client models.

Pure checks without an API server (unit tests of rendering and the CRD models); the real server's
judgement is in test_crd_server.py and the tests on the test control plane.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jsonschema
from kubernetes import client

from embedfleet.operator.crd.schema import openapi_schema

MODELS = {
    "Deployment": client.V1Deployment,
    "DaemonSet": client.V1DaemonSet,
    "Service": client.V1Service,
    "ServiceAccount": client.V1ServiceAccount,
    "ConfigMap": client.V1ConfigMap,
    "PodDisruptionBudget": client.V1PodDisruptionBudget,
    "ClusterRoleBinding": client.V1ClusterRoleBinding,
    "PersistentVolume": client.V1PersistentVolume,
    "PersistentVolumeClaim": client.V1PersistentVolumeClaim,
}


def _to_draft4(node: Any) -> Any:
    """OpenAPI v3.0 -> JSON Schema draft 4: ``nullable`` becomes a null type; x- keys are ignored anyway."""
    if isinstance(node, dict):
        out = {k: _to_draft4(v) for k, v in node.items()}
        if out.pop("nullable", False) and "type" in out:
            out = {
                "anyOf": [
                    {k: v for k, v in out.items() if k not in ("description", "default")},
                    {"type": "null"},
                ]
            }
        return out
    if isinstance(node, list):
        return [_to_draft4(v) for v in node]
    return node


def cr_validator(kind: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(_to_draft4(openapi_schema(kind)))


def cr_errors(kind: str, obj: Mapping[str, Any]) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in cr_validator(kind).iter_errors(obj)
    ]


def apply_defaults(schema: Mapping[str, Any], obj: Any) -> Any:
    """API-server style structural defaulting: fill absent fields with ``default``, recursively."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = apply_defaults(sub, obj[name])
    elif isinstance(obj, list) and "items" in schema:
        obj = [apply_defaults(schema["items"], item) for item in obj]
    return obj


def _subset(sent: Any, back: Any, path: str = "") -> list[str]:
    if isinstance(sent, Mapping):
        if not isinstance(back, Mapping):
            return [f"{path}: became {back!r}"]
        problems = []
        for key, value in sent.items():
            if key not in back:
                problems.append(f"{path}.{key}: unknown field (dropped by the model)")
            else:
                problems += _subset(value, back[key], f"{path}.{key}")
        return problems
    if isinstance(sent, list):
        if not isinstance(back, list) or len(back) != len(sent):
            return [f"{path}: list changed"]
        return [
            p for i, (a, b) in enumerate(zip(sent, back, strict=True)) for p in _subset(a, b, f"{path}[{i}]")
        ]
    return [] if sent == back or str(sent) == str(back) else [f"{path}: {sent!r} became {back!r}"]


def k8s_model_problems(manifest: Mapping[str, Any]) -> list[str]:
    """Parse with the official client's model (types, required fields) and check no key was unknown."""
    model = MODELS[manifest["kind"]].from_dict(copy.deepcopy(dict(manifest)))
    back = client.ApiClient().sanitize_for_serialization(model)
    return _subset(manifest, back)
